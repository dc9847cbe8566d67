CREATE OR REPLACE FUNCTION ql3.json_text(p_obj jsonb, p_key text, p_field text, p_max_bytes integer DEFAULT 256)
RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  v jsonb := p_obj -> p_key;
BEGIN
  IF v IS NULL OR pg_catalog.jsonb_typeof(v) <> 'string' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('%s.%s: must be a string', p_field, p_key);
  END IF;
  IF pg_catalog.octet_length(v #>> '{}') = 0 OR pg_catalog.octet_length(v #>> '{}') > p_max_bytes THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001',
      MESSAGE = pg_catalog.format('%s.%s: must be 1..%s bytes', p_field, p_key, p_max_bytes);
  END IF;
  RETURN v #>> '{}';
END
$fn$;
COMMENT ON FUNCTION ql3.json_text(jsonb, text, text, integer) IS
  'Internal (owner only). Returns p_obj->>p_key when it is a JSON string of 1..p_max_bytes bytes; else raises QL001 naming p_field.p_key.';
REVOKE ALL ON FUNCTION ql3.json_text(jsonb, text, text, integer) FROM PUBLIC;
