CREATE OR REPLACE FUNCTION ql3.lease_control(p_attempt_id text, p_lease_token text, p_extend_ms integer)
RETURNS TABLE (decision text, reason text, lease_expires_at_ms bigint, deadline_at_ms bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  a ql3.run_attempts;
  r ql3.runs;
  v_now bigint;
  v_reason text;
  v_revived boolean := false;
BEGIN
  PERFORM ql3.require_role('lease_control', 'ql3_worker_ingress');
  IF p_extend_ms IS NULL OR p_extend_ms < 1000 OR p_extend_ms > 3600000 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'extend_ms: must be 1000..3600000';
  END IF;
  a := ql3.lease_check(p_attempt_id, p_lease_token, false);
  SELECT * INTO r FROM ql3.runs WHERE id = a.run_id;
  v_now := ql3.now_ms();
  IF r.cancel_requested_at_ms IS NOT NULL THEN
    v_reason := 'cancel';
  ELSIF a.deadline_at_ms IS NOT NULL AND v_now > a.deadline_at_ms AND a.status IN ('starting', 'running') THEN
    v_reason := 'timeout';
    IF a.stop_reason IS NULL THEN
      -- Write the task-level timeout intent exactly once, under the Run lock (never the Run's cancel fields).
      PERFORM ql3.advisory_lock('run', a.run_id);
      PERFORM ql3.advisory_lock('attempt', a.id);
      SELECT * INTO a FROM ql3.run_attempts WHERE id = a.id FOR UPDATE;
      IF a.stop_reason IS NULL AND a.status IN ('starting', 'running') THEN
        PERFORM ql3.run_event_append(a.run_id, 'workflow.task_timeout_requested', a.step_run_id, a.id,
          pg_catalog.jsonb_build_object('deadline_at_ms', a.deadline_at_ms, 'observed_at_ms', v_now,
                                        'attempt', a.attempt));
        UPDATE ql3.run_attempts SET stop_reason = 'timeout' WHERE id = a.id;
      END IF;
    END IF;
  ELSIF r.status <> 'running' THEN
    v_reason := 'run_ended';
  END IF;
  -- A holder heartbeating again after recovery found its lease expired and parked the attempt
  -- (retry/manual, waiting for evidence) is the evidence: it is alive. Close that control (advisory
  -- locks before any row lock, in the global order run -> attempt -> recovery).
  IF EXISTS (SELECT 1 FROM ql3.run_recovery_controls x WHERE x.attempt_id = a.id AND x.status IN ('retry', 'manual')) THEN
    PERFORM ql3.advisory_lock('run', a.run_id);
    PERFORM ql3.advisory_lock('attempt', a.id);
    PERFORM ql3.advisory_lock('recovery', a.id);
    v_revived := true;
  END IF;
  -- Extend the live lease only (row lock order as recovery: attempt, then lease). When recovery or
  -- convergence ended the lease while this call waited for the row, the holder learns it now (QL401)
  -- instead of being told to continue.
  UPDATE ql3.run_attempts ra SET lease_expires_at_ms = GREATEST(ra.lease_expires_at_ms, v_now + p_extend_ms)
   WHERE ra.id = a.id AND ra.lease_active AND ra.status IN ('claimed', 'starting', 'running')
  RETURNING ra.lease_expires_at_ms INTO lease_expires_at_ms;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL401',
      MESSAGE = pg_catalog.format('lease of attempt %s ended (attempt ended or recovered)', a.id);
  END IF;
  UPDATE ql3.run_dispatch_leases l SET expires_at_ms = lease_expires_at_ms
   WHERE l.attempt_id = a.id AND l.status = 'leased' AND l.token_sha256 = ql3.lease_token_digest(p_lease_token);
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL401',
      MESSAGE = pg_catalog.format('lease of attempt %s ended (attempt ended or recovered)', a.id);
  END IF;
  IF v_revived THEN
    UPDATE ql3.run_recovery_controls x
       SET status = 'resolved', resolution = 'holder_returned', updated_at_ms = v_now, failure_count = 0,
           last_evidence = NULL, evidence_source = NULL
     WHERE x.attempt_id = a.id AND x.status IN ('retry', 'manual');
  END IF;
  decision := CASE WHEN v_reason IS NULL THEN 'continue' ELSE 'stop_requested' END;
  reason := v_reason;
  deadline_at_ms := a.deadline_at_ms;
  RETURN NEXT;
END
$fn$;
COMMENT ON FUNCTION ql3.lease_control(text, text, integer) IS
  'Role ql3_worker_ingress. Lease heartbeat and stop channel for one attempt (ADR-0227 §4-5). Verifies the lease token (QL401 otherwise), extends the lease to database time + p_extend_ms (1000..3600000 ms) and answers (decision continue|stop_requested, reason NULL|cancel|timeout|run_ended, lease_expires_at_ms, deadline_at_ms). When database time has passed the attempt''s deadline_at_ms it answers stop_requested(timeout) and writes exactly one workflow.task_timeout_requested event bound to the StepRun and Attempt; it never writes the Run''s cancel_requested_at_ms. A whole-run cancel request answers stop_requested(cancel) (it wins over a timeout). Only a live lease is extended: a lease ended by completion, convergence or recovery answers QL401 (the worker must stop). A holder that heartbeats again after recovery parked its expired lease (control retry or manual) proves it is alive: the lease is renewed and the control closes as resolved/holder_returned (failure count and evidence cleared). Errors: QL001, QL401, QL601.';
REVOKE ALL ON FUNCTION ql3.lease_control(text, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.lease_control(text, text, integer) TO ql3_worker_ingress;
