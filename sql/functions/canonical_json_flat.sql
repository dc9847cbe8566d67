CREATE OR REPLACE FUNCTION ql3.canonical_json_flat(p_doc jsonb) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  -- Fast path of ql3.canonical_json for the flat receipts of the step hot path: an object whose
  -- keys are printable ASCII (so byte order = RFC 8785's UTF-16 order) and whose values are
  -- strings, booleans, null or integers of at most 15 digits. Strings and keys are escaped by
  -- jsonb's output (the JCS escapes for valid text). Anything else takes ql3.canonical_json.
  IF pg_catalog.jsonb_typeof(p_doc) <> 'object' OR EXISTS (
       SELECT 1 FROM pg_catalog.jsonb_each(p_doc) e
        WHERE e.key !~ '^[ -~]*$'
           OR pg_catalog.jsonb_typeof(e.value) IN ('object', 'array')
           OR (pg_catalog.jsonb_typeof(e.value) = 'number' AND e.value::text !~ '^(0|-?[1-9][0-9]{0,14})$')) THEN
    RETURN ql3.canonical_json(p_doc::json);
  END IF;
  RETURN '{' || COALESCE((SELECT pg_catalog.string_agg(pg_catalog.to_json(e.key)::text || ':' || e.value::text, ','
                                                       ORDER BY e.key COLLATE "C")
                            FROM pg_catalog.jsonb_each(p_doc) e), '') || '}';
END
$fn$;
COMMENT ON FUNCTION ql3.canonical_json_flat(jsonb) IS
  'Internal (owner only). RFC 8785 canonical text of a flat jsonb object (printable-ASCII keys; string, boolean, null or integer values of at most 15 digits) without the general walk; byte-identical to ql3.canonical_json(p_doc::json), which it falls back to for any other document. Used for the attempt admission and completion receipts on the step hot path. Source: DESIGN §6.';
REVOKE ALL ON FUNCTION ql3.canonical_json_flat(jsonb) FROM PUBLIC;
