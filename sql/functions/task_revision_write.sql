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
  PERFORM ql3.check_id(p_task_id, 'task_id', 128);
  PERFORM ql3.check_id(p_task_revision, 'task_revision', 128);
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
  content_digest := ql3.domain_digest('qinglong/task-execution-revision@v1',
    ql3.task_revision_canonical(p_project_id, p_task_id, p_task_revision, p_executor_type, v_template, p_context_ref));
  -- The identity's transaction advisory lock serialises concurrent writers of one identity.
  PERFORM ql3.advisory_lock('task-revision', p_project_id || '/' || p_task_id || '/' || p_task_revision);
  -- Under READ COMMITTED this statement's snapshot is taken after the lock, so a concurrent winner's
  -- committed row is seen here. ON CONFLICT DO NOTHING never changes a stored row (no upsert): it
  -- only turns "a row we could not see" into a signal -- under REPEATABLE READ/SERIALIZABLE
  -- PostgreSQL raises 40001 for a conflicting row invisible to the snapshot (the caller retries, and
  -- the retry sees the row); in any other case the row is re-read below and compared.
  FOR v_try IN 1 .. 2 LOOP
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
    EXIT WHEN v_try = 2;
    created_at_ms := ql3.now_ms();
    INSERT INTO ql3.task_execution_revisions (project_id, task_id, task_revision, executor_type,
      execution_template, context_ref, content_digest, created_at_ms)
    VALUES (p_project_id, p_task_id, p_task_revision, p_executor_type, v_template, p_context_ref,
            content_digest, created_at_ms)
    ON CONFLICT (project_id, task_id, task_revision) DO NOTHING;
    IF FOUND THEN
      outcome := 'inserted';
      RETURN;
    END IF;
  END LOOP;
  RAISE EXCEPTION USING ERRCODE = '40001',
    MESSAGE = pg_catalog.format('task execution revision (%s, %s, %s) was written concurrently and is not visible to this transaction; retry',
                                p_project_id, p_task_id, p_task_revision);
END
$fn$;
COMMENT ON FUNCTION ql3.task_revision_write(text, text, text, text, jsonb, text) IS
  'Internal (owner only): the single append-only write path of Task Execution Revisions, shared by ql3.task_revision_insert (ql3_admin) and ql3.task_reconciliation_record (ql3_package_manager). Checks the identity (project_id portable id <= 36 bytes, task_id and task_revision portable ids <= 128 bytes, via ql3.check_id), executor_type, context_ref (NULL or 1..1024 bytes) and template size (<= 256 KiB as jsonb text), normalises the template (ExecutionSpec check, ql3.execution_template_normalize), computes content_digest (qinglong/task-execution-revision@v1) and, under the identity''s transaction advisory lock, inserts or compares. Returns (outcome inserted|idempotent, content_digest hex, created_at_ms of the first write, ms since the epoch, database time). Errors: QL001 invalid input (message names the field), QL002 template > 256 KiB or a template bound, QL201 same identity with other content. Concurrency: under READ COMMITTED a waiter sees the winner''s row after the lock (idempotent or QL201); under REPEATABLE READ/SERIALIZABLE a waiter whose snapshot predates the winner gets SQLSTATE 40001 and must retry (qlpg.db does), never 23505 and never an overwrite. Source: ADR-0023 §1-3.';
REVOKE ALL ON FUNCTION ql3.task_revision_write(text, text, text, text, jsonb, text) FROM PUBLIC;
