CREATE OR REPLACE FUNCTION ql3.attempt_completion_replay(p_attempt_id text, p_lease_token text, p_kind text,
                                                         p_reported text, p_exit_code integer)
RETURNS ql3.run_attempt_completions
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  c ql3.run_attempt_completions;
BEGIN
  SELECT * INTO c FROM ql3.run_attempt_completions WHERE attempt_id = p_attempt_id;
  IF NOT FOUND THEN
    RETURN NULL;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM ql3.run_dispatch_leases l
                  WHERE l.attempt_id = p_attempt_id AND l.lease_no = (c.receipt ->> 'lease_no')::integer
                    AND l.token_sha256 = ql3.lease_token_digest(COALESCE(p_lease_token, ''))) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL401',
      MESSAGE = pg_catalog.format('attempt %s already ended; this token did not end it', p_attempt_id);
  END IF;
  IF c.receipt ->> 'kind' IS DISTINCT FROM p_kind OR c.receipt ->> 'reported_outcome' IS DISTINCT FROM p_reported
     OR (c.receipt -> 'exit_code') IS DISTINCT FROM COALESCE(pg_catalog.to_jsonb(p_exit_code), 'null'::jsonb) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL201',
      MESSAGE = pg_catalog.format('attempt %s already ended with %s (%s, exit %s); a different report is refused',
                                  p_attempt_id, c.outcome, c.receipt ->> 'reported_outcome', COALESCE(c.receipt ->> 'exit_code', 'null'));
  END IF;
  RETURN c;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_completion_replay(text, text, text, text, integer) IS
  'Internal (owner only). Exact replay of an attempt''s terminal report: returns the stored completion when the same lease token reports the same kind, outcome and exit code (even after the Run ended); NULL when the attempt has no completion; QL401 for another token; QL201 for a different report.';
REVOKE ALL ON FUNCTION ql3.attempt_completion_replay(text, text, text, text, integer) FROM PUBLIC;
