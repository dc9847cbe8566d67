CREATE OR REPLACE FUNCTION ql3.task_reconciliation_record(p_project_id text, p_package_id text, p_generation integer)
RETURNS TABLE (outcome text, receipt_digest text, items jsonb)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  m ql3.package_materialized_revisions;
  t record;
  w record;
  v_items jsonb := '[]'::jsonb;
  v_task_id text; v_def text; v_rev text; v_ctx text;
  v_receipt text;
BEGIN
  PERFORM ql3.require_role('task_reconciliation_record', 'ql3_package_manager');
  PERFORM ql3.check_id(p_project_id, 'project_id');
  PERFORM ql3.check_id(p_package_id, 'package_id');
  SELECT * INTO m FROM ql3.package_materialized_revisions r
   WHERE r.project_id = p_project_id AND r.package_id = p_package_id AND r.generation = p_generation;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101',
      MESSAGE = pg_catalog.format('materialized revision %s/%s generation %s not found', p_project_id, p_package_id, p_generation);
  END IF;
  PERFORM ql3.advisory_lock('package-install', p_project_id || '/' || p_package_id);
  FOR t IN SELECT * FROM ql3.package_revision_tasks x
            WHERE x.project_id = p_project_id AND x.package_id = p_package_id AND x.generation = p_generation
            ORDER BY x.task_key COLLATE "C" LOOP
    v_task_id := 'pkg:' || p_package_id || ':' || t.task_key;
    v_def := ql3.domain_digest('qinglong/task-definition@v1', ql3.canonical_json(pg_catalog.jsonb_build_object(
      'task_id', v_task_id, 'source_digest', t.source_digest, 'executor_type', t.executor_type,
      'execution_template', t.execution_template)::json));
    v_rev := 'qltd:v1:' || p_generation || ':' || v_def;
    v_ctx := 'qlpkg:' || p_project_id || '/' || p_package_id || '@' || p_generation;
    SELECT w2.* INTO w FROM ql3.task_revision_write(p_project_id, v_task_id, v_rev, t.executor_type,
                                                    t.execution_template, v_ctx) w2;
    v_items := v_items || pg_catalog.jsonb_build_array(pg_catalog.jsonb_build_object(
      'task_key', t.task_key, 'runtime_task_id', v_task_id, 'task_revision', v_rev,
      'definition_digest', v_def, 'source_digest', t.source_digest, 'executor_type', t.executor_type,
      'execution_digest', w.content_digest));
  END LOOP;
  v_receipt := ql3.domain_digest('qinglong/task-reconciliation-receipt@v1', ql3.canonical_json(pg_catalog.jsonb_build_object(
    'project_id', p_project_id, 'package_id', p_package_id, 'generation', p_generation,
    'installation_id', m.installation_id, 'lock_digest', m.lock_digest, 'revision_digest', m.revision_digest,
    'items', v_items)::json));
  IF EXISTS (SELECT 1 FROM ql3.task_reconciliation_receipts r WHERE r.receipt_digest = v_receipt) THEN
    RETURN QUERY SELECT 'idempotent'::text, v_receipt, v_items;
    RETURN;
  END IF;
  IF EXISTS (SELECT 1 FROM ql3.task_reconciliation_receipts r
              WHERE r.project_id = p_project_id AND r.package_id = p_package_id AND r.generation = p_generation) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL201',
      MESSAGE = pg_catalog.format('a different reconciliation receipt exists for %s/%s generation %s', p_project_id, p_package_id, p_generation);
  END IF;
  INSERT INTO ql3.task_reconciliation_receipts (receipt_digest, project_id, package_id, generation,
    installation_id, lock_digest, revision_digest, created_at_ms)
  VALUES (v_receipt, p_project_id, p_package_id, p_generation, m.installation_id, m.lock_digest,
          m.revision_digest, ql3.now_ms());
  INSERT INTO ql3.task_reconciliation_items (receipt_digest, task_key, runtime_task_id, task_revision,
    definition_digest, source_digest, executor_type, execution_digest)
  SELECT v_receipt, i ->> 'task_key', i ->> 'runtime_task_id', i ->> 'task_revision', i ->> 'definition_digest',
         i ->> 'source_digest', i ->> 'executor_type', i ->> 'execution_digest'
    FROM pg_catalog.jsonb_array_elements(v_items) i;
  RETURN QUERY SELECT 'inserted'::text, v_receipt, v_items;
END
$fn$;
COMMENT ON FUNCTION ql3.task_reconciliation_record(text, text, integer) IS
  'Role ql3_package_manager. Task reconciliation for one materialized revision (ADR-0227 background): derives, in SQL, every Task''s runtime identity pkg:<package>:<task>, its TaskDefinition digest (qinglong/task-definition@v1) and revision qltd:v1:<generation>:<definition digest>, writes the immutable Task Execution Revisions through the ADR-0023 write path (context_ref qlpkg:<project>/<package>@<generation>), and records the immutable receipt (digest under qinglong/task-reconciliation-receipt@v1) with its items. Returns (outcome inserted|idempotent, receipt_digest hex, items jsonb array). Errors: QL101 revision not found, QL201 conflicting receipt or revision, QL601 caller not in role.';
REVOKE ALL ON FUNCTION ql3.task_reconciliation_record(text, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.task_reconciliation_record(text, text, integer) TO ql3_package_manager;
