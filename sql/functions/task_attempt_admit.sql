CREATE OR REPLACE FUNCTION ql3.task_attempt_admit(p_run_id text, p_step_run_id text, p_step_run_version integer,
                                                  p_step_run_digest text, p_execution_revision jsonb)
RETURNS TABLE (attempt_id text, attempt integer, event_id text, receipt jsonb, receipt_digest text, replayed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  r ql3.runs;
  x record;
  ad ql3.task_attempt_admissions;
  v_claim_digest text;
  v_ids record;
  v_attempt integer;
  ev record;
  v_receipt jsonb;
  v_receipt_digest text;
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
  -- Recompute the caller's execution revision digest ourselves; never trust a claimed digest.
  v_claim_digest := ql3.execution_revision_digest(ql3.json_text(e, 'project_id', 'execution_revision', 36),
    ql3.json_text(e, 'task_id', 'execution_revision', 128), ql3.json_text(e, 'task_revision', 'execution_revision', 128),
    e ->> 'executor_type', e -> 'execution_template', e ->> 'context_ref');
  IF e ? 'content_digest' AND e ->> 'content_digest' IS DISTINCT FROM v_claim_digest THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = 'execution_revision.content_digest: the claimed digest differs from the recomputed one';
  END IF;

  SELECT * INTO r FROM ql3.runs WHERE id = p_run_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('run %s not found', p_run_id);
  END IF;
  PERFORM ql3.advisory_lock('package', r.project_id || '/' || r.package_id, true);
  PERFORM ql3.advisory_lock('publisher', r.publisher_id, true);
  PERFORM ql3.advisory_lock('run', p_run_id);

  -- Exact replay of the same ready epoch returns the identical receipt.
  SELECT * INTO ad FROM ql3.task_attempt_admissions t
   WHERE t.run_id = p_run_id AND t.step_run_id = p_step_run_id AND t.step_run_version = p_step_run_version;
  IF FOUND THEN
    IF ad.execution_digest <> v_claim_digest OR ad.receipt ->> 'step_run_digest' <> p_step_run_digest THEN
      RAISE EXCEPTION USING ERRCODE = 'QL201',
        MESSAGE = pg_catalog.format('epoch (%s, %s, %s) was admitted with another execution revision or StepRun digest',
                                    p_run_id, p_step_run_id, p_step_run_version);
    END IF;
    RETURN QUERY SELECT ad.attempt_id, ad.attempt, ad.event_id, ad.receipt, ad.receipt_digest, true;
    RETURN;
  END IF;

  x := ql3.step_execution_revision(p_run_id, p_step_run_id);
  r := x.run;
  IF r.status <> 'running' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203', MESSAGE = pg_catalog.format('run %s is %s, not running', p_run_id, r.status);
  END IF;
  IF r.cancel_requested_at_ms IS NOT NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203', MESSAGE = pg_catalog.format('run %s has a cancel request: admission is frozen', p_run_id);
  END IF;
  PERFORM ql3.start_guard(r.project_id, r.package_id, r.publisher_id, NULL);
  IF (x.step).version <> p_step_run_version THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('step run %s: version %s is stale (current %s)', p_step_run_id, p_step_run_version, (x.step).version);
  END IF;
  IF (x.step).status <> 'ready' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203', MESSAGE = pg_catalog.format('step run %s is %s, not ready', p_step_run_id, (x.step).status);
  END IF;
  IF (x.step).digest <> ql3.step_run_digest(p_run_id, p_step_run_id, (x.step).step_key, (x.step).task_key, (x.step).status,
                                            (x.step).version, (x.step).attempt_count, (x.step).ready_at_ms) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL501', MESSAGE = pg_catalog.format('step run %s: stored digest does not verify', p_step_run_id);
  END IF;
  IF (x.step).digest <> p_step_run_digest THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202', MESSAGE = pg_catalog.format('step run %s: digest %s is stale', p_step_run_id, p_step_run_digest);
  END IF;
  IF e ->> 'project_id' <> (x.revision).project_id OR e ->> 'task_id' <> (x.item).runtime_task_id
     OR e ->> 'task_revision' <> (x.item).task_revision OR e ->> 'executor_type' <> (x.item).executor_type
     OR v_claim_digest <> (x.item).execution_digest THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('execution revision disagrees with the generation-bound reconciliation item (expected %s %s %s)',
                                  (x.item).runtime_task_id, (x.item).task_revision, (x.item).executor_type);
  END IF;
  IF EXISTS (SELECT 1 FROM ql3.run_attempts ra WHERE ra.step_run_id = p_step_run_id
              AND ra.status IN ('claimed', 'starting', 'running')) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203', MESSAGE = pg_catalog.format('step run %s already has a live attempt', p_step_run_id);
  END IF;
  v_attempt := r.last_attempt + 1;
  IF v_attempt > 8192 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = pg_catalog.format('run %s: attempt number would exceed 8192', p_run_id);
  END IF;
  v_ids := ql3.attempt_ids(r.plan_digest, p_step_run_id, p_step_run_version);
  ev := ql3.run_event_append(p_run_id, 'workflow.task_attempt_admitted', p_step_run_id, v_ids.attempt_id,
          pg_catalog.jsonb_build_object('event_id', v_ids.event_id, 'attempt', v_attempt,
                                        'step_run_version', p_step_run_version, 'executor_type', (x.item).executor_type));
  UPDATE ql3.runs SET last_attempt = v_attempt WHERE id = p_run_id RETURNING * INTO r;
  v_receipt := pg_catalog.jsonb_build_object(
    'schema', 'qinglong/plugin-package-workflow-task-attempt-receipt@v1',
    'run_id', p_run_id, 'plan_digest', r.plan_digest,
    'step_run_id', p_step_run_id, 'step_run_version', p_step_run_version, 'step_run_digest', (x.step).digest,
    'reconciliation_receipt_digest', x.reconciliation_receipt_digest,
    'runtime_task_id', (x.item).runtime_task_id, 'task_revision', (x.item).task_revision,
    'task_definition_digest', (x.item).definition_digest, 'execution_digest', (x.item).execution_digest,
    'executor_type', (x.item).executor_type,
    'attempt_id', v_ids.attempt_id, 'attempt', v_attempt, 'event_id', v_ids.event_id,
    'event_sequence', ev.sequence, 'run_version', r.version, 'admitted_at_ms', ev.at_ms);
  v_receipt_digest := ql3.domain_digest('qinglong/plugin-package-workflow-task-attempt-receipt@v1',
                                        ql3.canonical_json(v_receipt::json));
  INSERT INTO ql3.task_attempt_admissions (run_id, step_run_id, step_run_version, attempt_id, attempt, event_id,
    runtime_task_id, task_revision, executor_type, execution_digest, receipt, receipt_digest, admitted_at_ms)
  VALUES (p_run_id, p_step_run_id, p_step_run_version, v_ids.attempt_id, v_attempt, v_ids.event_id,
          (x.item).runtime_task_id, (x.item).task_revision, (x.item).executor_type, (x.item).execution_digest,
          v_receipt, v_receipt_digest, ev.at_ms);
  INSERT INTO ql3.run_attempts (id, run_id, step_run_id, step_run_version, attempt, status, executor_type, project_id,
    runtime_task_id, task_revision, execution_digest, timeout_ms, created_at_ms)
  VALUES (v_ids.attempt_id, p_run_id, p_step_run_id, p_step_run_version, v_attempt, 'claimed', (x.item).executor_type,
          r.project_id, (x.item).runtime_task_id, (x.item).task_revision, (x.item).execution_digest,
          ((x.revision).execution_template ->> 'timeout_ms')::integer, ev.at_ms);
  UPDATE ql3.step_runs SET epoch_admitted = true, current_attempt_id = v_ids.attempt_id WHERE id = p_step_run_id;
  RETURN QUERY SELECT v_ids.attempt_id, v_attempt, v_ids.event_id, v_receipt, v_receipt_digest, false;
END
$fn$;
COMMENT ON FUNCTION ql3.task_attempt_admit(text, text, integer, text, jsonb) IS
  'Role ql3_runtime. Task Attempt admission of one ready epoch (ADR-0227 §1-3). Inputs: run id, StepRun id, its exact version and digest, and the complete execution revision jsonb {project_id, task_id, task_revision, executor_type local_process|remote_worker, execution_template, context_ref?, content_digest?} whose digest SQL recomputes. In one transaction, under the package/publisher boundaries (shared) and the Run lock: exact replay of the epoch returns the identical receipt (replayed = true); else checks the exact plan, the running Run without cancel request, quarantine/revocation, the exact ready StepRun version and verified digest, the reconciliation receipt of the plan''s generation, and that the caller''s task id / revision / executor type / digest equal the ones derived from the reconciliation item; allocates the Run-global attempt number (1..8192), inserts the claimed RunAttempt, the workflow.task_attempt_admitted event and the immutable receipt (digest under qinglong/plugin-package-workflow-task-attempt-receipt@v1), bumping the Run''s version/event_sequence once; Run stays running, StepRun stays ready. Ids: wta:/wte: + 32 hex (DESIGN §6). Returns (attempt_id, attempt, event_id, receipt, receipt_digest, replayed). Errors: QL001, QL002 attempt > 8192, QL101, QL201 epoch admitted with other content, QL202 stale version/digest or disagreeing revision, QL203 Run not running / cancel requested / step not ready, QL301 quarantined or revoked, QL501 integrity, QL601.';
REVOKE ALL ON FUNCTION ql3.task_attempt_admit(text, text, integer, text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.task_attempt_admit(text, text, integer, text, jsonb) TO ql3_runtime;
