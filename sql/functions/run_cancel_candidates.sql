CREATE OR REPLACE FUNCTION ql3.run_cancel_candidates(p_after_run_id text, p_limit integer)
RETURNS TABLE (run_id text, cancel_requested_at_ms bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  PERFORM ql3.require_role('run_cancel_candidates', 'ql3_runtime');
  IF p_limit IS NULL OR p_limit < 1 OR p_limit > 64 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'limit: must be 1..64';
  END IF;
  RETURN QUERY SELECT r.id, r.cancel_requested_at_ms FROM ql3.runs r
   WHERE r.status = 'running' AND r.cancel_requested_at_ms IS NOT NULL
     AND (p_after_run_id IS NULL OR r.id > p_after_run_id)
   ORDER BY r.id LIMIT p_limit;
END
$fn$;
COMMENT ON FUNCTION ql3.run_cancel_candidates(text, integer) IS
  'Role ql3_runtime. Keyset page (by run id, after p_after_run_id; NULL for the first page) of at most p_limit (1..64) running Runs with a cancel request, served by the partial index runs_cancel_pending_idx. Returns (run_id, cancel_requested_at_ms). Errors: QL002, QL601. Source: ADR-0228.';
REVOKE ALL ON FUNCTION ql3.run_cancel_candidates(text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.run_cancel_candidates(text, integer) TO ql3_runtime;
