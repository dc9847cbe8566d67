CREATE OR REPLACE FUNCTION ql3.check_id(p_value text, p_field text, p_max_bytes integer DEFAULT 36) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  IF p_value IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('%s: must not be null', p_field);
  END IF;
  IF pg_catalog.octet_length(p_value) > p_max_bytes THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001',
      MESSAGE = pg_catalog.format('%s: longer than %s bytes', p_field, p_max_bytes);
  END IF;
  IF p_value !~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001',
      MESSAGE = pg_catalog.format('%s: %s is not a portable id (^[A-Za-z0-9][A-Za-z0-9._:-]*$)',
                                  p_field, pg_catalog.quote_literal(pg_catalog.left(p_value, 80)));
  END IF;
  RETURN p_value;
END
$fn$;
COMMENT ON FUNCTION ql3.check_id(text, text, integer) IS
  'Internal (owner only). Returns p_value when it is a portable id (^[A-Za-z0-9][A-Za-z0-9._:-]*$, at most p_max_bytes bytes: 36 for ids, 128 for StepRun ids); else raises QL001 naming p_field. Source: DESIGN §6.';
REVOKE ALL ON FUNCTION ql3.check_id(text, text, integer) FROM PUBLIC;
