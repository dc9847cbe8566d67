CREATE OR REPLACE FUNCTION ql3.task_attempt_admit(p_run_id text, p_step_run_id text, p_step_run_version integer,
                                                  p_step_run_digest text, p_execution_revision jsonb)
RETURNS TABLE (attempt_id text, attempt integer, event_id text, receipt jsonb, receipt_digest text, replayed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  r record;
  res record;
  e jsonb := p_execution_revision;
BEGIN
  PERFORM ql3.require_role('task_attempt_admit', 'ql3_runtime');
  PERFORM ql3.check_id(p_run_id, 'run_id');
  PERFORM ql3.check_id(p_step_run_id, 'step_run_id', 128);
  IF p_step_run_version IS NULL OR p_step_run_version < 1 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'step_run_version: must be a positive integer';
  END IF;
  IF p_step_run_digest IS NULL OR p_step_run_digest !~ '^[0-9a-f]{64}$' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'step_run_digest: must be 64 lowercase hex';
  END IF;
  IF e IS NULL OR pg_catalog.octet_length(e::text) > 262144 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'execution_revision: required, at most 256 KiB';
  END IF;
  PERFORM ql3.json_require_keys(e, 'execution_revision',
    ARRAY['project_id', 'task_id', 'task_revision', 'executor_type', 'execution_template'],
    ARRAY['context_ref', 'content_digest']);
  IF NOT (e ->> 'executor_type' = ANY (ARRAY['local_process', 'remote_worker'])) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'execution_revision.executor_type: must be local_process or remote_worker';
  END IF;
  IF e ? 'context_ref' AND pg_catalog.jsonb_typeof(e -> 'context_ref') NOT IN ('string', 'null') THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'execution_revision.context_ref: must be a string or null';
  END IF;
  -- Cheap shape checks first (QL001 before any lookup); the digest itself is recomputed under
  -- the locks by ql3.attempt_claim_digest (never trusting a claimed content_digest).
  PERFORM ql3.json_text(e, 'project_id', 'execution_revision', 36), ql3.json_text(e, 'task_id', 'execution_revision', 128),
          ql3.json_text(e, 'task_revision', 'execution_revision', 128);
  IF e ? 'content_digest' AND (pg_catalog.jsonb_typeof(e -> 'content_digest') <> 'string'
                               OR e ->> 'content_digest' !~ '^[0-9a-f]{64}$') THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'execution_revision.content_digest: must be 64 lowercase hex';
  END IF;

  SELECT x.project_id, x.package_id, x.publisher_id INTO r FROM ql3.runs x WHERE x.id = p_run_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('run %s not found', p_run_id);
  END IF;
  -- A committed admission of this epoch is immutable: its replay needs no lock (so the losers of
  -- a race that arrive after the winner's COMMIT do not queue on the Run lock).
  IF NOT EXISTS (SELECT 1 FROM ql3.task_attempt_admissions t WHERE t.run_id = p_run_id
                    AND t.step_run_id = p_step_run_id AND t.step_run_version = p_step_run_version) THEN
    PERFORM ql3.advisory_lock('package', r.project_id || '/' || r.package_id, true);
    PERFORM ql3.advisory_lock('publisher', r.publisher_id, true);
    PERFORM ql3.advisory_lock('run', p_run_id);
  END IF;
  SELECT * INTO res FROM ql3.attempt_admit_epoch(p_run_id, p_step_run_id, p_step_run_version, p_step_run_digest, e, false) x;
  IF e ? 'content_digest' AND e ->> 'content_digest' IS DISTINCT FROM (res.receipt ->> 'execution_digest') THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = 'execution_revision.content_digest: the claimed digest differs from the recomputed one';
  END IF;
  RETURN QUERY SELECT res.attempt_id, res.attempt, res.event_id, res.receipt, res.receipt_digest, res.replayed;
END
$fn$;
COMMENT ON FUNCTION ql3.task_attempt_admit(text, text, integer, text, jsonb) IS
  'Role ql3_runtime. Task Attempt admission of one ready epoch (ADR-0227 §1-3). Inputs: run id, StepRun id, its exact version and digest, and the complete execution revision jsonb {project_id, task_id, task_revision, executor_type local_process|remote_worker, execution_template, context_ref?, content_digest?} whose digest SQL recomputes. In one transaction, under the package/publisher boundaries (shared) and the Run lock: exact replay of the epoch returns the identical receipt (replayed = true); else checks the exact plan, the running Run without cancel request, quarantine/revocation, the exact ready StepRun version and verified digest, the reconciliation receipt of the plan''s generation, and that the caller''s task id / revision / executor type / digest equal the ones derived from the reconciliation item; allocates the Run-global attempt number (1..8192), inserts the claimed RunAttempt, the workflow.task_attempt_admitted event and the immutable receipt (digest under qinglong/plugin-package-workflow-task-attempt-receipt@v1), bumping the Run''s version/event_sequence once; Run stays running, StepRun stays ready. Ids: wta:/wte: + 32 hex (DESIGN §6). Returns (attempt_id, attempt, event_id, receipt, receipt_digest, replayed). Errors: QL001, QL002 attempt > 8192, QL101, QL201 epoch admitted with other content, QL202 stale version/digest or disagreeing revision, QL203 Run not running / cancel requested / step not ready, QL301 quarantined or revoked, QL501 integrity, QL601.';
REVOKE ALL ON FUNCTION ql3.task_attempt_admit(text, text, integer, text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.task_attempt_admit(text, text, integer, text, jsonb) TO ql3_runtime;
