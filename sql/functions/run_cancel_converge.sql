CREATE OR REPLACE FUNCTION ql3.run_cancel_converge(p_run_id text, p_limit integer)
RETURNS TABLE (changed integer, in_flight integer, run_status text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  r ql3.runs;
  a record;
  s record;
  v_changed integer := 0;
  v_now bigint;
BEGIN
  PERFORM ql3.require_role('run_cancel_converge', 'ql3_runtime');
  PERFORM ql3.check_id(p_run_id, 'run_id');
  IF p_limit IS NULL OR p_limit < 1 OR p_limit > 1024 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'limit: must be 1..1024';
  END IF;
  PERFORM ql3.advisory_lock('run', p_run_id);
  SELECT * INTO r FROM ql3.runs x WHERE x.id = p_run_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('run %s not found', p_run_id);
  END IF;
  IF r.status <> 'running' OR r.cancel_requested_at_ms IS NULL THEN
    RETURN QUERY SELECT 0, 0, r.status;
    RETURN;
  END IF;
  -- Unstarted attempts (claimed, leased or not) are cancelled with their StepRun: nothing ran yet.
  FOR a IN SELECT ra.id, ra.step_run_id FROM ql3.run_attempts ra
            WHERE ra.run_id = p_run_id AND ra.status = 'claimed' ORDER BY ra.attempt LIMIT p_limit LOOP
    PERFORM ql3.advisory_lock('attempt', a.id);
    v_now := (ql3.run_event_append(p_run_id, 'workflow.task_attempt_cancelled', a.step_run_id, a.id,
                pg_catalog.jsonb_build_object('reason', 'run cancel', 'before_start', true))).at_ms;
    UPDATE ql3.run_attempts SET status = 'cancelled', ended_at_ms = v_now, lease_active = false,
           stop_reason = 'cancel' WHERE id = a.id;
    UPDATE ql3.run_dispatch_leases SET status = 'released', ended_at_ms = v_now, end_reason = 'cancel'
     WHERE attempt_id = a.id AND status = 'leased';
    v_changed := v_changed + 1;
  END LOOP;
  -- Pending and ready StepRuns without a started attempt are cancelled.
  FOR s IN SELECT sr.id FROM ql3.step_runs sr
            WHERE sr.run_id = p_run_id AND sr.status IN ('pending', 'ready')
              AND NOT EXISTS (SELECT 1 FROM ql3.run_attempts ra WHERE ra.step_run_id = sr.id
                               AND ra.status IN ('claimed', 'starting', 'running'))
            ORDER BY sr.step_key LIMIT GREATEST(p_limit - v_changed, 0) LOOP
    PERFORM ql3.step_run_transition(s.id, 'cancelled', 'run cancel requested');
    v_changed := v_changed + 1;
  END LOOP;
  -- Work past the start barrier is left to its worker's report (stop_requested(cancel)) or recovery.
  run_status := ql3.run_aggregate(p_run_id);
  SELECT pg_catalog.count(*)::integer INTO in_flight FROM ql3.run_attempts ra
   WHERE ra.run_id = p_run_id AND ra.status IN ('claimed', 'starting', 'running');
  changed := v_changed;
  RETURN NEXT;
END
$fn$;
COMMENT ON FUNCTION ql3.run_cancel_converge(text, integer) IS
  'Role ql3_runtime. Converges one Run with a cancel request (ADR-0228), at most p_limit (1..1024) changes per call under the Run lock: cancels unstarted (claimed) attempts and their leases, cancels pending and ready StepRuns without a started attempt, never marks work past the start barrier (starting/running) cancelled — it ends by its worker''s report after stop_requested(cancel) or by recovery — and ends the Run cancelled once every StepRun is terminal. Returns (changed, in_flight attempts left, run_status). Call again while changed > 0 or in_flight > 0. Errors: QL001, QL002, QL101, QL601.';
REVOKE ALL ON FUNCTION ql3.run_cancel_converge(text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.run_cancel_converge(text, integer) TO ql3_runtime;
