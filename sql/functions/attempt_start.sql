CREATE OR REPLACE FUNCTION ql3.attempt_start(p_attempt_id text, p_lease_token text)
RETURNS TABLE (attempt_id text, status text, deadline_at_ms bigint, started_at_ms bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  a ql3.run_attempts;
  r ql3.runs;
  s ql3.step_runs;
  ev record;
BEGIN
  PERFORM ql3.require_role('attempt_start', 'ql3_worker_ingress');
  -- Fence the token first without the expiry rule: a replay of a lost answer (attempt already
  -- starting under this same lease) is answered even if the outage outlasted the lease.
  a := ql3.attempt_lock(p_attempt_id, p_lease_token, true);
  IF a.status = 'starting' THEN  -- replay of a lost response
    RETURN QUERY SELECT a.id, a.status, a.deadline_at_ms, a.started_at_ms;
    RETURN;
  END IF;
  -- Crossing the start barrier needs an unexpired lease.
  PERFORM ql3.lease_check(p_attempt_id, p_lease_token, false, false);
  IF a.status <> 'claimed' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203', MESSAGE = pg_catalog.format('attempt %s is %s, not claimed', a.id, a.status);
  END IF;
  SELECT * INTO r FROM ql3.runs WHERE id = a.run_id;
  IF r.status <> 'running' OR r.cancel_requested_at_ms IS NOT NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203',
      MESSAGE = pg_catalog.format('attempt %s: run %s is %s%s; do not start', a.id, r.id, r.status,
                                  CASE WHEN r.cancel_requested_at_ms IS NOT NULL THEN ' with a cancel request' ELSE '' END);
  END IF;
  SELECT * INTO s FROM ql3.step_runs WHERE id = a.step_run_id;
  IF s.status <> 'ready' OR s.version <> a.step_run_version THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('attempt %s: step run %s moved to %s v%s', a.id, s.id, s.status, s.version);
  END IF;
  ev := ql3.run_event_append(a.run_id, 'workflow.task_attempt_starting', a.step_run_id, a.id,
          pg_catalog.jsonb_build_object('attempt', a.attempt, 'worker_id', a.worker_id,
                                        'deadline_at_ms', ql3.now_ms() + a.timeout_ms));
  UPDATE ql3.run_attempts ra SET status = 'starting', started_at_ms = ev.at_ms,
         deadline_at_ms = ev.at_ms + ra.timeout_ms
   WHERE ra.id = a.id RETURNING * INTO a;
  RETURN QUERY SELECT a.id, a.status, a.deadline_at_ms, a.started_at_ms;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_start(text, text) IS
  'Role ql3_worker_ingress. The start barrier (ADR-0227 §4): claimed -> starting for the lease holder, setting deadline_at_ms = database time + the revision''s timeout_ms; appends workflow.task_attempt_starting (Run stays running, only its version/event_sequence move; the StepRun stays ready). A replay while starting returns the same row. Returns (attempt_id, status, deadline_at_ms, started_at_ms). Errors: QL401 lease invalid/expired, QL202 StepRun moved, QL203 attempt not claimed or Run cancelled/ended (do not start), QL601.';
REVOKE ALL ON FUNCTION ql3.attempt_start(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.attempt_start(text, text) TO ql3_worker_ingress;
