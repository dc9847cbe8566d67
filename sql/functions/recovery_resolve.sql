CREATE OR REPLACE FUNCTION ql3.recovery_resolve(p_attempt_id text, p_claim_token text)
RETURNS TABLE (attempt_id text, status text, resolution text, attempt_status text, step_run_status text,
               next_claim_at_ms bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  a ql3.run_attempts;
  rc ql3.run_recovery_controls;
  r ql3.runs;
  s ql3.step_runs;
  ad ql3.task_attempt_admissions;
  v_now bigint;
  v_res text;
  v_status text;
  v_next bigint;
  v_alive boolean := false;
  ev record;
BEGIN
  PERFORM ql3.require_role('recovery_resolve', 'ql3_runtime');
  IF p_attempt_id IS NULL OR p_claim_token IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'attempt_id and claim_token are required';
  END IF;
  SELECT * INTO a FROM ql3.run_attempts x WHERE x.id = p_attempt_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('attempt %s not found', pg_catalog.left(p_attempt_id, 36));
  END IF;
  -- Same authority as activation and completion: Run lock, then the attempt advisory lock, then the control.
  PERFORM ql3.advisory_lock('run', a.run_id);
  PERFORM ql3.advisory_lock('attempt', a.id);
  PERFORM ql3.advisory_lock('recovery', a.id);
  SELECT * INTO rc FROM ql3.run_recovery_controls x WHERE x.attempt_id = p_attempt_id FOR UPDATE;
  v_now := ql3.now_ms();
  IF NOT FOUND OR rc.status <> 'claimed' OR rc.claim_token_sha256 <> ql3.lease_token_digest(p_claim_token)
     OR rc.claim_expires_at_ms < v_now THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('recovery claim of attempt %s is not held by this token (expired or re-claimed)', p_attempt_id);
  END IF;
  -- Re-check Run, Attempt, admission receipt and StepRun snapshot in this transaction.
  SELECT * INTO a FROM ql3.run_attempts x WHERE x.id = p_attempt_id FOR UPDATE;
  SELECT * INTO r FROM ql3.runs x WHERE x.id = a.run_id;
  SELECT * INTO s FROM ql3.step_runs x WHERE x.id = a.step_run_id FOR UPDATE;
  SELECT * INTO ad FROM ql3.task_attempt_admissions x WHERE x.attempt_id = a.id;
  IF ad.attempt_id IS NULL OR ad.run_id <> a.run_id OR ad.step_run_id <> a.step_run_id
     OR ad.step_run_version <> a.step_run_version OR ad.execution_digest <> a.execution_digest THEN
    RAISE EXCEPTION USING ERRCODE = 'QL501', MESSAGE = pg_catalog.format('attempt %s does not match its admission receipt', a.id);
  END IF;
  IF s.digest <> ql3.step_run_digest(s.run_id, s.id, s.step_key, s.task_key, s.status, s.version, s.attempt_count, s.ready_at_ms) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL501', MESSAGE = pg_catalog.format('step run %s: stored digest does not verify', s.id);
  END IF;

  IF a.status NOT IN ('claimed', 'starting', 'running') OR NOT a.lease_active OR a.lease_expires_at_ms >= v_now THEN
    -- The attempt ended, or its holder heartbeated in time: nothing to recover. A live holder also
    -- contradicts any evidence given so far: a later expiry starts from scratch.
    v_res := 'no_action'; v_status := 'resolved';
    v_alive := a.status IN ('claimed', 'starting', 'running') AND a.lease_active;
  ELSIF a.status = 'claimed' THEN
    -- Pre-start: no side effect happened. Attempt lost; StepRun ready -> ready opens a new epoch.
    ev := ql3.run_event_append(a.run_id, 'workflow.task_attempt_lost', a.step_run_id, a.id,
            pg_catalog.jsonb_build_object('attempt', a.attempt, 'before_start', true, 'lease_expired_at_ms', a.lease_expires_at_ms));
    UPDATE ql3.run_attempts x SET status = 'lost', ended_at_ms = ev.at_ms, lease_active = false WHERE x.id = a.id;
    UPDATE ql3.run_dispatch_leases l SET status = 'released', ended_at_ms = ev.at_ms, end_reason = 'expired'
     WHERE l.attempt_id = a.id AND l.status = 'leased';
    IF s.status = 'ready' AND s.version = a.step_run_version THEN
      IF r.cancel_requested_at_ms IS NOT NULL THEN
        s := ql3.step_run_transition(s.id, 'cancelled', 'attempt lost before start; run cancel requested', a.id);
        PERFORM ql3.run_aggregate(a.run_id);
      ELSE
        s := ql3.step_run_transition(s.id, 'ready', 'attempt lost before start: new epoch', a.id);
      END IF;
    END IF;
    v_res := 'lost_before_start'; v_status := 'resolved';
  ELSIF rc.last_evidence = 'not_running' THEN
    -- Past the start barrier: only trusted not_running evidence resolves it; no silent retry.
    ev := ql3.run_event_append(a.run_id, 'workflow.task_attempt_lost', a.step_run_id, a.id,
            pg_catalog.jsonb_build_object('attempt', a.attempt, 'before_start', false, 'evidence', 'not_running',
                                          'evidence_source', rc.evidence_source));
    UPDATE ql3.run_attempts x SET status = 'lost', ended_at_ms = ev.at_ms, lease_active = false WHERE x.id = a.id;
    UPDATE ql3.run_dispatch_leases l SET status = 'released', ended_at_ms = ev.at_ms, end_reason = 'lost'
     WHERE l.attempt_id = a.id AND l.status = 'leased';
    IF s.status = 'running' THEN
      s := ql3.step_run_transition(s.id, 'lost', 'attempt lost (not_running evidence)', a.id);
      s := ql3.step_run_transition(s.id, 'failed', 'lost attempt fails its step (no retry past the start barrier)', a.id);
    ELSIF s.status = 'ready' AND s.version = a.step_run_version THEN
      s := ql3.step_run_transition(s.id, 'failed', 'attempt lost while starting (not_running evidence)', a.id);
    END IF;
    PERFORM ql3.frontier_advance(a.run_id, s.id);
    v_res := 'lost_after_start'; v_status := 'resolved';
  ELSE
    UPDATE ql3.run_recovery_controls x SET failure_count = x.failure_count + 1 WHERE x.attempt_id = a.id
      RETURNING * INTO rc;
    IF rc.failure_count >= 5 THEN
      v_res := 'needs_operator'; v_status := 'manual';
    ELSE
      v_res := 'awaiting_evidence'; v_status := 'retry';
      v_next := v_now + LEAST(60000, 1000 * (2 ^ rc.failure_count)::bigint);
    END IF;
  END IF;
  UPDATE ql3.run_recovery_controls x
     SET status = v_status, resolution = v_res, claim_token_sha256 = NULL, claim_expires_at_ms = NULL,
         next_claim_at_ms = COALESCE(v_next, x.next_claim_at_ms), updated_at_ms = v_now,
         failure_count = CASE WHEN v_alive THEN 0 ELSE x.failure_count END,
         last_evidence = CASE WHEN v_alive THEN NULL ELSE x.last_evidence END,
         evidence_source = CASE WHEN v_alive THEN NULL ELSE x.evidence_source END
   WHERE x.attempt_id = a.id;
  SELECT x.status INTO v_res FROM ql3.run_attempts x WHERE x.id = a.id;
  RETURN QUERY SELECT a.id, v_status, (SELECT x.resolution FROM ql3.run_recovery_controls x WHERE x.attempt_id = a.id),
                      v_res, s.status, v_next;
END
$fn$;
COMMENT ON FUNCTION ql3.recovery_resolve(text, text) IS
  'Role ql3_runtime. Resolves one claimed recovery control (ADR-0227 §6) under the same authority as activation and completion (Run lock, attempt advisory lock, then the control), re-checking the claim token, Run, Attempt, admission receipt and StepRun snapshot in one transaction. Rules: attempt ended or lease renewed in time -> resolved/no_action (a live holder also clears the failure count and any evidence recorded so far: it contradicted them); lease expired while claimed -> Attempt lost, StepRun ready -> ready (version and digest bumped, attempt count and ready time kept: a new epoch; cancelled instead under a Run cancel request) -> resolved/lost_before_start; starting/running with trusted not_running evidence (worker restart declaration or operator) -> Attempt lost, StepRun running -> lost -> failed (or ready -> failed from starting), dependents skipped, Run aggregated -> resolved/lost_after_start; otherwise failure_count + 1 -> retry with backoff (2^n s, max 60 s), manual after 5 tries. Never silently retries past the start barrier; the Run-level lost transition is never used. Returns (attempt_id, status, resolution, attempt_status, step_run_status, next_claim_at_ms). Errors: QL001, QL101, QL202 claim not held, QL501 integrity, QL601.';
REVOKE ALL ON FUNCTION ql3.recovery_resolve(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.recovery_resolve(text, text) TO ql3_runtime;
