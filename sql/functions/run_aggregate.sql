CREATE OR REPLACE FUNCTION ql3.run_aggregate(p_run_id text) RETURNS text
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  r ql3.runs;
  v_status text;
  ev record;
BEGIN
  -- Caller holds the Run lock. Ends the Run once every StepRun is terminal.
  SELECT * INTO r FROM ql3.runs WHERE id = p_run_id FOR UPDATE;
  IF r.status <> 'running' THEN
    RETURN r.status;
  END IF;
  IF EXISTS (SELECT 1 FROM ql3.step_runs s WHERE s.run_id = p_run_id
              AND s.status NOT IN ('succeeded', 'failed', 'skipped', 'cancelled', 'timed_out')) THEN
    RETURN 'running';
  END IF;
  SELECT CASE
           WHEN r.cancel_requested_at_ms IS NOT NULL THEN 'cancelled'
           WHEN pg_catalog.bool_or(s.status = 'failed') THEN 'failed'
           WHEN pg_catalog.bool_or(s.status = 'timed_out') THEN 'timed_out'
           WHEN pg_catalog.bool_or(s.status = 'cancelled') THEN 'cancelled'
           ELSE 'succeeded' END
    INTO v_status
    FROM ql3.step_runs s WHERE s.run_id = p_run_id;
  ev := ql3.run_event_append(p_run_id, 'workflow.run_' || v_status, NULL, NULL,
                             pg_catalog.jsonb_build_object('status', v_status));
  UPDATE ql3.runs SET status = v_status, ended_at_ms = ev.at_ms WHERE id = p_run_id;
  RETURN v_status;
END
$fn$;
COMMENT ON FUNCTION ql3.run_aggregate(text) IS
  'Internal (owner only; caller holds the Run lock). When every StepRun of the Run is terminal, ends the Run by DESIGN §4''s aggregation rule (cancelled if a cancel was requested, else failed if any step failed, else timed_out if any timed out, else succeeded) with one workflow.run_<status> event; returns the Run status.';
REVOKE ALL ON FUNCTION ql3.run_aggregate(text) FROM PUBLIC;
