CREATE OR REPLACE FUNCTION ql3.lease_check(p_attempt_id text, p_lease_token text, p_lock boolean DEFAULT true,
                                           p_allow_expired boolean DEFAULT true)
RETURNS ql3.run_attempts
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  a ql3.run_attempts;
  l ql3.run_dispatch_leases;
BEGIN
  IF p_attempt_id IS NULL OR p_lease_token IS NULL OR pg_catalog.octet_length(p_lease_token) > 256
     OR pg_catalog.octet_length(p_attempt_id) > 36 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL401', MESSAGE = 'lease token invalid: attempt id and lease token are required';
  END IF;
  IF p_lock THEN
    SELECT * INTO a FROM ql3.run_attempts WHERE id = p_attempt_id FOR UPDATE;
  ELSE
    SELECT * INTO a FROM ql3.run_attempts WHERE id = p_attempt_id;
  END IF;
  SELECT * INTO l FROM ql3.run_dispatch_leases x
   WHERE x.attempt_id = p_attempt_id AND x.status = 'leased'
     AND x.token_sha256 = ql3.lease_token_digest(p_lease_token);
  IF a.id IS NULL OR l.attempt_id IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL401',
      MESSAGE = pg_catalog.format('lease token invalid for attempt %s (unknown attempt, another attempt''s token, or the lease ended)',
                                  pg_catalog.left(p_attempt_id, 36));
  END IF;
  IF NOT p_allow_expired AND l.expires_at_ms < ql3.now_ms() THEN
    RAISE EXCEPTION USING ERRCODE = 'QL401',
      MESSAGE = pg_catalog.format('lease of attempt %s expired at %s ms', p_attempt_id, l.expires_at_ms);
  END IF;
  RETURN a;
END
$fn$;
COMMENT ON FUNCTION ql3.lease_check(text, text, boolean, boolean) IS
  'Internal (owner only). Fences a worker call: returns the RunAttempt (row-locked when p_lock) when p_lease_token''s SHA-256 matches the attempt''s live dispatch lease (status leased); else raises QL401. An expired lease that recovery has not yet ended still fences post-start reports (p_allow_expired true): expiry only makes the attempt eligible for recovery, and whichever of the report and the recovery resolution takes the attempt authority first wins. The start barrier passes p_allow_expired false. Source: ADR-0227 §4, §6.';
REVOKE ALL ON FUNCTION ql3.lease_check(text, text, boolean, boolean) FROM PUBLIC;
