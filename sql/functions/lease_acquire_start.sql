CREATE OR REPLACE FUNCTION ql3.lease_acquire_start(p_worker_id text, p_executor_type text, p_max integer, p_lease_ms integer)
RETURNS TABLE (attempt_id text, lease_token text, lease_expires_at_ms bigint, run_id text, step_run_id text,
               step_key text, attempt integer, execution_revision jsonb, status text, deadline_at_ms bigint,
               started_at_ms bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  l record;
  st record;
BEGIN
  PERFORM ql3.require_role('lease_acquire_start', 'ql3_worker_ingress');
  -- ql3.lease_acquire (SKIP LOCKED, token returned once, only its SHA-256 stored), then the start
  -- barrier of ql3.attempt_start for every leased attempt whose Run and attempt locks are free
  -- right now (try-locks: a busy Run never makes this call wait while it holds attempt rows).
  FOR l IN SELECT * FROM ql3.lease_acquire(p_worker_id, p_executor_type, p_max, p_lease_ms) x
            ORDER BY x.run_id, x.attempt_id LOOP
    attempt_id := l.attempt_id; lease_token := l.lease_token; lease_expires_at_ms := l.lease_expires_at_ms;
    run_id := l.run_id; step_run_id := l.step_run_id; step_key := l.step_key; attempt := l.attempt;
    execution_revision := l.execution_revision;
    IF pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtextextended('ql3-run:' || l.run_id, 0))
       AND pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtextextended('ql3-attempt:' || l.attempt_id, 0)) THEN
      SELECT * INTO st FROM ql3.attempt_start(l.attempt_id, l.lease_token) x;
      status := st.status; deadline_at_ms := st.deadline_at_ms; started_at_ms := st.started_at_ms;
    ELSE
      status := 'claimed'; deadline_at_ms := NULL; started_at_ms := NULL;
    END IF;
    RETURN NEXT;
  END LOOP;
END
$fn$;
COMMENT ON FUNCTION ql3.lease_acquire_start(text, text, integer, integer) IS
  'Role ql3_worker_ingress. Lease and start barrier in one transaction (extension of ADR-0227 §4, docs/api-notes.md): ql3.lease_acquire(p_worker_id, p_executor_type, p_max 1..64, p_lease_ms 1000..3600000), then ql3.attempt_start for every leased attempt whose Run and attempt locks are free at once (try-locks, never waiting while holding attempt rows). Each row: the lease (attempt_id, lease_token returned once, lease_expires_at_ms, run_id, step_run_id, step_key, attempt, execution_revision) and status starting (deadline_at_ms = database time + timeout_ms, started_at_ms) or claimed (locks were busy: call ql3.attempt_start, or give it back with ql3.lease_release). Use it only when the process is spawned right after the call: a started attempt is past the start barrier, so a worker that dies before spawning leaves it for recovery with not_running evidence (ql3.worker_session_reset), never a silent retry. Errors: those of ql3.lease_acquire and ql3.attempt_start (QL001, QL002, QL202, QL203, QL401, QL501, QL601).';
REVOKE ALL ON FUNCTION ql3.lease_acquire_start(text, text, integer, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.lease_acquire_start(text, text, integer, integer) TO ql3_worker_ingress;
