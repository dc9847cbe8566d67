CREATE OR REPLACE FUNCTION ql3.workflow_admission_inspect(p_run_id text, p_plan_digest text DEFAULT NULL)
RETURNS TABLE (run_id text, plan_digest text, receipt jsonb, receipt_digest text, replayed boolean)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  a ql3.workflow_admissions;
BEGIN
  PERFORM ql3.require_role('workflow_admission_inspect', 'ql3_package_executor');
  IF p_run_id IS NULL AND p_plan_digest IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'run_id or plan_digest is required';
  END IF;
  SELECT * INTO a FROM ql3.workflow_admissions x
   WHERE (p_run_id IS NULL OR x.run_id = p_run_id) AND (p_plan_digest IS NULL OR x.plan_digest = p_plan_digest);
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101',
      MESSAGE = pg_catalog.format('no durable admission for run %s / plan %s (the admission did not commit)',
                                  COALESCE(pg_catalog.left(p_run_id, 64), '-'), COALESCE(pg_catalog.left(p_plan_digest, 64), '-'));
  END IF;
  RETURN QUERY SELECT a.run_id, a.plan_digest, a.receipt, a.receipt_digest, true;
END
$fn$;
COMMENT ON FUNCTION ql3.workflow_admission_inspect(text, text) IS
  'Role ql3_package_executor. Answers a lost COMMIT response of ql3.workflow_plan_admit from the durable record, never by creating ids: given p_run_id and/or p_plan_digest returns (run_id, plan_digest, receipt jsonb, receipt_digest, replayed = true) exactly as stored. Errors: QL001 both null, QL101 no such admission (it did not commit: retry the same plan), QL601.';
REVOKE ALL ON FUNCTION ql3.workflow_admission_inspect(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.workflow_admission_inspect(text, text) TO ql3_package_executor;
