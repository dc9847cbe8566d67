CREATE OR REPLACE FUNCTION ql3.attempt_complete_batch(p_attempt_ids text[], p_lease_tokens text[], p_outcomes text[],
                                                      p_exit_codes integer[], p_details jsonb[] DEFAULT NULL)
RETURNS TABLE (attempt_id text, outcome text, receipt jsonb, receipt_digest text, replayed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  i integer;
  n integer := pg_catalog.cardinality(p_attempt_ids);
BEGIN
  PERFORM ql3.require_role('attempt_complete_batch', 'ql3_worker_ingress');
  IF p_attempt_ids IS NULL OR p_lease_tokens IS NULL OR p_outcomes IS NULL OR p_exit_codes IS NULL
     OR n NOT BETWEEN 1 AND 64 OR pg_catalog.cardinality(p_lease_tokens) <> n
     OR pg_catalog.cardinality(p_outcomes) <> n OR pg_catalog.cardinality(p_exit_codes) <> n
     OR (p_details IS NOT NULL AND pg_catalog.cardinality(p_details) <> n) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001',
      MESSAGE = 'attempt_ids, lease_tokens, outcomes, exit_codes (and details when given): 1..64 of each, same length';
  END IF;
  -- Each report exactly as ql3.attempt_complete, in ascending (Run, attempt) order; all or nothing.
  FOR i IN SELECT o.i FROM pg_catalog.generate_subscripts(p_attempt_ids, 1) o(i)
            LEFT JOIN ql3.run_attempts ra ON ra.id = p_attempt_ids[o.i]
            ORDER BY ra.run_id, p_attempt_ids[o.i] LOOP
    RETURN QUERY SELECT p_attempt_ids[i], x.* FROM ql3.attempt_complete(p_attempt_ids[i], p_lease_tokens[i], p_outcomes[i],
                                                            p_exit_codes[i], p_details[i]) x;
  END LOOP;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_complete_batch(text[], text[], text[], integer[], jsonb[]) IS
  'Role ql3_worker_ingress. Batched completion (extension of ADR-0227 §4, docs/api-notes.md): ql3.attempt_complete for each (p_attempt_ids[i], p_lease_tokens[i], p_outcomes[i], p_exit_codes[i], p_details[i]) (1..64, same length; p_details NULL for none) in one transaction, in ascending Run/attempt order, each with its own fencing, deadline re-check, crash-window handling, frontier advance and aggregation. All or nothing: the first refusal (QL001, QL201, QL203, QL401) aborts the batch and nothing is written; report those attempts one by one. Returns (attempt_id, outcome, receipt, receipt_digest, replayed) per attempt. Errors: QL001 and those of ql3.attempt_complete.';
REVOKE ALL ON FUNCTION ql3.attempt_complete_batch(text[], text[], text[], integer[], jsonb[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.attempt_complete_batch(text[], text[], text[], integer[], jsonb[]) TO ql3_worker_ingress;
