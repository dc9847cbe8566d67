CREATE OR REPLACE FUNCTION ql3.attempt_running_batch(p_attempt_ids text[], p_lease_tokens text[])
RETURNS TABLE (attempt_id text, status text, step_run_version integer, attempt_count integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  i integer;
BEGIN
  PERFORM ql3.require_role('attempt_running_batch', 'ql3_worker_ingress');
  IF p_attempt_ids IS NULL OR p_lease_tokens IS NULL
     OR pg_catalog.cardinality(p_attempt_ids) <> pg_catalog.cardinality(p_lease_tokens)
     OR pg_catalog.cardinality(p_attempt_ids) NOT BETWEEN 1 AND 64 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'attempt_ids, lease_tokens: 1..64 of each, same length';
  END IF;
  -- Each report exactly as ql3.attempt_running, in ascending (Run, attempt) order so that Run
  -- locks are taken in one global order; the first refusal aborts the whole batch (writes nothing).
  FOR i IN SELECT o.i FROM pg_catalog.generate_subscripts(p_attempt_ids, 1) o(i)
            LEFT JOIN ql3.run_attempts ra ON ra.id = p_attempt_ids[o.i]
            ORDER BY ra.run_id, p_attempt_ids[o.i] LOOP
    RETURN QUERY SELECT * FROM ql3.attempt_running(p_attempt_ids[i], p_lease_tokens[i]);
  END LOOP;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_running_batch(text[], text[]) IS
  'Role ql3_worker_ingress. Batched activation (extension of ADR-0227 §4, docs/api-notes.md): ql3.attempt_running for each (p_attempt_ids[i], p_lease_tokens[i]) (1..64, same length) in one transaction, in ascending Run/attempt order. All or nothing: the first refusal (QL401, QL203, QL002) aborts the batch and nothing is written; report those attempts one by one. Returns the rows of ql3.attempt_running (attempt_id, status, step_run_version, attempt_count). Errors: QL001 and those of ql3.attempt_running.';
REVOKE ALL ON FUNCTION ql3.attempt_running_batch(text[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.attempt_running_batch(text[], text[]) TO ql3_worker_ingress;
