CREATE OR REPLACE FUNCTION ql3.recovery_claim(p_claimer_id text, p_limit integer, p_claim_ms integer)
RETURNS TABLE (attempt_id text, run_id text, claim_token text, claim_expires_at_ms bigint,
               attempt_status text, failure_count integer, last_evidence text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  v_now bigint := ql3.now_ms();
  c record;
  v_token text;
BEGIN
  PERFORM ql3.require_role('recovery_claim', 'ql3_runtime');
  PERFORM ql3.check_id(p_claimer_id, 'claimer_id', 128);
  IF p_limit IS NULL OR p_limit < 1 OR p_limit > 64 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'limit: must be 1..64';
  END IF;
  IF p_claim_ms IS NULL OR p_claim_ms < 1000 OR p_claim_ms > 600000 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'claim_ms: must be 1000..600000';
  END IF;
  -- Bounded recovery source: attempts whose lease expired (by database time) get a control row.
  -- A claimed attempt that never had a lease is backlog and never appears here.
  -- Concurrent loops take disjoint sets (SKIP LOCKED) instead of queueing on the same keys.
  INSERT INTO ql3.run_recovery_controls AS rc (attempt_id, run_id, status, next_claim_at_ms, created_at_ms, updated_at_ms)
  SELECT e.id, e.run_id, 'available', v_now, v_now, v_now
    FROM (SELECT ra.id, ra.run_id FROM ql3.run_attempts ra
           WHERE ra.lease_active AND ra.lease_expires_at_ms < v_now
             AND NOT EXISTS (SELECT 1 FROM ql3.run_recovery_controls x
                              WHERE x.attempt_id = ra.id AND x.status IN ('available', 'claimed', 'retry', 'manual'))
           ORDER BY ra.lease_expires_at_ms, ra.id
           LIMIT p_limit
           FOR NO KEY UPDATE OF ra SKIP LOCKED) e
  ON CONFLICT ON CONSTRAINT run_recovery_controls_pkey DO UPDATE SET status = 'available', next_claim_at_ms = v_now, updated_at_ms = v_now,
                                        claim_token_sha256 = NULL, claimed_by = NULL, claim_expires_at_ms = NULL
   WHERE rc.status = 'resolved';
  -- Claim available/retry controls whose backoff has passed, and claims whose holder let them expire.
  FOR c IN
    SELECT x.attempt_id FROM ql3.run_recovery_controls x
     WHERE (x.status IN ('available', 'retry') AND x.next_claim_at_ms <= v_now)
        OR (x.status = 'claimed' AND x.claim_expires_at_ms < v_now)
     ORDER BY x.next_claim_at_ms, x.attempt_id
     LIMIT p_limit
     FOR UPDATE SKIP LOCKED
  LOOP
    v_token := pg_catalog.replace(pg_catalog.gen_random_uuid()::text || pg_catalog.gen_random_uuid()::text, '-', '');
    UPDATE ql3.run_recovery_controls x
       SET status = 'claimed', claim_token_sha256 = ql3.lease_token_digest(v_token), claimed_by = p_claimer_id,
           claim_expires_at_ms = v_now + p_claim_ms, updated_at_ms = v_now
     WHERE x.attempt_id = c.attempt_id;
    RETURN QUERY SELECT x.attempt_id, x.run_id, v_token, x.claim_expires_at_ms, ra.status, x.failure_count, x.last_evidence
      FROM ql3.run_recovery_controls x JOIN ql3.run_attempts ra ON ra.id = x.attempt_id
     WHERE x.attempt_id = c.attempt_id;
  END LOOP;
END
$fn$;
COMMENT ON FUNCTION ql3.recovery_claim(text, integer, integer) IS
  'Role ql3_runtime. Bounded recovery source (ADR-0227 §6): first records a run_recovery_controls row (available) for up to p_limit (1..64) attempts whose dispatch lease expired by database time (a claimed attempt that never had a lease is backlog and never listed); then claims up to p_limit controls that are available, in retry past their backoff, or claimed by a loop whose claim expired, with FOR UPDATE SKIP LOCKED: status claimed, claim token returned once (only its SHA-256 stored), claim_expires_at_ms = now + p_claim_ms (1000..600000). Returns (attempt_id, run_id, claim_token, claim_expires_at_ms, attempt_status, failure_count, last_evidence). Concurrent loops get disjoint pages (SKIP LOCKED); call it at READ COMMITTED (qlpg does): every invariant is held by row locks and the primary key, and under SERIALIZABLE a SKIP LOCKED queue mostly produces serialization failures. Errors: QL001, QL002, QL601.';
REVOKE ALL ON FUNCTION ql3.recovery_claim(text, integer, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.recovery_claim(text, integer, integer) TO ql3_runtime;
