CREATE OR REPLACE FUNCTION ql3.attempt_lock(p_attempt_id text, p_lease_token text, p_allow_expired boolean DEFAULT true) RETURNS ql3.run_attempts
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  v_run text;
BEGIN
  -- Lock order: run -> attempt (DESIGN §7). The attempt's run never changes.
  SELECT run_id INTO v_run FROM ql3.run_attempts WHERE id = p_attempt_id;
  IF v_run IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL401',
      MESSAGE = pg_catalog.format('lease token invalid for attempt %s (unknown attempt)', pg_catalog.left(COALESCE(p_attempt_id, ''), 36));
  END IF;
  PERFORM ql3.advisory_lock('run', v_run);
  PERFORM ql3.advisory_lock('attempt', p_attempt_id);
  RETURN ql3.lease_check(p_attempt_id, p_lease_token, true, p_allow_expired);
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_lock(text, text, boolean) IS
  'Internal (owner only). Takes the Run lock then the attempt advisory authority (the same one recovery uses), then fences the lease token (QL401). Returns the row-locked RunAttempt.';
REVOKE ALL ON FUNCTION ql3.attempt_lock(text, text, boolean) FROM PUBLIC;
