CREATE OR REPLACE FUNCTION ql3.task_revision_resolve(p_project_id text, p_task_id text, p_task_revision text)
RETURNS TABLE (project_id text, task_id text, task_revision text, executor_type text,
               execution_template jsonb, context_ref text, content_digest text, created_at_ms bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_column
DECLARE
  r ql3.task_execution_revisions;
BEGIN
  PERFORM ql3.require_role('task_revision_resolve', 'ql3_admin');
  IF p_project_id IS NULL OR p_task_id IS NULL OR p_task_revision IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'project_id, task_id and task_revision are required';
  END IF;
  SELECT * INTO r FROM ql3.task_execution_revisions t
   WHERE t.project_id = p_project_id AND t.task_id = p_task_id AND t.task_revision = p_task_revision;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101',
      MESSAGE = pg_catalog.format('task execution revision (%s, %s, %s) is unavailable',
                                  pg_catalog.left(p_project_id, 64), pg_catalog.left(p_task_id, 160),
                                  pg_catalog.left(p_task_revision, 160));
  END IF;
  r := ql3.task_revision_verify(r);
  RETURN QUERY SELECT r.project_id, r.task_id, r.task_revision, r.executor_type, r.execution_template,
                      r.context_ref, r.content_digest, r.created_at_ms;
END
$fn$;
COMMENT ON FUNCTION ql3.task_revision_resolve(text, text, text) IS
  'Role ql3_admin. Exact read of one Task Execution Revision by (project_id, task_id, task_revision); never falls back to a current/latest task. Returns the record (executor_type, execution_template jsonb, context_ref, content_digest hex, created_at_ms) after fail-closed verification. Errors: QL001 null arguments, QL101 unavailable, QL501 integrity failure (non-canonical template, illegal executor type, damaged timestamp, digest mismatch), QL601 caller not in role. Source: ADR-0023 §2-3.';
REVOKE ALL ON FUNCTION ql3.task_revision_resolve(text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.task_revision_resolve(text, text, text) TO ql3_admin;
