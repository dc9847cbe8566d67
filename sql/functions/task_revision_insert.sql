CREATE OR REPLACE FUNCTION ql3.task_revision_insert(
  p_project_id text, p_task_id text, p_task_revision text, p_executor_type text,
  p_execution_template jsonb, p_context_ref text)
RETURNS TABLE (outcome text, content_digest text, created_at_ms bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  w record;
BEGIN
  PERFORM ql3.require_role('task_revision_insert', 'ql3_admin');
  -- The one append-only write path (shared with the package install path).
  w := ql3.task_revision_write(p_project_id, p_task_id, p_task_revision, p_executor_type,
                               p_execution_template, p_context_ref);
  outcome := w.outcome;
  content_digest := w.content_digest;
  created_at_ms := w.created_at_ms;
  RETURN NEXT;
END
$fn$;
COMMENT ON FUNCTION ql3.task_revision_insert(text, text, text, text, jsonb, text) IS
  'Role ql3_admin. Append-only insert of an immutable Task Execution Revision keyed by (p_project_id portable id <= 36 bytes, p_task_id portable id <= 128 bytes, p_task_revision portable id <= 128 bytes); portable id = ^[A-Za-z0-9][A-Za-z0-9._:-]*$. p_executor_type local_process|remote_worker. p_execution_template: ExecutionSpec object, <= 256 KiB as jsonb text: command (required; 1..256 non-empty strings, each <= 4096 UTF-8 bytes), working_directory (optional non-empty string <= 4096 bytes), timeout_ms (required integer 1..86400000, milliseconds), env_names (optional array of <= 128 unique names ^[A-Za-z_][A-Za-z0-9_]{0,127}$; names only, a NAME=value entry or a non-null env/environment field is rejected), resource_policy (optional object of <= 16 keys ^[a-z][a-z0-9_]{0,63}$ with integer values 0..2^53-1, unit in the key name, e.g. max_output_bytes); unknown fields are dropped and JSON null optional fields count as absent before canonicalising. p_context_ref: opaque text of 1..1024 bytes, or NULL for none (covered by the digest). Limitation: the argument is jsonb, so PostgreSQL has already collapsed duplicate object keys (last one wins) and rewritten 1e3 as 1000 before this function runs; callers holding JSON text must parse it strictly first (qlpg.api.task_revision_insert_json rejects duplicate keys and any float with QL001 before sending). 1.5 or 1.0 in a known integer field is still rejected here (QL001). Returns one row (outcome inserted|idempotent, content_digest = 64 lowercase hex SHA-256 under qinglong/task-execution-revision@v1, created_at_ms = database time of the first successful write, ms since the Unix epoch; an idempotent replay returns the first write''s time). Errors: QL001 invalid input (message names the argument or field, e.g. execution_template.timeout_ms), QL002 template larger than 256 KiB or a template count/length bound, QL201 same identity with different canonical content (never last-write-wins; the stored record is unchanged), QL601 caller not in role; a rejected call writes nothing. There is no update, upsert or delete function. Source: ADR-0023 §1-3.';
REVOKE ALL ON FUNCTION ql3.task_revision_insert(text, text, text, text, jsonb, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.task_revision_insert(text, text, text, text, jsonb, text) TO ql3_admin;
