CREATE OR REPLACE FUNCTION ql3.automation_withdraw(p_publication_id text, p_reason text)
RETURNS TABLE (outcome text, publication_id text, withdrawn_at_ms bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  p ql3.automation_publications;
BEGIN
  PERFORM ql3.require_role('automation_withdraw', 'ql3_package_manager');
  PERFORM ql3.check_id(p_publication_id, 'publication_id');
  IF p_reason IS NULL OR p_reason = '' OR pg_catalog.octet_length(p_reason) > 1024 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'reason: must be 1..1024 bytes';
  END IF;
  SELECT * INTO p FROM ql3.automation_publications a WHERE a.publication_id = p_publication_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('publication %s not found', p_publication_id);
  END IF;
  PERFORM ql3.advisory_lock('package', p.project_id || '/' || p.package_id, false);
  -- Bump the boundary row (ql3.security_boundaries): starts whose snapshot predates this change fail
  -- with 40001 at REPEATABLE READ/SERIALIZABLE and retry; a stale snapshot here fails the same way.
  INSERT INTO ql3.security_boundaries AS b (kind, id, version, changed_at_ms)
  VALUES ('package', p.project_id || '/' || p.package_id, 1, ql3.now_ms())
  ON CONFLICT (kind, id) DO UPDATE SET version = b.version + 1, changed_at_ms = EXCLUDED.changed_at_ms;
  SELECT * INTO p FROM ql3.automation_publications a WHERE a.publication_id = p_publication_id FOR UPDATE;
  IF p.status = 'withdrawn' THEN
    RETURN QUERY SELECT 'idempotent'::text, p.publication_id, p.withdrawn_at_ms;
    RETURN;
  END IF;
  UPDATE ql3.automation_publications a SET status = 'withdrawn', withdrawn_at_ms = ql3.now_ms(),
         withdrawn_reason = p_reason
   WHERE a.publication_id = p_publication_id RETURNING * INTO p;
  RETURN QUERY SELECT 'withdrawn'::text, p.publication_id, p.withdrawn_at_ms;
END
$fn$;
COMMENT ON FUNCTION ql3.automation_withdraw(text, text) IS
  'Role ql3_package_manager. Lifecycle withdrawal active -> withdrawn of an automation publication (never reversed); from then on the start guard refuses new Workflow starts of it (QL301). Running steps finish on their pinned revision. Takes the package security boundary exclusively, so admissions in flight finish first. Returns (outcome withdrawn|idempotent, publication_id, withdrawn_at_ms). Errors: QL001, QL101 unknown publication, QL601.';
REVOKE ALL ON FUNCTION ql3.automation_withdraw(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.automation_withdraw(text, text) TO ql3_package_manager;
