CREATE OR REPLACE FUNCTION ql3.package_quarantine(p_project_id text, p_package_id text, p_reason text, p_actor text)
RETURNS TABLE (outcome text, quarantined_at_ms bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  v_at bigint;
BEGIN
  PERFORM ql3.require_role('package_quarantine', 'ql3_package_manager');
  PERFORM ql3.check_id(p_project_id, 'project_id');
  PERFORM ql3.check_id(p_package_id, 'package_id');
  IF p_reason IS NULL OR p_reason = '' OR pg_catalog.octet_length(p_reason) > 1024 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'reason: must be 1..1024 bytes';
  END IF;
  IF p_actor IS NULL OR p_actor = '' OR pg_catalog.octet_length(p_actor) > 128 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'actor: must be 1..128 bytes';
  END IF;
  -- Exclusive security boundary: waits for admissions in flight, blocks later ones.
  PERFORM ql3.advisory_lock('package', p_project_id || '/' || p_package_id, false);
  -- Bump the boundary row (ql3.security_boundaries): starts whose snapshot predates this change fail
  -- with 40001 at REPEATABLE READ/SERIALIZABLE and retry; a stale snapshot here fails the same way.
  INSERT INTO ql3.security_boundaries AS b (kind, id, version, changed_at_ms)
  VALUES ('package', p_project_id || '/' || p_package_id, 1, ql3.now_ms())
  ON CONFLICT (kind, id) DO UPDATE SET version = b.version + 1, changed_at_ms = EXCLUDED.changed_at_ms;
  SELECT q.quarantined_at_ms INTO v_at FROM ql3.package_quarantines q
   WHERE q.project_id = p_project_id AND q.package_id = p_package_id;
  IF FOUND THEN
    RETURN QUERY SELECT 'idempotent'::text, v_at;
    RETURN;
  END IF;
  v_at := ql3.now_ms();
  INSERT INTO ql3.package_quarantines (project_id, package_id, quarantined_at_ms, reason, actor)
  VALUES (p_project_id, p_package_id, v_at, p_reason, p_actor);
  RETURN QUERY SELECT 'inserted'::text, v_at;
END
$fn$;
COMMENT ON FUNCTION ql3.package_quarantine(text, text, text, text) IS
  'Role ql3_package_manager. Quarantines a package (append-only; v1 has no lift): from commit on, every Workflow start and every new Task Attempt admission of the package''s Runs is refused with QL301; running steps finish on their pinned revision. Takes the package security boundary exclusively (starts hold it shared), so an admission in flight makes this wait and is then visible. Returns (outcome inserted|idempotent, quarantined_at_ms). Errors: QL001, QL601.';
REVOKE ALL ON FUNCTION ql3.package_quarantine(text, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.package_quarantine(text, text, text, text) TO ql3_package_manager;
