CREATE OR REPLACE FUNCTION ql3.attempt_running(p_attempt_id text, p_lease_token text)
RETURNS TABLE (attempt_id text, status text, step_run_version integer, attempt_count integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  a ql3.run_attempts;
  s ql3.step_runs;
BEGIN
  PERFORM ql3.require_role('attempt_running', 'ql3_worker_ingress');
  a := ql3.attempt_lock(p_attempt_id, p_lease_token);
  SELECT * INTO s FROM ql3.step_runs WHERE id = a.step_run_id;
  IF a.status = 'running' THEN  -- replay of a lost response
    RETURN QUERY SELECT a.id, a.status, s.version, s.attempt_count;
    RETURN;
  END IF;
  IF a.status <> 'starting' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203', MESSAGE = pg_catalog.format('attempt %s is %s, not starting', a.id, a.status);
  END IF;
  s := ql3.attempt_enter_running(a);
  SELECT * INTO a FROM ql3.run_attempts WHERE id = a.id;
  RETURN QUERY SELECT a.id, a.status, s.version, s.attempt_count;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_running(text, text) IS
  'Role ql3_worker_ingress. Activation (ADR-0227 §4): the lease holder reports its process running: attempt starting -> running and, atomically, StepRun ready -> running (version + 1, attempt_count + 1, max 64). The parent Run stays running; only its version/event_sequence move. A replay while running returns the same answer. Returns (attempt_id, status, step_run_version, attempt_count). Errors: QL401 lease invalid/expired, QL203 not starting or StepRun not ready at the attempt''s epoch, QL002 attempt_count > 64, QL601.';
REVOKE ALL ON FUNCTION ql3.attempt_running(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.attempt_running(text, text) TO ql3_worker_ingress;
