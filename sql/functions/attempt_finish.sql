CREATE OR REPLACE FUNCTION ql3.attempt_finish(a ql3.run_attempts, p_kind text, p_reported text, p_exit_code integer,
                                              p_detail jsonb, p_token_sha256 text)
RETURNS ql3.run_attempt_completions
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  r ql3.runs;
  s ql3.step_runs;
  l ql3.run_dispatch_leases;
  c ql3.run_attempt_completions;
  ev record;
  v_now bigint := ql3.now_ms();
  v_final text;
  v_receipt jsonb;
BEGIN
  -- Caller holds the Run lock and attempt authority and has fenced the lease.
  -- The deadline is re-checked against database time: past it, the outcome is timed_out.
  IF a.deadline_at_ms IS NOT NULL AND v_now > a.deadline_at_ms THEN
    v_final := 'timed_out';
  ELSIF p_reported = 'timed_out' THEN
    v_final := 'failed';      -- the database clock, not the worker's, decides a timeout
  ELSIF p_reported = 'cancelled' THEN
    SELECT * INTO r FROM ql3.runs WHERE id = a.run_id;
    v_final := CASE WHEN r.cancel_requested_at_ms IS NOT NULL THEN 'cancelled' ELSE 'failed' END;
  ELSE
    v_final := p_reported;
  END IF;
  IF p_kind = 'complete' AND a.status = 'starting' THEN
    -- Crash window: the worker completed straight from starting; record ready -> running -> terminal.
    PERFORM ql3.attempt_enter_running(a);
    SELECT * INTO a FROM ql3.run_attempts WHERE id = a.id;
  END IF;
  ev := ql3.run_event_append(a.run_id, 'workflow.task_attempt_' || v_final, a.step_run_id, a.id,
          pg_catalog.jsonb_build_object('attempt', a.attempt, 'reported', p_reported, 'exit_code', p_exit_code,
                                        'kind', p_kind, 'detail', COALESCE(p_detail, '{}'::jsonb)));
  UPDATE ql3.run_attempts SET status = v_final, ended_at_ms = ev.at_ms, lease_active = false
   WHERE id = a.id;
  -- Second guard: only the fenced lease (the caller's token) is completed.
  UPDATE ql3.run_dispatch_leases SET status = 'completed', ended_at_ms = ev.at_ms, end_reason = p_kind
   WHERE attempt_id = a.id AND status = 'leased' AND token_sha256 = p_token_sha256 RETURNING * INTO l;
  IF l.attempt_id IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL401',
      MESSAGE = pg_catalog.format('attempt %s: the live lease is not the caller''s', a.id);
  END IF;
  s := ql3.step_run_transition(a.step_run_id, v_final, 'attempt ' || v_final, a.id);
  SELECT * INTO r FROM ql3.runs WHERE id = a.run_id;
  v_receipt := pg_catalog.jsonb_build_object(
    'schema', 'qinglong/plugin-package-workflow-task-completion-receipt@v1',
    'run_id', a.run_id, 'step_run_id', a.step_run_id, 'attempt_id', a.id, 'attempt', a.attempt,
    'kind', p_kind, 'reported_outcome', p_reported, 'outcome', v_final, 'exit_code', p_exit_code,
    'lease_no', l.lease_no, 'step_run_status', s.status, 'step_run_version', s.version,
    'event_sequence', ev.sequence, 'completed_at_ms', ev.at_ms);
  INSERT INTO ql3.run_attempt_completions (attempt_id, run_id, outcome, exit_code, detail, receipt, receipt_digest, completed_at_ms)
  VALUES (a.id, a.run_id, v_final, p_exit_code, COALESCE(p_detail, '{}'::jsonb), v_receipt,
          ql3.domain_digest('qinglong/plugin-package-workflow-task-completion-receipt@v1', ql3.canonical_json_flat(v_receipt)),
          ev.at_ms)
  RETURNING * INTO c;
  PERFORM ql3.frontier_advance(a.run_id, a.step_run_id);
  RETURN c;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_finish(ql3.run_attempts, text, text, integer, jsonb, text) IS
  'Internal (owner only; caller holds the Run lock and attempt authority, lease fenced). Ends an attempt and its StepRun: re-checks deadline_at_ms against database time (timed_out past it), records the crash window ready -> running -> terminal when completing from starting, completes the lease, stores the immutable completion receipt (digest under qinglong/plugin-package-workflow-task-completion-receipt@v1) and advances the frontier and aggregation in the same transaction.';
REVOKE ALL ON FUNCTION ql3.attempt_finish(ql3.run_attempts, text, text, integer, jsonb, text) FROM PUBLIC;
