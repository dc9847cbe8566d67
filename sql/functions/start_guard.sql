CREATE OR REPLACE FUNCTION ql3.start_guard(p_project_id text, p_package_id text, p_publisher_id text,
                                           p_publication_id text) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  v_status text;
  v_head text;
  v_rows integer;
BEGIN
  -- Caller holds the package and publisher security boundaries (shared advisory locks). Lock their
  -- boundary rows FOR SHARE as well: a quarantine, revocation, publication or withdrawal bumps the
  -- row under the exclusive lock, so when this transaction's snapshot predates such a change (it
  -- was taken before the advisory lock was granted) REPEATABLE READ / SERIALIZABLE fail here with
  -- 40001 and the shell retries with a fresh snapshot, instead of admitting on stale facts.
  -- (A read-only transaction, e.g. ql3.workflow_admission_snapshot on a standby, starts nothing: no lock.)
  IF pg_catalog.current_setting('transaction_read_only') = 'off' THEN
    PERFORM 1 FROM ql3.security_boundaries b
     WHERE (b.kind = 'package' AND b.id = p_project_id || '/' || p_package_id)
        OR (b.kind = 'publisher' AND b.id = p_publisher_id)
       FOR SHARE;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    IF v_rows <> 2 THEN
      RAISE EXCEPTION USING ERRCODE = 'QL501',
        MESSAGE = pg_catalog.format('start guard: security boundary rows of package %s/%s and publisher %s are missing',
                                    p_project_id, p_package_id, p_publisher_id);
    END IF;
  END IF;
  IF p_publication_id IS NOT NULL THEN
    SELECT p.status INTO v_status FROM ql3.automation_publications p WHERE p.publication_id = p_publication_id;
    IF NOT FOUND THEN
      RAISE EXCEPTION USING ERRCODE = 'QL301', MESSAGE = pg_catalog.format('start guard: publication %s does not exist', p_publication_id);
    END IF;
    IF v_status <> 'active' THEN
      RAISE EXCEPTION USING ERRCODE = 'QL301', MESSAGE = pg_catalog.format('start guard: publication %s is withdrawn', p_publication_id);
    END IF;
    SELECT h.publication_id INTO v_head FROM ql3.automation_publication_heads h
     WHERE h.project_id = p_project_id AND h.package_id = p_package_id;
    IF v_head IS DISTINCT FROM p_publication_id THEN
      RAISE EXCEPTION USING ERRCODE = 'QL301',
        MESSAGE = pg_catalog.format('start guard: publication %s is not the current publication of %s/%s (current: %s)',
                                    p_publication_id, p_project_id, p_package_id, COALESCE(v_head, 'none'));
    END IF;
  END IF;
  IF EXISTS (SELECT 1 FROM ql3.package_quarantines q WHERE q.project_id = p_project_id AND q.package_id = p_package_id) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL301', MESSAGE = pg_catalog.format('start guard: package %s/%s is quarantined', p_project_id, p_package_id);
  END IF;
  IF EXISTS (SELECT 1 FROM ql3.publisher_revocations r WHERE r.publisher_id = p_publisher_id) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL301', MESSAGE = pg_catalog.format('start guard: publisher %s is revoked', p_publisher_id);
  END IF;
END
$fn$;
COMMENT ON FUNCTION ql3.start_guard(text, text, text, text) IS
  'Internal (owner only; caller holds the package and publisher boundaries shared). The publication start guard (ADR-0223 §3): locks the package and publisher rows of ql3.security_boundaries FOR SHARE (40001 at REPEATABLE READ/SERIALIZABLE when a boundary changed after the caller''s snapshot: retry), then raises QL301 when the publication (if given) is missing, withdrawn or not the current head of (project, package), when the package is quarantined, or when its publisher is revoked. With p_publication_id NULL only quarantine and revocation are checked (Task Attempt admission). QL501 when a boundary row is missing.';
REVOKE ALL ON FUNCTION ql3.start_guard(text, text, text, text) FROM PUBLIC;
