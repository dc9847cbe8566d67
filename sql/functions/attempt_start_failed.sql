CREATE OR REPLACE FUNCTION ql3.attempt_start_failed(p_attempt_id text, p_lease_token text, p_detail jsonb DEFAULT NULL)
RETURNS TABLE (outcome text, receipt jsonb, receipt_digest text, replayed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  a ql3.run_attempts;
  c ql3.run_attempt_completions;
  v_run text;
BEGIN
  PERFORM ql3.require_role('attempt_start_failed', 'ql3_worker_ingress');
  IF p_detail IS NOT NULL AND (pg_catalog.jsonb_typeof(p_detail) <> 'object' OR pg_catalog.octet_length(p_detail::text) > 16384) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'detail: must be a JSON object of at most 16 KiB';
  END IF;
  SELECT ra.run_id INTO v_run FROM ql3.run_attempts ra WHERE ra.id = p_attempt_id;
  IF v_run IS NOT NULL THEN
    PERFORM ql3.advisory_lock('run', v_run);
    PERFORM ql3.advisory_lock('attempt', p_attempt_id);
    c := ql3.attempt_completion_replay(p_attempt_id, p_lease_token, 'start_failed', 'failed', NULL);
    IF c.attempt_id IS NOT NULL THEN
      RETURN QUERY SELECT c.outcome, c.receipt, c.receipt_digest, true;
      RETURN;
    END IF;
  END IF;
  a := ql3.attempt_lock(p_attempt_id, p_lease_token);
  IF a.status <> 'starting' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203',
      MESSAGE = pg_catalog.format('attempt %s is %s: start failure is reported from starting only', a.id, a.status);
  END IF;
  c := ql3.attempt_finish(a, 'start_failed', 'failed', NULL, p_detail, ql3.lease_token_digest(p_lease_token));
  RETURN QUERY SELECT c.outcome, c.receipt, c.receipt_digest, false;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_start_failed(text, text, jsonb) IS
  'Role ql3_worker_ingress. The lease holder reports that a starting attempt''s process could not be started (p_detail jsonb object <= 16 KiB, e.g. {"error": "..."}): attempt starting -> failed (timed_out when database time is past deadline_at_ms), StepRun ready -> failed|timed_out without entering running (attempt_count unchanged), dependents skipped, Run aggregated, in one transaction. Returns (outcome, receipt, receipt_digest, replayed); the same report again returns the original receipt. Errors: QL001, QL201, QL203 not starting, QL401, QL601.';
REVOKE ALL ON FUNCTION ql3.attempt_start_failed(text, text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.attempt_start_failed(text, text, jsonb) TO ql3_worker_ingress;
