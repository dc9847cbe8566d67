CREATE OR REPLACE FUNCTION ql3.lease_release(p_attempt_id text, p_lease_token text, p_reason text DEFAULT 'released')
RETURNS TABLE (attempt_id text, status text, released_at_ms bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  a ql3.run_attempts;
  v_now bigint := ql3.now_ms();
BEGIN
  PERFORM ql3.require_role('lease_release', 'ql3_worker_ingress');
  IF p_reason IS NULL OR pg_catalog.octet_length(p_reason) NOT BETWEEN 1 AND 256 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'reason: must be 1..256 bytes';
  END IF;
  a := ql3.attempt_lock(p_attempt_id, p_lease_token);
  IF a.status <> 'claimed' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203',
      MESSAGE = pg_catalog.format('attempt %s is %s: a lease can be given back only before the start barrier', a.id, a.status);
  END IF;
  UPDATE ql3.run_dispatch_leases l SET status = 'released', ended_at_ms = v_now, end_reason = p_reason
   WHERE l.attempt_id = a.id AND l.status = 'leased';
  UPDATE ql3.run_attempts ra SET lease_active = false, lease_expires_at_ms = NULL, worker_id = NULL
   WHERE ra.id = a.id;
  RETURN QUERY SELECT a.id, 'claimed'::text, v_now;
END
$fn$;
COMMENT ON FUNCTION ql3.lease_release(text, text, text) IS
  'Role ql3_worker_ingress. Gives a lease back before the start barrier: the attempt stays claimed and unleased so another worker can lease it; the lease ends released with p_reason (1..256 bytes). Returns (attempt_id, status claimed, released_at_ms). Errors: QL001, QL203 attempt past claimed, QL401, QL601.';
REVOKE ALL ON FUNCTION ql3.lease_release(text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.lease_release(text, text, text) TO ql3_worker_ingress;
