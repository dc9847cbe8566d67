CREATE OR REPLACE FUNCTION ql3.task_attempt_admit_page(p_after_run_id text, p_after_step_run_id text, p_limit integer)
RETURNS TABLE (run_id text, step_run_id text, step_run_version integer, outcome text, attempt_id text,
               attempt integer, event_id text, receipt jsonb, receipt_digest text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  res record;
  v_runs text[];
  v_steps text[];
  v_versions integer[];
  v_digests text[];
  v_packages text[];
  v_publishers text[];
  v_id text;
BEGIN
  PERFORM ql3.require_role('task_attempt_admit_page', 'ql3_runtime');
  IF p_limit IS NULL OR p_limit < 1 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'limit: must be 1..64';
  END IF;
  IF p_limit > 64 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'limit: a candidate page holds at most 64 StepRuns';
  END IF;
  IF (p_after_run_id IS NULL) <> (p_after_step_run_id IS NULL) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'after_run_id and after_step_run_id: give both or neither';
  END IF;
  -- The same keyset page as ql3.task_attempt_candidates (partial index step_runs_candidates_idx).
  SELECT pg_catalog.array_agg(p.run_id ORDER BY p.run_id, p.step_run_id),
         pg_catalog.array_agg(p.step_run_id ORDER BY p.run_id, p.step_run_id),
         pg_catalog.array_agg(p.version ORDER BY p.run_id, p.step_run_id),
         pg_catalog.array_agg(p.digest ORDER BY p.run_id, p.step_run_id),
         pg_catalog.array_agg(DISTINCT p.project_id || '/' || p.package_id),
         pg_catalog.array_agg(DISTINCT p.publisher_id)
    INTO v_runs, v_steps, v_versions, v_digests, v_packages, v_publishers
    FROM (SELECT s.run_id, s.id AS step_run_id, s.version, s.digest, r.project_id, r.package_id, r.publisher_id
            FROM ql3.step_runs s
            JOIN ql3.runs r ON r.id = s.run_id
           WHERE s.status = 'ready' AND NOT s.epoch_admitted
             AND (s.run_id, s.id) > (COALESCE(p_after_run_id, ''), COALESCE(p_after_step_run_id, ''))
             AND r.status = 'running' AND r.cancel_requested_at_ms IS NULL
           ORDER BY s.run_id, s.id
           LIMIT p_limit) p;
  IF v_runs IS NULL THEN
    RETURN;
  END IF;
  -- Global lock order (DESIGN §7): every security boundary of the page (shared; packages, then
  -- publishers, each sorted) before any Run lock; then the Runs in ascending id order (page order).
  FOREACH v_id IN ARRAY v_packages LOOP
    PERFORM ql3.advisory_lock('package', v_id, true);
  END LOOP;
  FOREACH v_id IN ARRAY v_publishers LOOP
    PERFORM ql3.advisory_lock('publisher', v_id, true);
  END LOOP;
  FOR i IN 1 .. pg_catalog.array_length(v_runs, 1) LOOP
    PERFORM ql3.advisory_lock('run', v_runs[i]);
    SELECT * INTO res FROM ql3.attempt_admit_epoch(v_runs[i], v_steps[i], v_versions[i], v_digests[i], NULL, true) x;
    run_id := v_runs[i]; step_run_id := v_steps[i]; step_run_version := v_versions[i];
    outcome := CASE WHEN res.skipped IS NOT NULL THEN 'skipped:' || res.skipped
                    WHEN res.replayed THEN 'replayed' ELSE 'admitted' END;
    attempt_id := res.attempt_id; attempt := res.attempt; event_id := res.event_id;
    receipt := res.receipt; receipt_digest := res.receipt_digest;
    RETURN NEXT;
  END LOOP;
END
$fn$;
COMMENT ON FUNCTION ql3.task_attempt_admit_page(text, text, integer) IS
  'Role ql3_runtime. Batched Task Attempt admission (extension of ADR-0227 §3, docs/api-notes.md): reads the keyset page of ql3.task_attempt_candidates (after (p_after_run_id, p_after_step_run_id), both NULL for the first page; p_limit 1..64) and admits every epoch of it in this one transaction, with exactly the checks, ids, events and receipts of ql3.task_attempt_admit, the execution revision being the one derived from the generation-bound reconciliation item (there is no caller claim to disagree). Locks: all security boundaries of the page (shared, sorted), then each Run in id order. Returns one row per candidate: (run_id, step_run_id, step_run_version, outcome admitted|replayed|skipped:<reason>, attempt_id, attempt, event_id, receipt, receipt_digest); a candidate that moved since the page was read is skipped (run_ended, cancel_requested, stale_version, not_ready, stale_digest, live_attempt). The last row is the keyset cursor of the next page; fewer rows than p_limit means the end. Any other error (QL002 attempt > 8192, QL301 quarantined or revoked, QL501 integrity) aborts the whole page: admit its candidates one by one with ql3.task_attempt_admit. Errors: QL001, QL002, QL301, QL501, QL601.';
REVOKE ALL ON FUNCTION ql3.task_attempt_admit_page(text, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.task_attempt_admit_page(text, text, integer) TO ql3_runtime;
