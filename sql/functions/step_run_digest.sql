CREATE OR REPLACE FUNCTION ql3.step_run_digest(
  p_run_id text, p_step_run_id text, p_step_key text, p_task_key text, p_status text,
  p_version integer, p_attempt_count integer, p_ready_at_ms bigint) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
  SELECT ql3.domain_digest('qinglong/step-run-digest@v1', ql3.canonical_json(pg_catalog.json_build_object(
    'run_id', p_run_id, 'step_run_id', p_step_run_id, 'step_key', p_step_key, 'task_key', p_task_key,
    'status', p_status, 'version', p_version, 'attempt_count', p_attempt_count,
    'ready_at_ms', p_ready_at_ms)))
$fn$;
COMMENT ON FUNCTION ql3.step_run_digest(text, text, text, text, text, integer, integer, bigint) IS
  'Internal (owner only). Canonical StepRun snapshot digest: lowercase hex SHA-256 under domain qinglong/step-run-digest@v1 of {run_id, step_run_id, step_key, task_key, status, version, attempt_count, ready_at_ms}. Source: DESIGN §6, ADR-0227 §1.';
REVOKE ALL ON FUNCTION ql3.step_run_digest(text, text, text, text, text, integer, integer, bigint) FROM PUBLIC;
