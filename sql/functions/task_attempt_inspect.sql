CREATE OR REPLACE FUNCTION ql3.task_attempt_inspect(p_run_id text, p_step_run_id text, p_step_run_version integer)
RETURNS TABLE (attempt_id text, attempt integer, event_id text, receipt jsonb, receipt_digest text, replayed boolean)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  ad ql3.task_attempt_admissions;
BEGIN
  PERFORM ql3.require_role('task_attempt_inspect', 'ql3_runtime');
  SELECT * INTO ad FROM ql3.task_attempt_admissions t
   WHERE t.run_id = p_run_id AND t.step_run_id = p_step_run_id AND t.step_run_version = p_step_run_version;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101',
      MESSAGE = pg_catalog.format('no durable attempt admission for epoch (%s, %s, %s): it did not commit',
                                  pg_catalog.left(p_run_id, 64), pg_catalog.left(p_step_run_id, 128), p_step_run_version);
  END IF;
  RETURN QUERY SELECT ad.attempt_id, ad.attempt, ad.event_id, ad.receipt, ad.receipt_digest, true;
END
$fn$;
COMMENT ON FUNCTION ql3.task_attempt_inspect(text, text, integer) IS
  'Role ql3_runtime. Answers a lost COMMIT response of ql3.task_attempt_admit from the durable ledger without creating a second attempt: returns (attempt_id, attempt, event_id, receipt, receipt_digest, replayed = true) of the epoch (run, step run, version). Errors: QL101 nothing committed for that epoch, QL601.';
REVOKE ALL ON FUNCTION ql3.task_attempt_inspect(text, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.task_attempt_inspect(text, text, integer) TO ql3_runtime;
