CREATE OR REPLACE FUNCTION ql3.attempt_enter_running(a ql3.run_attempts) RETURNS ql3.step_runs
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  s ql3.step_runs;
  ev record;
BEGIN
  -- Caller holds the Run lock and the attempt authority; a.status = 'starting'.
  SELECT * INTO s FROM ql3.step_runs WHERE id = a.step_run_id;
  IF s.status <> 'ready' OR s.version <> a.step_run_version THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203',
      MESSAGE = pg_catalog.format('attempt %s: step run %s is %s v%s, not ready v%s', a.id, s.id, s.status, s.version, a.step_run_version);
  END IF;
  ev := ql3.run_event_append(a.run_id, 'workflow.task_attempt_running', a.step_run_id, a.id,
                             pg_catalog.jsonb_build_object('attempt', a.attempt));
  UPDATE ql3.run_attempts SET status = 'running', running_at_ms = ev.at_ms WHERE id = a.id;
  s := ql3.step_run_transition(s.id, 'running', 'attempt running', a.id, a.step_run_version);
  RETURN s;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_enter_running(ql3.run_attempts) IS
  'Internal (owner only; caller holds the Run lock and attempt authority). Moves a starting attempt to running and its StepRun ready -> running (attempt_count + 1) with their events and mutation; raises QL203 when the StepRun is not ready at the attempt''s epoch.';
REVOKE ALL ON FUNCTION ql3.attempt_enter_running(ql3.run_attempts) FROM PUBLIC;
