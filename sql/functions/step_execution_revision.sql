CREATE OR REPLACE FUNCTION ql3.step_execution_revision(p_run_id text, p_step_run_id text,
  OUT run ql3.runs, OUT step ql3.step_runs, OUT reconciliation_receipt_digest text,
  OUT item ql3.task_reconciliation_items, OUT revision ql3.task_execution_revisions)
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  a ql3.workflow_admissions;
  rc ql3.task_reconciliation_receipts;
BEGIN
  SELECT * INTO run FROM ql3.runs r WHERE r.id = p_run_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('run %s not found', pg_catalog.left(p_run_id, 64));
  END IF;
  SELECT * INTO step FROM ql3.step_runs s WHERE s.id = p_step_run_id AND s.run_id = p_run_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('step run %s not found in run %s', pg_catalog.left(p_step_run_id, 128), p_run_id);
  END IF;
  -- The exact immutable plan of the Run.
  SELECT * INTO a FROM ql3.workflow_admissions x WHERE x.run_id = p_run_id;
  IF NOT FOUND OR a.plan_digest <> run.plan_digest
     OR NOT EXISTS (SELECT 1 FROM ql3.workflow_admission_steps ws
                     WHERE ws.run_id = p_run_id AND ws.step_run_id = p_step_run_id
                       AND ws.step_key = step.step_key AND ws.task_key = step.task_key) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL501', MESSAGE = pg_catalog.format('run %s: StepRun %s is not bound by the admitted plan', p_run_id, p_step_run_id);
  END IF;
  -- The Task reconciliation receipt of exactly the plan's generation/project/package/lock/revision.
  SELECT * INTO rc FROM ql3.task_reconciliation_receipts x
   WHERE x.project_id = run.project_id AND x.package_id = run.package_id AND x.generation = run.generation;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('no task reconciliation receipt for %s/%s generation %s', run.project_id, run.package_id, run.generation);
  END IF;
  IF rc.installation_id <> a.plan ->> 'installation_id' OR rc.lock_digest <> a.plan ->> 'lock_digest'
     OR rc.revision_digest <> a.plan ->> 'revision_digest' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202', MESSAGE = pg_catalog.format('reconciliation receipt %s does not match the plan of run %s', rc.receipt_digest, p_run_id);
  END IF;
  reconciliation_receipt_digest := rc.receipt_digest;
  SELECT * INTO item FROM ql3.task_reconciliation_items i
   WHERE i.receipt_digest = rc.receipt_digest AND i.task_key = step.task_key;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('reconciliation receipt %s has no item for task %s', rc.receipt_digest, step.task_key);
  END IF;
  SELECT * INTO revision FROM ql3.task_execution_revisions t
   WHERE t.project_id = run.project_id AND t.task_id = item.runtime_task_id AND t.task_revision = item.task_revision;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('task execution revision %s %s is unavailable', item.runtime_task_id, item.task_revision);
  END IF;
  revision := ql3.attempt_revision_verify(revision);
  IF revision.content_digest <> item.execution_digest OR revision.executor_type <> item.executor_type THEN
    RAISE EXCEPTION USING ERRCODE = 'QL501', MESSAGE = pg_catalog.format('execution revision %s does not match reconciliation item digest', item.task_revision);
  END IF;
END
$fn$;
COMMENT ON FUNCTION ql3.step_execution_revision(text, text) IS
  'Internal (owner only). Resolves the generation-bound execution facts of one StepRun: the Run, the StepRun (bound by the exact admitted plan), the Task reconciliation receipt of exactly the plan''s generation/project/package/lock/revision, its item for the step''s task, and the verified immutable Task Execution Revision (never a current head; fail-closed verification through ql3.attempt_revision_verify, remembered per exact stored content). Errors: QL101 missing, QL202 receipt drift, QL501 integrity failure. Source: ADR-0227 §1.';
REVOKE ALL ON FUNCTION ql3.step_execution_revision(text, text) FROM PUBLIC;
