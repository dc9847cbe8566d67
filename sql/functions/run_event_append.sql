CREATE OR REPLACE FUNCTION ql3.run_event_append(
  p_run_id text, p_type text, p_step_run_id text, p_attempt_id text, p_payload jsonb,
  OUT sequence bigint, OUT at_ms bigint)
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  -- The caller holds the Run's advisory lock. Each event bumps version and event_sequence by
  -- exactly one; at_ms is the Run's monotonic observation time.
  UPDATE ql3.runs r
     SET version = r.version + 1,
         event_sequence = r.event_sequence + 1,
         observed_at_ms = GREATEST(r.observed_at_ms, ql3.now_ms())
   WHERE r.id = p_run_id
  RETURNING r.event_sequence, r.observed_at_ms INTO sequence, at_ms;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('run %s not found', p_run_id);
  END IF;
  INSERT INTO ql3.run_events (run_id, sequence, type, step_run_id, attempt_id, payload, at_ms)
  VALUES (p_run_id, sequence, p_type, p_step_run_id, p_attempt_id, COALESCE(p_payload, '{}'::jsonb), at_ms);
END
$fn$;
COMMENT ON FUNCTION ql3.run_event_append(text, text, text, text, jsonb) IS
  'Internal (owner only; caller holds the Run lock). Appends one RunEvent of type p_type and bumps the Run''s version and event_sequence by exactly one. Returns (sequence bigint, at_ms bigint: the Run''s monotonic database time in ms). Raises QL101 when the Run does not exist. Source: DESIGN §4 (Workflow Run).';
REVOKE ALL ON FUNCTION ql3.run_event_append(text, text, text, text, jsonb) FROM PUBLIC;
