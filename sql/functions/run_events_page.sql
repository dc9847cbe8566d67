CREATE OR REPLACE FUNCTION ql3.run_events_page(p_run_id text, p_after_sequence bigint, p_limit integer)
RETURNS TABLE (sequence bigint, type text, step_run_id text, attempt_id text, payload jsonb, at_ms bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  PERFORM ql3.require_role('run_events_page', 'ql3_admin');
  PERFORM ql3.check_id(p_run_id, 'run_id');
  IF p_limit IS NULL OR p_limit < 1 OR p_limit > 1000 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'limit: must be 1..1000';
  END IF;
  RETURN QUERY SELECT e.sequence, e.type, e.step_run_id, e.attempt_id, e.payload, e.at_ms
    FROM ql3.run_events e
   WHERE e.run_id = p_run_id AND e.sequence > COALESCE(p_after_sequence, 0)
   ORDER BY e.sequence LIMIT p_limit;
END
$fn$;
COMMENT ON FUNCTION ql3.run_events_page(text, bigint, integer) IS
  'Role ql3_admin. Audit trail of one Run, keyset-paged: RunEvents with sequence > p_after_sequence (NULL = from the start), at most p_limit (1..1000), ordered by sequence. Returns (sequence, type, step_run_id, attempt_id, payload jsonb, at_ms). Errors: QL001 bad id, QL002 limit, QL601.';
REVOKE ALL ON FUNCTION ql3.run_events_page(text, bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.run_events_page(text, bigint, integer) TO ql3_admin;
