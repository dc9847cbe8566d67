CREATE OR REPLACE FUNCTION ql3.attempt_complete(p_attempt_id text, p_lease_token text, p_outcome text,
                                                p_exit_code integer, p_detail jsonb DEFAULT NULL)
RETURNS TABLE (outcome text, receipt jsonb, receipt_digest text, replayed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  a ql3.run_attempts;
  c ql3.run_attempt_completions;
  v_run text;
BEGIN
  PERFORM ql3.require_role('attempt_complete', 'ql3_worker_ingress');
  IF p_outcome IS NULL OR p_outcome NOT IN ('succeeded', 'failed', 'timed_out', 'cancelled') THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'outcome: must be succeeded, failed, timed_out or cancelled';
  END IF;
  IF p_detail IS NOT NULL AND (pg_catalog.jsonb_typeof(p_detail) <> 'object' OR pg_catalog.octet_length(p_detail::text) > 16384) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'detail: must be a JSON object of at most 16 KiB';
  END IF;
  SELECT ra.run_id INTO v_run FROM ql3.run_attempts ra WHERE ra.id = p_attempt_id;
  IF v_run IS NOT NULL THEN
    PERFORM ql3.advisory_lock('run', v_run);
    PERFORM ql3.advisory_lock('attempt', p_attempt_id);
    c := ql3.attempt_completion_replay(p_attempt_id, p_lease_token, 'complete', p_outcome, p_exit_code);
    IF c.attempt_id IS NOT NULL THEN
      RETURN QUERY SELECT c.outcome, c.receipt, c.receipt_digest, true;
      RETURN;
    END IF;
  END IF;
  a := ql3.attempt_lock(p_attempt_id, p_lease_token);
  IF a.status NOT IN ('starting', 'running') THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203',
      MESSAGE = pg_catalog.format('attempt %s is %s: only a started attempt can complete', a.id, a.status);
  END IF;
  c := ql3.attempt_finish(a, 'complete', p_outcome, p_exit_code, p_detail, ql3.lease_token_digest(p_lease_token));
  RETURN QUERY SELECT c.outcome, c.receipt, c.receipt_digest, false;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_complete(text, text, text, integer, jsonb) IS
  'Role ql3_worker_ingress. Completion of a started attempt by its lease holder (ADR-0227 §4-5): p_outcome succeeded|failed|timed_out|cancelled, p_exit_code (nullable), p_detail jsonb object <= 16 KiB. In one transaction under the Run lock and attempt authority: re-checks the deadline against database time (timed_out past it; a worker''s timed_out before it counts as failed; cancelled only under a Run cancel request), ends attempt and StepRun (from starting it records ready -> running -> terminal atomically), completes the lease, advances the frontier (dependents ready or skipped) and aggregates the Run. Returns (outcome, receipt jsonb, receipt_digest, replayed). The same token and report again returns the original receipt with replayed = true, even after the Run ended; a different report is QL201. Errors: QL001, QL201, QL203 attempt not started, QL401 lease invalid/expired/other attempt, QL601.';
REVOKE ALL ON FUNCTION ql3.attempt_complete(text, text, text, integer, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.attempt_complete(text, text, text, integer, jsonb) TO ql3_worker_ingress;
