CREATE OR REPLACE FUNCTION ql3.run_inspect(p_run_id text) RETURNS jsonb
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  r ql3.runs;
BEGIN
  PERFORM ql3.require_role('run_inspect', 'ql3_admin', 'ql3_runtime');
  PERFORM ql3.check_id(p_run_id, 'run_id');
  SELECT * INTO r FROM ql3.runs WHERE id = p_run_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('run %s not found', p_run_id);
  END IF;
  RETURN pg_catalog.jsonb_build_object(
    'run', pg_catalog.jsonb_build_object('id', r.id, 'project_id', r.project_id, 'package_id', r.package_id,
      'workflow', r.task_id, 'task_revision', r.task_revision, 'publication_id', r.publication_id,
      'generation', r.generation, 'plan_digest', r.plan_digest, 'status', r.status, 'version', r.version,
      'event_sequence', r.event_sequence, 'last_attempt', r.last_attempt, 'steps_total', r.steps_total,
      'cancel_requested_at_ms', r.cancel_requested_at_ms, 'cancel_reason', r.cancel_reason,
      'cancel_actor', r.cancel_actor, 'created_at_ms', r.created_at_ms, 'ended_at_ms', r.ended_at_ms),
    'steps', COALESCE((SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
        'step_run_id', s.id, 'step_key', s.step_key, 'task_key', s.task_key, 'status', s.status,
        'version', s.version, 'attempt_count', s.attempt_count, 'needs', pg_catalog.to_jsonb(s.needs),
        'digest', s.digest, 'ready_at_ms', s.ready_at_ms, 'started_at_ms', s.started_at_ms,
        'ended_at_ms', s.ended_at_ms, 'current_attempt_id', s.current_attempt_id) ORDER BY s.step_key)
      FROM ql3.step_runs s WHERE s.run_id = p_run_id), '[]'::jsonb),
    'attempts', COALESCE((SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
        'attempt_id', a.id, 'attempt', a.attempt, 'step_run_id', a.step_run_id, 'step_key', s.step_key,
        'step_run_version', a.step_run_version, 'status', a.status, 'executor_type', a.executor_type,
        'task_id', a.runtime_task_id, 'task_revision', a.task_revision, 'worker_id', a.worker_id,
        'lease_active', a.lease_active, 'lease_expires_at_ms', a.lease_expires_at_ms,
        'deadline_at_ms', a.deadline_at_ms, 'stop_reason', a.stop_reason,
        'created_at_ms', a.created_at_ms, 'started_at_ms', a.started_at_ms, 'running_at_ms', a.running_at_ms,
        'ended_at_ms', a.ended_at_ms, 'outcome', c.outcome, 'exit_code', c.exit_code,
        'detail', c.detail,
        'recovery', CASE WHEN rc.attempt_id IS NULL THEN NULL ELSE pg_catalog.jsonb_build_object(
          'status', rc.status, 'resolution', rc.resolution, 'failure_count', rc.failure_count,
          'last_evidence', rc.last_evidence, 'evidence_source', rc.evidence_source,
          'claimed_by', rc.claimed_by, 'claim_expires_at_ms', rc.claim_expires_at_ms,
          'next_claim_at_ms', rc.next_claim_at_ms, 'updated_at_ms', rc.updated_at_ms) END) ORDER BY a.attempt)
      FROM ql3.run_attempts a JOIN ql3.step_runs s ON s.id = a.step_run_id
      LEFT JOIN ql3.run_attempt_completions c ON c.attempt_id = a.id
      LEFT JOIN ql3.run_recovery_controls rc ON rc.attempt_id = a.id
      WHERE a.run_id = p_run_id), '[]'::jsonb));
END
$fn$;
COMMENT ON FUNCTION ql3.run_inspect(text) IS
  'Roles ql3_admin and ql3_runtime. Read-only view of one Run: jsonb {run {id, status, version, event_sequence, cancel fields, times in ms, ...}, steps [{step_run_id, step_key, status, version, attempt_count, needs, digest, times}], attempts [{attempt_id, attempt, step_key, status, worker_id, lease and deadline times in ms, stop_reason, outcome, exit_code, detail, recovery: null or {status available|claimed|resolved|retry|manual, resolution, failure_count, last_evidence, evidence_source, claimed_by, claim_expires_at_ms, next_claim_at_ms, updated_at_ms}}]}. No lease or claim tokens or their digests are returned. Errors: QL001 bad id, QL101 unknown run, QL601.';
REVOKE ALL ON FUNCTION ql3.run_inspect(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.run_inspect(text) TO ql3_admin, ql3_runtime;
