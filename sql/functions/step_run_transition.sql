CREATE OR REPLACE FUNCTION ql3.step_run_transition(
  p_step_run_id text, p_to text, p_reason text, p_attempt_id text DEFAULT NULL,
  p_expect_version integer DEFAULT NULL) RETURNS ql3.step_runs
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  s ql3.step_runs;
  ev record;
  v_allowed boolean;
  v_count integer;
  v_ready bigint;
BEGIN
  -- Caller holds the Run lock.
  SELECT * INTO s FROM ql3.step_runs WHERE id = p_step_run_id FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('step run %s not found', p_step_run_id);
  END IF;
  IF p_expect_version IS NOT NULL AND s.version <> p_expect_version THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('step run %s: version %s expected, %s found', p_step_run_id, p_expect_version, s.version);
  END IF;
  v_allowed := CASE s.status
    WHEN 'pending' THEN p_to IN ('ready', 'skipped', 'cancelled')
    WHEN 'ready'   THEN p_to IN ('ready', 'running', 'failed', 'skipped', 'cancelled', 'timed_out')
    WHEN 'running' THEN p_to IN ('succeeded', 'failed', 'cancelled', 'timed_out', 'lost')
    WHEN 'lost'    THEN p_to = 'failed'
    ELSE false END;
  IF NOT v_allowed THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203',
      MESSAGE = pg_catalog.format('step run %s: illegal transition %s -> %s', p_step_run_id, s.status, p_to);
  END IF;
  v_count := s.attempt_count + CASE WHEN p_to = 'running' THEN 1 ELSE 0 END;
  IF v_count > 64 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002',
      MESSAGE = pg_catalog.format('step run %s: attempt_count would exceed 64', p_step_run_id);
  END IF;
  ev := ql3.run_event_append(s.run_id, 'workflow.step_run_' || p_to, p_step_run_id, p_attempt_id,
          pg_catalog.jsonb_build_object('from', s.status, 'to', p_to, 'version', s.version + 1,
                                        'reason', p_reason));
  v_ready := CASE WHEN p_to = 'ready' AND s.status = 'pending' THEN ev.at_ms ELSE s.ready_at_ms END;
  UPDATE ql3.step_runs
     SET status = p_to,
         version = s.version + 1,
         attempt_count = v_count,
         ready_at_ms = v_ready,
         epoch_admitted = CASE WHEN p_to = 'ready' THEN false ELSE epoch_admitted END,
         current_attempt_id = CASE WHEN p_to = 'ready' THEN NULL ELSE current_attempt_id END,
         started_at_ms = CASE WHEN p_to = 'running' THEN ev.at_ms ELSE started_at_ms END,
         ended_at_ms = CASE WHEN p_to IN ('succeeded', 'failed', 'skipped', 'cancelled', 'timed_out')
                            THEN ev.at_ms ELSE ended_at_ms END,
         updated_at_ms = ev.at_ms,
         digest = ql3.step_run_digest(s.run_id, s.id, s.step_key, s.task_key, p_to, s.version + 1,
                                      v_count, v_ready)
   WHERE id = p_step_run_id
  RETURNING * INTO s;
  INSERT INTO ql3.step_run_mutations (step_run_id, version, run_id, from_status, to_status, run_sequence,
                                      digest, attempt_id, reason, at_ms)
  VALUES (s.id, s.version, s.run_id,
          (SELECT m.to_status FROM ql3.step_run_mutations m WHERE m.step_run_id = s.id AND m.version = s.version - 1),
          p_to, ev.sequence, s.digest, p_attempt_id, p_reason, ev.at_ms);
  RETURN s;
END
$fn$;
COMMENT ON FUNCTION ql3.step_run_transition(text, text, text, text, integer) IS
  'Internal (owner only; caller holds the Run lock). Moves a StepRun along DESIGN §4''s state machine (pending -> ready|skipped|cancelled; ready -> ready|running|failed|skipped|cancelled|timed_out; running -> succeeded|failed|cancelled|timed_out|lost; lost -> failed), bumping version by one, recomputing its digest, appending one workflow.step_run_<to> RunEvent and one step_run_mutations row. attempt_count grows only on entering running (max 64). Raises QL101 (unknown), QL202 (p_expect_version mismatch), QL203 (illegal transition), QL002 (attempt_count > 64).';
REVOKE ALL ON FUNCTION ql3.step_run_transition(text, text, text, text, integer) FROM PUBLIC;
