CREATE OR REPLACE FUNCTION ql3.lease_acquire(p_worker_id text, p_executor_type text, p_max integer, p_lease_ms integer)
RETURNS TABLE (attempt_id text, lease_token text, lease_expires_at_ms bigint, run_id text, step_run_id text,
               step_key text, attempt integer, execution_revision jsonb)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  a record;
  v_token text;
  v_now bigint;
  v_rev ql3.task_execution_revisions;
BEGIN
  PERFORM ql3.require_role('lease_acquire', 'ql3_worker_ingress');
  PERFORM ql3.check_id(p_worker_id, 'worker_id', 128);
  IF p_executor_type IS NULL OR p_executor_type NOT IN ('local_process', 'remote_worker') THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'executor_type: must be local_process or remote_worker';
  END IF;
  IF p_max IS NULL OR p_max < 1 OR p_max > 64 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'max: must be 1..64';
  END IF;
  IF p_lease_ms IS NULL OR p_lease_ms < 1000 OR p_lease_ms > 3600000 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'lease_ms: must be 1000..3600000';
  END IF;
  -- An ordered scan of the partial index run_attempts_dispatch_idx that stops after p_max rows:
  -- the Run and the StepRun are reached per row through LATERAL subqueries that OFFSET 0 keeps
  -- out of the join order, so no statistics can turn this into a hash join and a sort of the
  -- whole backlog (tests/test_backlog_plans.py).
  FOR a IN
    SELECT ra.id, ra.run_id, ra.step_run_id, ra.attempt, ra.lease_count, ra.project_id, ra.runtime_task_id,
           ra.task_revision, ra.execution_digest, s.step_key
      FROM ql3.run_attempts ra
      CROSS JOIN LATERAL (SELECT 1 FROM ql3.runs r
                           WHERE r.id = ra.run_id AND r.status = 'running' AND r.cancel_requested_at_ms IS NULL
                          OFFSET 0) r
      CROSS JOIN LATERAL (SELECT x.step_key FROM ql3.step_runs x WHERE x.id = ra.step_run_id OFFSET 0) s
     WHERE ra.status = 'claimed' AND NOT ra.lease_active AND ra.executor_type = p_executor_type
     ORDER BY ra.created_at_ms, ra.id
     LIMIT p_max
     FOR UPDATE OF ra SKIP LOCKED
  LOOP
    SELECT * INTO v_rev FROM ql3.task_execution_revisions t
     WHERE t.project_id = a.project_id AND t.task_id = a.runtime_task_id AND t.task_revision = a.task_revision;
    v_rev := ql3.attempt_revision_verify(v_rev);
    IF v_rev.content_digest <> a.execution_digest THEN
      RAISE EXCEPTION USING ERRCODE = 'QL501', MESSAGE = pg_catalog.format('attempt %s: pinned execution revision does not verify', a.id);
    END IF;
    v_token := pg_catalog.replace(pg_catalog.gen_random_uuid()::text || pg_catalog.gen_random_uuid()::text, '-', '');
    v_now := ql3.now_ms();
    UPDATE ql3.run_attempts ra SET lease_active = true, lease_expires_at_ms = v_now + p_lease_ms,
           lease_count = ra.lease_count + 1, worker_id = p_worker_id
     WHERE ra.id = a.id;
    INSERT INTO ql3.run_dispatch_leases (attempt_id, lease_no, token_sha256, worker_id, holder_login, status, leased_at_ms, expires_at_ms)
    VALUES (a.id, a.lease_count + 1, ql3.lease_token_digest(v_token), p_worker_id, session_user, 'leased', v_now, v_now + p_lease_ms);
    attempt_id := a.id; lease_token := v_token; lease_expires_at_ms := v_now + p_lease_ms;
    run_id := a.run_id; step_run_id := a.step_run_id; step_key := a.step_key; attempt := a.attempt;
    execution_revision := pg_catalog.jsonb_build_object(
      'project_id', v_rev.project_id, 'task_id', v_rev.task_id, 'task_revision', v_rev.task_revision,
      'executor_type', v_rev.executor_type, 'execution_template', v_rev.execution_template,
      'context_ref', v_rev.context_ref, 'content_digest', v_rev.content_digest);
    RETURN NEXT;
  END LOOP;
END
$fn$;
COMMENT ON FUNCTION ql3.lease_acquire(text, text, integer, integer) IS
  'Role ql3_worker_ingress. Leases up to p_max (1..64) claimed, unleased attempts of p_executor_type (local_process|remote_worker) of running Runs without cancel request, oldest first, with FOR UPDATE SKIP LOCKED (no attempt is leased twice). p_lease_ms 1000..3600000. Each row returns the lease token once (only its SHA-256 is stored) and the pinned, verified execution revision: (attempt_id, lease_token, lease_expires_at_ms, run_id, step_run_id, step_key, attempt, execution_revision jsonb {project_id, task_id, task_revision, executor_type, execution_template, context_ref, content_digest}). The parent Run is not touched. Errors: QL001, QL002 max out of range, QL501 pinned revision fails verification, QL601. Source: ADR-0227 §4.';
REVOKE ALL ON FUNCTION ql3.lease_acquire(text, text, integer, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.lease_acquire(text, text, integer, integer) TO ql3_worker_ingress;
