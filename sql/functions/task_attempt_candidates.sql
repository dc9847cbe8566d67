CREATE OR REPLACE FUNCTION ql3.task_attempt_candidates(p_after_run_id text, p_after_step_run_id text, p_limit integer)
RETURNS TABLE (run_id text, step_run_id text, step_run_version integer, step_run_digest text,
               step_key text, task_key text, ready_at_ms bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  PERFORM ql3.require_role('task_attempt_candidates', 'ql3_runtime');
  IF p_limit IS NULL OR p_limit < 1 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'limit: must be 1..64';
  END IF;
  IF p_limit > 64 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'limit: a candidate page holds at most 64 StepRuns';
  END IF;
  IF (p_after_run_id IS NULL) <> (p_after_step_run_id IS NULL) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'after_run_id and after_step_run_id: give both or neither';
  END IF;
  -- Keyset page over the partial index step_runs_candidates_idx (ready epochs without a winner).
  -- The cursor is always an index condition (ids are never empty, so '' starts at the beginning);
  -- runs_admissible_idx keeps the Run side of the join off the finished history too.
  RETURN QUERY
  SELECT s.run_id, s.id, s.version, s.digest, s.step_key, s.task_key, s.ready_at_ms
    FROM ql3.step_runs s
    JOIN ql3.runs r ON r.id = s.run_id
   WHERE s.status = 'ready' AND NOT s.epoch_admitted
     AND (s.run_id, s.id) > (COALESCE(p_after_run_id, ''), COALESCE(p_after_step_run_id, ''))
     AND r.status = 'running' AND r.cancel_requested_at_ms IS NULL
   ORDER BY s.run_id, s.id
   LIMIT p_limit;
END
$fn$;
COMMENT ON FUNCTION ql3.task_attempt_candidates(text, text, integer) IS
  'Role ql3_runtime. Keyset page (ordered by run_id, step_run_id; start after (p_after_run_id, p_after_step_run_id), both NULL for the first page) of at most p_limit (1..64) ready StepRuns whose current epoch (run, step run, version) has no admission winner, excluding Runs that are not running or have a cancel request. Served by the partial index step_runs_candidates_idx, so the cost does not grow with history. Returns (run_id, step_run_id, step_run_version, step_run_digest, step_key, task_key, ready_at_ms). Errors: QL001 bad cursor/limit, QL002 limit > 64, QL601. Source: ADR-0227 §3.';
REVOKE ALL ON FUNCTION ql3.task_attempt_candidates(text, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.task_attempt_candidates(text, text, integer) TO ql3_runtime;
