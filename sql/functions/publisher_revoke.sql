CREATE OR REPLACE FUNCTION ql3.publisher_revoke(p_publisher_id text, p_reason text, p_actor text)
RETURNS TABLE (outcome text, revoked_at_ms bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  v_at bigint;
BEGIN
  PERFORM ql3.require_role('publisher_revoke', 'ql3_package_manager');
  PERFORM ql3.check_id(p_publisher_id, 'publisher_id');
  IF p_reason IS NULL OR p_reason = '' OR pg_catalog.octet_length(p_reason) > 1024 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'reason: must be 1..1024 bytes';
  END IF;
  IF p_actor IS NULL OR p_actor = '' OR pg_catalog.octet_length(p_actor) > 128 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'actor: must be 1..128 bytes';
  END IF;
  PERFORM ql3.advisory_lock('publisher', p_publisher_id, false);
  -- Bump the boundary row (ql3.security_boundaries): starts whose snapshot predates this change fail
  -- with 40001 at REPEATABLE READ/SERIALIZABLE and retry; a stale snapshot here fails the same way.
  INSERT INTO ql3.security_boundaries AS b (kind, id, version, changed_at_ms)
  VALUES ('publisher', p_publisher_id, 1, ql3.now_ms())
  ON CONFLICT (kind, id) DO UPDATE SET version = b.version + 1, changed_at_ms = EXCLUDED.changed_at_ms;
  SELECT r.revoked_at_ms INTO v_at FROM ql3.publisher_revocations r WHERE r.publisher_id = p_publisher_id;
  IF FOUND THEN
    RETURN QUERY SELECT 'idempotent'::text, v_at;
    RETURN;
  END IF;
  v_at := ql3.now_ms();
  INSERT INTO ql3.publisher_revocations (publisher_id, revoked_at_ms, reason, actor)
  VALUES (p_publisher_id, v_at, p_reason, p_actor);
  RETURN QUERY SELECT 'inserted'::text, v_at;
END
$fn$;
COMMENT ON FUNCTION ql3.publisher_revoke(text, text, text) IS
  'Role ql3_package_manager. Revokes a publisher (append-only): from commit on, Workflow starts and new Task Attempt admissions of every package it published are refused with QL301; running steps finish. Takes the publisher security boundary exclusively (starts hold it shared): a revocation that commits first blocks every later admission, an admission in flight makes it wait. Returns (outcome inserted|idempotent, revoked_at_ms). Errors: QL001, QL601.';
REVOKE ALL ON FUNCTION ql3.publisher_revoke(text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.publisher_revoke(text, text, text) TO ql3_package_manager;
