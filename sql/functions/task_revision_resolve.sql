CREATE OR REPLACE FUNCTION ql3.task_revision_resolve(p_project_id text, p_task_id text, p_task_revision text)
RETURNS TABLE (project_id text, task_id text, task_revision text, executor_type text,
               execution_template jsonb, context_ref text, content_digest text, created_at_ms bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_column
DECLARE
  r ql3.task_execution_revisions;
BEGIN
  PERFORM ql3.require_role('task_revision_resolve', 'ql3_admin');
  -- Same identity rules as the write path: a malformed id is an input error, not "unavailable".
  PERFORM ql3.check_id(p_project_id, 'project_id');
  PERFORM ql3.check_id(p_task_id, 'task_id', 128);
  PERFORM ql3.check_id(p_task_revision, 'task_revision', 128);
  SELECT * INTO r FROM ql3.task_execution_revisions t
   WHERE t.project_id = p_project_id AND t.task_id = p_task_id AND t.task_revision = p_task_revision;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101',
      MESSAGE = pg_catalog.format('task execution revision (%s, %s, %s) is unavailable',
                                  p_project_id, p_task_id, p_task_revision);
  END IF;
  -- Fail closed: re-normalise, compare canonical bytes, recompute the digest (QL501 on any defect).
  r := ql3.task_revision_verify(r);
  RETURN QUERY SELECT r.project_id, r.task_id, r.task_revision, r.executor_type, r.execution_template,
                      r.context_ref, r.content_digest, r.created_at_ms;
END
$fn$;
COMMENT ON FUNCTION ql3.task_revision_resolve(text, text, text) IS
  'Role ql3_admin. Exact read of one Task Execution Revision by its full identity (p_project_id portable id <= 36 bytes, p_task_id and p_task_revision portable ids <= 128 bytes); never falls back to a current/latest task or another revision. Returns one row (project_id, task_id, task_revision, executor_type local_process|remote_worker, execution_template jsonb in canonical normalised form, context_ref text or NULL, content_digest = 64 lowercase hex SHA-256 under qinglong/task-execution-revision@v1, created_at_ms = database time of the first successful write, ms since the Unix epoch) after fail-closed verification: the stored template is re-normalised and must give identical canonical bytes, and the digest is recomputed over identity, executor, template and context_ref. Errors: QL001 NULL or malformed id (names the argument), QL101 unavailable (no such identity), QL501 integrity failure (non-canonical or invalid template, out-of-bounds field, illegal executor type, damaged created_at_ms, digest mismatch) with no row returned, QL601 caller not in role. Source: ADR-0023 §2-3.';
REVOKE ALL ON FUNCTION ql3.task_revision_resolve(text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.task_revision_resolve(text, text, text) TO ql3_admin;
