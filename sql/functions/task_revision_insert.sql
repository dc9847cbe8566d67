CREATE OR REPLACE FUNCTION ql3.task_revision_insert(
  p_project_id text, p_task_id text, p_task_revision text, p_executor_type text,
  p_execution_template jsonb, p_context_ref text)
RETURNS TABLE (outcome text, content_digest text, created_at_ms bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  PERFORM ql3.require_role('task_revision_insert', 'ql3_admin');
  RETURN QUERY SELECT w.outcome, w.content_digest, w.created_at_ms
    FROM ql3.task_revision_write(p_project_id, p_task_id, p_task_revision, p_executor_type,
                                 p_execution_template, p_context_ref) w;
END
$fn$;
COMMENT ON FUNCTION ql3.task_revision_insert(text, text, text, text, jsonb, text) IS
  'Role ql3_admin. Append-only insert of an immutable Task Execution Revision keyed by (project_id <= 36 bytes, task_id <= 128, task_revision <= 128). p_executor_type local_process|remote_worker; p_execution_template: ExecutionSpec {command: non-empty array of non-empty strings (required), working_directory string, timeout_ms integer 1..86400000 (required), env_names array of unique variable names (names only), resource_policy object of bounded integers}; unknown fields are dropped; p_context_ref opaque text or null. Returns (outcome inserted|idempotent, content_digest = lowercase hex SHA-256 under qinglong/task-execution-revision@v1, created_at_ms = first successful write, ms). Errors: QL001 invalid input (names the field), QL002 template > 256 KiB, QL201 same identity with different content (never last-write-wins), QL601 caller not in role. Source: ADR-0023 §1-3.';
REVOKE ALL ON FUNCTION ql3.task_revision_insert(text, text, text, text, jsonb, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.task_revision_insert(text, text, text, text, jsonb, text) TO ql3_admin;
