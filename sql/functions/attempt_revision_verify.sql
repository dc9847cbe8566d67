CREATE OR REPLACE FUNCTION ql3.attempt_revision_verify(r ql3.task_execution_revisions, p_remember boolean DEFAULT true)
RETURNS ql3.task_execution_revisions
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  v_fp text;
BEGIN
  -- Fail-closed read of a Task Execution Revision on the step hot path. The row is immutable, so
  -- its full verification (ql3.task_revision_verify: re-normalise, re-canonicalise, recompute the
  -- digest) is done once per exact stored content and remembered by the SHA-256 of that content;
  -- a row changed in any byte misses the memo and is verified (and refused) again.
  IF r.project_id IS NULL THEN
    RETURN ql3.task_revision_verify(r);   -- raises QL501 for a missing row
  END IF;
  v_fp := pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(pg_catalog.to_jsonb(r)::text, 'UTF8')), 'hex');
  IF EXISTS (SELECT 1 FROM ql3.task_revision_verifications v
              WHERE v.row_sha256 = v_fp AND v.content_digest = r.content_digest) THEN
    RETURN r;
  END IF;
  r := ql3.task_revision_verify(r);
  IF p_remember AND pg_catalog.current_setting('transaction_read_only') = 'off' THEN  -- (a standby or read-only txn only verifies)
    INSERT INTO ql3.task_revision_verifications (row_sha256, content_digest, verified_at_ms)
    VALUES (v_fp, r.content_digest, ql3.now_ms())
    ON CONFLICT (row_sha256) DO NOTHING;
  END IF;
  RETURN r;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_revision_verify(ql3.task_execution_revisions, boolean) IS
  'Internal (owner only). Fail-closed verification of a stored Task Execution Revision for attempt admission and leasing: returns the row when ql3.task_revision_verify accepted exactly this stored content before (memo ql3.task_revision_verifications keyed by the SHA-256 of the row''s jsonb text), else runs ql3.task_revision_verify (QL501 on any defect) and, when p_remember and the transaction may write, records the fingerprint. Source: ADR-0023 §3, ADR-0227 §1.';
REVOKE ALL ON FUNCTION ql3.attempt_revision_verify(ql3.task_execution_revisions, boolean) FROM PUBLIC;
