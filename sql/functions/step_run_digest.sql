CREATE OR REPLACE FUNCTION ql3.step_run_digest(
  p_run_id text, p_step_run_id text, p_step_key text, p_task_key text, p_status text,
  p_version integer, p_attempt_count integer, p_ready_at_ms bigint) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  -- The canonical (RFC 8785) text of this fixed-shape object is written out directly: its keys
  -- are constant ASCII in code-unit order, strings are escaped by to_json (the JCS escapes for
  -- valid text), integers print as integers. Byte-identical to
  -- ql3.canonical_json(json_build_object(...)) (tests/test_attempt_digests.py checks both), at a
  -- fraction of the cost: every StepRun transition on the step hot path computes it. (plpgsql:
  -- a non-inlined SQL function would be planned again on every call.)
  RETURN pg_catalog.encode(pg_catalog.sha256(
           pg_catalog.convert_to('qinglong/step-run-digest@v1', 'UTF8') || '\x00'::bytea ||
           pg_catalog.convert_to(
             '{"attempt_count":' || COALESCE(p_attempt_count::text, 'null')
             || ',"ready_at_ms":' || COALESCE(p_ready_at_ms::text, 'null')
             || ',"run_id":' || COALESCE(pg_catalog.to_json(p_run_id)::text, 'null')
             || ',"status":' || COALESCE(pg_catalog.to_json(p_status)::text, 'null')
             || ',"step_key":' || COALESCE(pg_catalog.to_json(p_step_key)::text, 'null')
             || ',"step_run_id":' || COALESCE(pg_catalog.to_json(p_step_run_id)::text, 'null')
             || ',"task_key":' || COALESCE(pg_catalog.to_json(p_task_key)::text, 'null')
             || ',"version":' || COALESCE(p_version::text, 'null') || '}', 'UTF8')), 'hex');
END
$fn$;
COMMENT ON FUNCTION ql3.step_run_digest(text, text, text, text, text, integer, integer, bigint) IS
  'Internal (owner only). Canonical StepRun snapshot digest: lowercase hex SHA-256 under domain qinglong/step-run-digest@v1 of {run_id, step_run_id, step_key, task_key, status, version, attempt_count, ready_at_ms}, its RFC 8785 text written out directly (byte-identical to ql3.canonical_json of the same object). Source: DESIGN §6, ADR-0227 §1.';
REVOKE ALL ON FUNCTION ql3.step_run_digest(text, text, text, text, text, integer, integer, bigint) FROM PUBLIC;
