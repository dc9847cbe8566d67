CREATE OR REPLACE FUNCTION ql3.worker_session_reset(p_worker_id text)
RETURNS TABLE (attempt_id text, attempt_status text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  a record;
  v_now bigint := ql3.now_ms();
BEGIN
  PERFORM ql3.require_role('worker_session_reset', 'ql3_worker_ingress');
  PERFORM ql3.check_id(p_worker_id, 'worker_id', 128);
  -- Only leases this login acquired under this worker id: a worker cannot speak for another login.
  FOR a IN SELECT ra.id, ra.run_id, ra.status FROM ql3.run_attempts ra
             JOIN ql3.run_dispatch_leases l ON l.attempt_id = ra.id AND l.status = 'leased'
            WHERE ra.lease_active AND ra.worker_id = p_worker_id AND l.holder_login = session_user
            ORDER BY ra.run_id, ra.id LOOP
    PERFORM ql3.advisory_lock('run', a.run_id);
    PERFORM ql3.advisory_lock('attempt', a.id);
    PERFORM ql3.advisory_lock('recovery', a.id);
    -- The previous session holds nothing: its leases expire now and its attempts carry not_running evidence.
    UPDATE ql3.run_attempts x SET lease_expires_at_ms = LEAST(x.lease_expires_at_ms, v_now - 1)
     WHERE x.id = a.id AND x.lease_active;
    UPDATE ql3.run_dispatch_leases l SET expires_at_ms = LEAST(l.expires_at_ms, v_now - 1)
     WHERE l.attempt_id = a.id AND l.status = 'leased';
    INSERT INTO ql3.run_recovery_controls AS rc (attempt_id, run_id, status, next_claim_at_ms, last_evidence,
                                                 evidence_source, created_at_ms, updated_at_ms)
    VALUES (a.id, a.run_id, 'available', v_now, 'not_running', 'worker_restart:' || p_worker_id, v_now, v_now)
    ON CONFLICT ON CONSTRAINT run_recovery_controls_pkey DO UPDATE
       SET last_evidence = 'not_running', evidence_source = EXCLUDED.evidence_source,
           status = CASE WHEN rc.status IN ('retry', 'manual', 'resolved') THEN 'available' ELSE rc.status END,
           next_claim_at_ms = v_now, updated_at_ms = v_now;
    attempt_id := a.id; attempt_status := a.status;
    RETURN NEXT;
  END LOOP;
END
$fn$;
COMMENT ON FUNCTION ql3.worker_session_reset(text) IS
  'Role ql3_worker_ingress. Called by a worker that restarts under the same worker id: declares that its previous session holds nothing. For every live lease this login acquired under p_worker_id, expires the lease now and records trusted not_running evidence (source worker_restart:<id>) on the attempt''s recovery control, so recovery resolves claimed attempts into a new epoch and started ones into lost -> failed without waiting for the lease to run out. Returns (attempt_id, attempt_status) per attempt affected. Errors: QL001, QL601. Source: ADR-0227 §6.';
REVOKE ALL ON FUNCTION ql3.worker_session_reset(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.worker_session_reset(text) TO ql3_worker_ingress;
