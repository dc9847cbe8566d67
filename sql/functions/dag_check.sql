CREATE OR REPLACE FUNCTION ql3.dag_check(p_needs jsonb, p_field text) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  v_left jsonb := p_needs;
  v_done text[] := '{}';
  v_progress boolean := true;
  k text;
  n jsonb;
  v_count integer;
BEGIN
  -- p_needs: {step_key: [needed step keys]}. Kahn's algorithm; raises QL001 on an unknown need,
  -- a self-dependency or a cycle.
  FOR k, n IN SELECT * FROM pg_catalog.jsonb_each(p_needs) LOOP
    IF EXISTS (SELECT 1 FROM pg_catalog.jsonb_array_elements_text(n) x WHERE NOT (p_needs ? x)) THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001',
        MESSAGE = pg_catalog.format('%s.%s.needs: names a step that does not exist', p_field, k);
    END IF;
    IF n ? k THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001',
        MESSAGE = pg_catalog.format('%s.%s.needs: a step cannot need itself', p_field, k);
    END IF;
  END LOOP;
  WHILE v_progress AND v_left <> '{}'::jsonb LOOP
    v_progress := false;
    FOR k, n IN SELECT * FROM pg_catalog.jsonb_each(v_left) LOOP
      SELECT pg_catalog.count(*) INTO v_count FROM pg_catalog.jsonb_array_elements_text(n) x
       WHERE NOT (x = ANY (v_done));
      IF v_count = 0 THEN
        v_done := v_done || k;
        v_left := v_left - k;
        v_progress := true;
      END IF;
    END LOOP;
  END LOOP;
  IF v_left <> '{}'::jsonb THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001',
      MESSAGE = pg_catalog.format('%s: needs form a cycle among steps %s', p_field,
        (SELECT pg_catalog.string_agg(x, ', ' ORDER BY x) FROM pg_catalog.jsonb_object_keys(v_left) x));
  END IF;
END
$fn$;
COMMENT ON FUNCTION ql3.dag_check(jsonb, text) IS
  'Internal (owner only). Checks that p_needs ({step_key: [needed step keys]}) is a DAG: every need names an existing step, no step needs itself, no cycle. Raises QL001 naming p_field and the offending steps. Source: ADR-0223 §2.';
REVOKE ALL ON FUNCTION ql3.dag_check(jsonb, text) FROM PUBLIC;
