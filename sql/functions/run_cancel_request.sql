CREATE OR REPLACE FUNCTION ql3.run_cancel_request(p_run_id text, p_reason text, p_actor text)
RETURNS TABLE (outcome text, cancel_requested_at_ms bigint, run_status text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  r ql3.runs;
  ev record;
BEGIN
  PERFORM ql3.require_role('run_cancel_request', 'ql3_admin');
  PERFORM ql3.check_id(p_run_id, 'run_id');
  IF p_reason IS NULL OR p_reason NOT IN ('user', 'policy', 'shutdown') THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'reason: must be user, policy or shutdown';
  END IF;
  IF p_actor IS NULL OR p_actor = '' OR pg_catalog.octet_length(p_actor) > 128 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'actor: must be 1..128 bytes';
  END IF;
  PERFORM ql3.advisory_lock('run', p_run_id);
  SELECT * INTO r FROM ql3.runs x WHERE x.id = p_run_id FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('run %s not found', p_run_id);
  END IF;
  IF r.cancel_requested_at_ms IS NOT NULL THEN
    RETURN QUERY SELECT 'idempotent'::text, r.cancel_requested_at_ms, r.status;
    RETURN;
  END IF;
  IF r.status <> 'running' THEN
    RETURN QUERY SELECT 'already_ended'::text, NULL::bigint, r.status;
    RETURN;
  END IF;
  ev := ql3.run_event_append(p_run_id, 'workflow.run_cancel_requested', NULL, NULL,
                             pg_catalog.jsonb_build_object('reason', p_reason, 'actor', p_actor));
  UPDATE ql3.runs x SET cancel_requested_at_ms = ev.at_ms, cancel_reason = p_reason, cancel_actor = p_actor
   WHERE x.id = p_run_id;
  RETURN QUERY SELECT 'requested'::text, ev.at_ms, 'running'::text;
END
$fn$;
COMMENT ON FUNCTION ql3.run_cancel_request(text, text, text) IS
  'Role ql3_admin. Whole-run cancel intent (ADR-0227 §5, ADR-0228): stores cancel_requested_at_ms, reason (user|policy|shutdown) and actor (1..128 bytes) on the Run once, with one workflow.run_cancel_requested event; from then on frontier and Task Attempt admission are frozen and in-flight leases answer stop_requested(cancel). ql3.run_cancel_converge (ql3_runtime) carries it out. Returns (outcome requested|idempotent (first request kept)|already_ended, cancel_requested_at_ms, run_status). Errors: QL001, QL101 unknown run, QL601.';
REVOKE ALL ON FUNCTION ql3.run_cancel_request(text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.run_cancel_request(text, text, text) TO ql3_admin;
