CREATE OR REPLACE FUNCTION ql3.task_attempt_snapshot(p_run_id text, p_step_run_id text, p_step_run_version integer)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  x record;
BEGIN
  PERFORM ql3.require_role('task_attempt_snapshot', 'ql3_runtime');
  PERFORM ql3.check_id(p_run_id, 'run_id');
  PERFORM ql3.check_id(p_step_run_id, 'step_run_id', 128);
  x := ql3.step_execution_revision(p_run_id, p_step_run_id);
  IF (x.step).version <> p_step_run_version THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('step run %s: version %s requested, current is %s', p_step_run_id, p_step_run_version, (x.step).version);
  END IF;
  RETURN pg_catalog.jsonb_build_object(
    'run_id', p_run_id, 'step_run_id', p_step_run_id, 'step_run_version', (x.step).version,
    'step_run_digest', (x.step).digest, 'step_run_status', (x.step).status,
    'reconciliation_receipt_digest', x.reconciliation_receipt_digest,
    'execution_revision', pg_catalog.jsonb_build_object(
      'project_id', (x.revision).project_id, 'task_id', (x.revision).task_id,
      'task_revision', (x.revision).task_revision, 'executor_type', (x.revision).executor_type,
      'execution_template', (x.revision).execution_template, 'context_ref', (x.revision).context_ref,
      'content_digest', (x.revision).content_digest));
END
$fn$;
COMMENT ON FUNCTION ql3.task_attempt_snapshot(text, text, integer) IS
  'Role ql3_runtime. Runtime-only snapshot for Task Attempt admission: jsonb {run_id, step_run_id, step_run_version, step_run_digest, step_run_status, reconciliation_receipt_digest, execution_revision {project_id, task_id pkg:<package>:<task>, task_revision qltd:v1:<generation>:<digest>, executor_type, execution_template, context_ref, content_digest}} from the generation-bound reconciliation item (never a current head). Read-only apart from the verification memo. Errors: QL001, QL101, QL202 version moved or receipt drift, QL501 integrity failure, QL601. Source: ADR-0227 §1.';
REVOKE ALL ON FUNCTION ql3.task_attempt_snapshot(text, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.task_attempt_snapshot(text, text, integer) TO ql3_runtime;
