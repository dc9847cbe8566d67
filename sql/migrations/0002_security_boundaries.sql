-- 0002 security boundary rows (ADR-0223 §3, DESIGN §7). Applied by `qlpg migrate` with role
-- ql3_migration, search_path ql3. Re-runnable (IF NOT EXISTS / ON CONFLICT DO NOTHING).
--
-- Why: the package/publisher advisory locks serialise starts against quarantine, revocation,
-- publication and withdrawal, but an admission running at REPEATABLE READ or SERIALIZABLE (the
-- shell's default) takes its snapshot when its statement starts, before it waits for the lock:
-- after a revocation that committed while it waited, it still saw "not revoked" and admitted the
-- Run. One row per boundary fixes that in every isolation level: every change of a boundary
-- (package_quarantine, publisher_revoke, automation_publish, automation_withdraw) bumps the row's
-- version under the exclusive advisory lock, and every start (ql3.start_guard, used by
-- workflow_plan_admit and task_attempt_admit) locks the rows FOR SHARE. A row changed by a
-- transaction the starter's snapshot cannot see raises SQLSTATE 40001 at REPEATABLE READ and
-- above (the shell retries with a fresh snapshot, which sees the change); READ COMMITTED re-reads.

SET LOCAL lock_timeout = '30s';
SET LOCAL statement_timeout = '5min';

CREATE TABLE IF NOT EXISTS ql3.security_boundaries (
  kind          text NOT NULL CHECK (kind IN ('package', 'publisher')),
  id            text NOT NULL,            -- '<project>/<package>' or the publisher id
  version       bigint NOT NULL CHECK (version >= 1),
  changed_at_ms bigint NOT NULL,
  PRIMARY KEY (kind, id)
);
COMMENT ON TABLE ql3.security_boundaries IS
  'One row per package (<project>/<package>) and publisher security boundary. version grows by one per quarantine, revocation, publication or withdrawal (under the exclusive advisory lock); starts lock the rows FOR SHARE so a start whose snapshot predates a change fails with 40001 and is retried. Written only by package_manager functions; no role may read it.';

INSERT INTO ql3.security_boundaries (kind, id, version, changed_at_ms)
SELECT DISTINCT 'package', r.project_id || '/' || r.package_id, 1,
       (extract(epoch FROM clock_timestamp()) * 1000)::bigint
  FROM ql3.package_materialized_revisions r
ON CONFLICT (kind, id) DO NOTHING;
INSERT INTO ql3.security_boundaries (kind, id, version, changed_at_ms)
SELECT DISTINCT 'publisher', r.publisher_id, 1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint
  FROM ql3.package_materialized_revisions r
ON CONFLICT (kind, id) DO NOTHING;
INSERT INTO ql3.security_boundaries (kind, id, version, changed_at_ms)
SELECT 'publisher', v.publisher_id, 1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint
  FROM ql3.publisher_revocations v
ON CONFLICT (kind, id) DO NOTHING;
INSERT INTO ql3.security_boundaries (kind, id, version, changed_at_ms)
SELECT 'package', q.project_id || '/' || q.package_id, 1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint
  FROM ql3.package_quarantines q
ON CONFLICT (kind, id) DO NOTHING;
