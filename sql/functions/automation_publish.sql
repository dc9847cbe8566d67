CREATE OR REPLACE FUNCTION ql3.automation_publish(p_project_id text, p_package_id text, p_generation integer)
RETURNS TABLE (outcome text, publication_id text, publication_digest text, generation integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  m ql3.package_materialized_revisions;
  v_receipt text;
  v_workflows jsonb;
  v_digest text;
  v_id text;
  v_pub ql3.automation_publications;
  v_now bigint := ql3.now_ms();
BEGIN
  PERFORM ql3.require_role('automation_publish', 'ql3_package_manager');
  PERFORM ql3.check_id(p_project_id, 'project_id');
  PERFORM ql3.check_id(p_package_id, 'package_id');
  SELECT * INTO m FROM ql3.package_materialized_revisions r
   WHERE r.project_id = p_project_id AND r.package_id = p_package_id AND r.generation = p_generation;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101',
      MESSAGE = pg_catalog.format('materialized revision %s/%s generation %s not found', p_project_id, p_package_id, p_generation);
  END IF;
  SELECT r.receipt_digest INTO v_receipt FROM ql3.task_reconciliation_receipts r
   WHERE r.project_id = p_project_id AND r.package_id = p_package_id AND r.generation = p_generation;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101',
      MESSAGE = pg_catalog.format('no task reconciliation receipt for %s/%s generation %s: reconcile before publishing', p_project_id, p_package_id, p_generation);
  END IF;
  -- Same exclusive security boundary as quarantine: starts hold it shared.
  PERFORM ql3.advisory_lock('package', p_project_id || '/' || p_package_id, false);
  -- Bump the boundary row (ql3.security_boundaries): starts whose snapshot predates this change fail
  -- with 40001 at REPEATABLE READ/SERIALIZABLE and retry; a stale snapshot here fails the same way.
  INSERT INTO ql3.security_boundaries AS b (kind, id, version, changed_at_ms)
  VALUES ('package', p_project_id || '/' || p_package_id, 1, ql3.now_ms())
  ON CONFLICT (kind, id) DO UPDATE SET version = b.version + 1, changed_at_ms = EXCLUDED.changed_at_ms;
  SELECT pg_catalog.jsonb_object_agg(w.workflow_key, w.semantic_digest) INTO v_workflows
    FROM ql3.package_revision_workflows w
   WHERE w.project_id = p_project_id AND w.package_id = p_package_id AND w.generation = p_generation;
  v_digest := ql3.domain_digest('qinglong/automation-publication@v1', ql3.canonical_json(pg_catalog.jsonb_build_object(
    'project_id', p_project_id, 'package_id', p_package_id, 'generation', p_generation,
    'installation_id', m.installation_id, 'lock_digest', m.lock_digest, 'revision_digest', m.revision_digest,
    'reconciliation_receipt_digest', v_receipt, 'workflows', v_workflows)::json));
  v_id := 'pub:' || pg_catalog.left(v_digest, 32);
  SELECT * INTO v_pub FROM ql3.automation_publications p WHERE p.publication_id = v_id;
  IF FOUND AND v_pub.status = 'withdrawn' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL203',
      MESSAGE = pg_catalog.format('publication %s was withdrawn; a withdrawn publication is never re-activated (install changed content for a new generation)', v_id);
  END IF;
  IF NOT FOUND THEN
    INSERT INTO ql3.automation_publications (publication_id, publication_digest, project_id, package_id,
      generation, revision_digest, status, published_at_ms)
    VALUES (v_id, v_digest, p_project_id, p_package_id, p_generation, m.revision_digest, 'active', v_now);
  END IF;
  IF EXISTS (SELECT 1 FROM ql3.automation_publication_heads h
              WHERE h.project_id = p_project_id AND h.package_id = p_package_id AND h.publication_id = v_id) THEN
    RETURN QUERY SELECT 'idempotent'::text, v_id, v_digest, p_generation;
    RETURN;
  END IF;
  INSERT INTO ql3.automation_publication_heads AS h (project_id, package_id, publication_id, updated_at_ms)
  VALUES (p_project_id, p_package_id, v_id, v_now)
  ON CONFLICT (project_id, package_id) DO UPDATE SET publication_id = EXCLUDED.publication_id,
                                                     updated_at_ms = EXCLUDED.updated_at_ms;
  RETURN QUERY SELECT 'inserted'::text, v_id, v_digest, p_generation;
END
$fn$;
COMMENT ON FUNCTION ql3.automation_publish(text, text, integer) IS
  'Role ql3_package_manager. Publishes a reconciled materialized revision as an automation publication and makes it the current head of (project, package) (ADR-0223 §1, ADR-0222). Publication digest: SHA-256 under qinglong/automation-publication@v1 of {project, package, generation, installation, lock, revision digest, reconciliation receipt digest, workflow semantic digests}; publication_id = pub:<first 32 hex>. Takes the package security boundary exclusively. Returns (outcome inserted|idempotent, publication_id, publication_digest, generation). Errors: QL101 revision or receipt missing, QL203 publication was withdrawn, QL601 caller not in role.';
REVOKE ALL ON FUNCTION ql3.automation_publish(text, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.automation_publish(text, text, integer) TO ql3_package_manager;
