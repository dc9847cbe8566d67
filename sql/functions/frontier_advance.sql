CREATE OR REPLACE FUNCTION ql3.frontier_advance(p_run_id text, p_step_run_id text) RETURNS text
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  s ql3.step_runs;
  c record;
  v_frozen boolean;
BEGIN
  -- Caller holds the Run lock and has just moved p_step_run_id to a terminal state.
  SELECT * INTO s FROM ql3.step_runs WHERE id = p_step_run_id;
  SELECT cancel_requested_at_ms IS NOT NULL INTO v_frozen FROM ql3.runs WHERE id = p_run_id;
  IF s.status = 'succeeded' THEN
    FOR c IN
      UPDATE ql3.step_runs d SET unmet_needs = d.unmet_needs - 1
       WHERE d.run_id = p_run_id AND d.status = 'pending' AND s.step_key = ANY (d.needs)
      RETURNING d.id, d.unmet_needs
    LOOP
      IF c.unmet_needs = 0 AND NOT v_frozen THEN
        PERFORM ql3.step_run_transition(c.id, 'ready', 'needs succeeded');
      END IF;
    END LOOP;
  ELSIF s.status IN ('failed', 'timed_out', 'cancelled', 'skipped') THEN
    FOR c IN
      WITH RECURSIVE dependents(step_key) AS (
        SELECT d.step_key FROM ql3.step_runs d
         WHERE d.run_id = p_run_id AND s.step_key = ANY (d.needs)
        UNION
        SELECT d.step_key FROM ql3.step_runs d JOIN dependents p ON p.step_key = ANY (d.needs)
         WHERE d.run_id = p_run_id
      )
      SELECT d.id FROM ql3.step_runs d JOIN dependents USING (step_key)
       WHERE d.run_id = p_run_id AND d.status = 'pending'
       ORDER BY d.step_key
    LOOP
      PERFORM ql3.step_run_transition(c.id, 'skipped',
        pg_catalog.format('dependency %s ended %s', s.step_key, s.status));
    END LOOP;
  END IF;
  RETURN ql3.run_aggregate(p_run_id);
END
$fn$;
COMMENT ON FUNCTION ql3.frontier_advance(text, text) IS
  'Internal (owner only; caller holds the Run lock). Durable frontier (ADR-0223 §4): after StepRun p_step_run_id ended, every pending dependent whose needs all succeeded becomes ready in the same transaction (unless the Run has a cancel request, which freezes the frontier); a failed, timed_out or cancelled step skips every transitive pending dependent. Then aggregates the Run; returns its status.';
REVOKE ALL ON FUNCTION ql3.frontier_advance(text, text) FROM PUBLIC;
