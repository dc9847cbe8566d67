CREATE OR REPLACE FUNCTION ql3.json_require_keys(p_obj jsonb, p_field text, p_required text[], p_optional text[] DEFAULT '{}')
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  k text;
BEGIN
  IF p_obj IS NULL OR pg_catalog.jsonb_typeof(p_obj) <> 'object' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('%s: must be an object', p_field);
  END IF;
  FOR k IN SELECT pg_catalog.jsonb_object_keys(p_obj) LOOP
    IF NOT (k = ANY (p_required) OR k = ANY (p_optional)) THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001',
        MESSAGE = pg_catalog.format('%s: unknown field %s', p_field, pg_catalog.quote_ident(pg_catalog.left(k, 64)));
    END IF;
  END LOOP;
  FOREACH k IN ARRAY p_required LOOP
    IF NOT (p_obj ? k) OR pg_catalog.jsonb_typeof(p_obj -> k) = 'null' THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('%s.%s: required', p_field, k);
    END IF;
  END LOOP;
  RETURN p_obj;
END
$fn$;
COMMENT ON FUNCTION ql3.json_require_keys(jsonb, text, text[], text[]) IS
  'Internal (owner only). Returns p_obj when it is a JSON object holding every key of p_required (non-null) and no key outside p_required and p_optional; else raises QL001 naming p_field and the key. Used by every contract that rejects unknown fields (plans, receipts, manifests).';
REVOKE ALL ON FUNCTION ql3.json_require_keys(jsonb, text, text[], text[]) FROM PUBLIC;
