CREATE OR REPLACE FUNCTION ql3.task_revision_write(
  p_project_id text, p_task_id text, p_task_revision text, p_executor_type text,
  p_execution_template jsonb, p_context_ref text,
  OUT outcome text, OUT content_digest text, OUT created_at_ms bigint)
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  v_template jsonb;
  v_existing ql3.task_execution_revisions;
BEGIN
  PERFORM ql3.check_id(p_project_id, 'project_id');
  IF p_task_id IS NULL OR p_task_id = '' OR pg_catalog.octet_length(p_task_id) > 128
     OR p_task_id !~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'task_id: must be a portable id of at most 128 bytes';
  END IF;
  IF p_task_revision IS NULL OR p_task_revision = '' OR pg_catalog.octet_length(p_task_revision) > 128
     OR p_task_revision !~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'task_revision: must be a portable id of at most 128 bytes';
  END IF;
  IF p_executor_type IS NULL OR p_executor_type NOT IN ('local_process', 'remote_worker') THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'executor_type: must be local_process or remote_worker';
  END IF;
  IF p_context_ref IS NOT NULL AND (p_context_ref = '' OR pg_catalog.octet_length(p_context_ref) > 1024) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'context_ref: must be null or 1..1024 bytes';
  END IF;
  IF p_execution_template IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'execution_template: must not be null';
  END IF;
  IF pg_catalog.octet_length(p_execution_template::text) > 262144 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'execution_template: larger than 256 KiB';
  END IF;
  v_template := ql3.execution_template_normalize(p_execution_template);
  content_digest := ql3.execution_revision_digest(p_project_id, p_task_id, p_task_revision, p_executor_type,
                                                  v_template, p_context_ref);
  PERFORM ql3.advisory_lock('task-revision', p_project_id || '/' || p_task_id || '/' || p_task_revision);
  SELECT * INTO v_existing FROM ql3.task_execution_revisions r
   WHERE r.project_id = p_project_id AND r.task_id = p_task_id AND r.task_revision = p_task_revision;
  IF FOUND THEN
    IF v_existing.content_digest <> content_digest THEN
      RAISE EXCEPTION USING ERRCODE = 'QL201',
        MESSAGE = pg_catalog.format('task execution revision (%s, %s, %s) already exists with other content (digest %s, not %s)',
                                    p_project_id, p_task_id, p_task_revision, v_existing.content_digest, content_digest);
    END IF;
    outcome := 'idempotent';
    created_at_ms := v_existing.created_at_ms;
    RETURN;
  END IF;
  created_at_ms := ql3.now_ms();
  INSERT INTO ql3.task_execution_revisions (project_id, task_id, task_revision, executor_type,
    execution_template, context_ref, content_digest, created_at_ms)
  VALUES (p_project_id, p_task_id, p_task_revision, p_executor_type, v_template, p_context_ref,
          content_digest, created_at_ms);
  outcome := 'inserted';
END
$fn$;
COMMENT ON FUNCTION ql3.task_revision_write(text, text, text, text, jsonb, text) IS
  'Internal (owner only): the single append-only write path of Task Execution Revisions, shared by ql3.task_revision_insert (ql3_admin) and ql3.task_reconciliation_record (ql3_package_manager). Normalises the template (ExecutionSpec check), computes content_digest (qinglong/task-execution-revision@v1) and, under the identity''s advisory lock, inserts or compares. Returns (outcome inserted|idempotent, content_digest hex, created_at_ms of the first write). Errors: QL001 invalid input, QL002 template > 256 KiB, QL201 same identity with other content. Source: ADR-0023 §1-3.';
REVOKE ALL ON FUNCTION ql3.task_revision_write(text, text, text, text, jsonb, text) FROM PUBLIC;
