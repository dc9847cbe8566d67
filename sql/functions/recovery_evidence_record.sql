CREATE OR REPLACE FUNCTION ql3.recovery_evidence_record(p_attempt_id text, p_evidence text, p_actor text)
RETURNS TABLE (attempt_id text, status text, last_evidence text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  a ql3.run_attempts;
  v_now bigint := ql3.now_ms();
BEGIN
  PERFORM ql3.require_role('recovery_evidence_record', 'ql3_admin');
  IF p_evidence IS NULL OR p_evidence NOT IN ('not_running', 'unknown') THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'evidence: must be not_running or unknown';
  END IF;
  IF p_actor IS NULL OR p_actor = '' OR pg_catalog.octet_length(p_actor) > 128 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'actor: must be 1..128 bytes';
  END IF;
  SELECT * INTO a FROM ql3.run_attempts x WHERE x.id = p_attempt_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('attempt %s not found', pg_catalog.left(COALESCE(p_attempt_id, ''), 36));
  END IF;
  PERFORM ql3.advisory_lock('run', a.run_id);
  PERFORM ql3.advisory_lock('attempt', a.id);
  PERFORM ql3.advisory_lock('recovery', a.id);
  INSERT INTO ql3.run_recovery_controls AS rc (attempt_id, run_id, status, next_claim_at_ms, last_evidence,
                                               evidence_source, created_at_ms, updated_at_ms)
  VALUES (a.id, a.run_id, 'available', v_now, p_evidence, 'operator:' || p_actor, v_now, v_now)
  ON CONFLICT ON CONSTRAINT run_recovery_controls_pkey DO UPDATE
     SET last_evidence = EXCLUDED.last_evidence, evidence_source = EXCLUDED.evidence_source,
         status = CASE WHEN rc.status IN ('retry', 'manual') THEN 'available' ELSE rc.status END,
         next_claim_at_ms = CASE WHEN rc.status IN ('retry', 'manual') THEN v_now ELSE rc.next_claim_at_ms END,
         updated_at_ms = v_now;
  RETURN QUERY SELECT x.attempt_id, x.status, x.last_evidence FROM ql3.run_recovery_controls x WHERE x.attempt_id = a.id;
END
$fn$;
COMMENT ON FUNCTION ql3.recovery_evidence_record(text, text, text) IS
  'Role ql3_admin. An operator''s evidence about an attempt past the start barrier whose worker is gone (qlpg recover --attempt ID --evidence not_running): records last_evidence not_running|unknown with source operator:<actor> on its recovery control and makes a retry/manual control claimable again. It does not resolve anything itself: recovery_resolve applies it once the lease has expired. Returns (attempt_id, status, last_evidence). Errors: QL001, QL101, QL601.';
REVOKE ALL ON FUNCTION ql3.recovery_evidence_record(text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.recovery_evidence_record(text, text, text) TO ql3_admin;
