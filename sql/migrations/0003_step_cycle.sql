-- 0003 step cycle (issue 8, ADR-0227 §1-4): the fail-closed verification memo of the step hot path
-- and the partial index that keeps candidate pages independent of finished Runs. Applied by
-- `qlpg migrate` with role ql3_migration, search_path ql3. Re-runnable (IF NOT EXISTS, DROP/CREATE
-- TRIGGER): yoyo records a migration in a separate transaction.

SET LOCAL lock_timeout = '30s';
SET LOCAL statement_timeout = '5min';

-- Memo of fail-closed verifications (ql3.attempt_revision_verify, used by attempt admission and
-- leasing): the SHA-256 of a Task Execution Revision row's exact stored content (its jsonb text)
-- that ql3.task_revision_verify accepted. A row altered in any byte has another fingerprint, misses
-- the memo and is verified again (and refused); an entry proves nothing about any other content.
CREATE TABLE IF NOT EXISTS ql3.task_revision_verifications (
  row_sha256     text PRIMARY KEY CHECK (row_sha256 ~ '^[0-9a-f]{64}$'),
  content_digest text NOT NULL CHECK (content_digest ~ '^[0-9a-f]{64}$'),
  verified_at_ms bigint NOT NULL
);
DROP TRIGGER IF EXISTS task_revision_verifications_immutable ON ql3.task_revision_verifications;
CREATE TRIGGER task_revision_verifications_immutable BEFORE UPDATE OR DELETE ON ql3.task_revision_verifications
  FOR EACH ROW EXECUTE FUNCTION ql3.reject_mutation();
DROP TRIGGER IF EXISTS task_revision_verifications_no_truncate ON ql3.task_revision_verifications;
CREATE TRIGGER task_revision_verifications_no_truncate BEFORE TRUNCATE ON ql3.task_revision_verifications
  FOR EACH STATEMENT EXECUTE FUNCTION ql3.reject_mutation();
COMMENT ON TABLE ql3.task_revision_verifications IS
  'Append-only (immutable): UPDATE, DELETE and TRUNCATE are refused by trigger with QL201.';

-- Runs that may get new attempts (ADR-0227 §3): with step_runs_candidates_idx it keeps a candidate
-- page independent of how many finished Runs the table holds, whichever side the planner drives.
CREATE INDEX IF NOT EXISTS runs_admissible_idx ON ql3.runs (id)
  WHERE status = 'running' AND cancel_requested_at_ms IS NULL;
