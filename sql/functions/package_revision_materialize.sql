CREATE OR REPLACE FUNCTION ql3.package_revision_materialize(p_document json)
RETURNS TABLE (outcome text, project_id text, package_id text, generation integer,
               revision_digest text, lock_digest text, installation_id text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_column
DECLARE
  d jsonb;
  v_project text; v_package text; v_version text; v_publisher text; v_installation text;
  v_tasks jsonb := '{}'::jsonb; v_workflows jsonb := '{}'::jsonb;
  k text; t jsonb; w jsonb; sk text; st jsonb; v_steps jsonb; v_needs jsonb; v_dag jsonb;
  v_norm jsonb; v_rev text; v_lock text; v_gen integer; v_now bigint;
  v_existing record;
BEGIN
  PERFORM ql3.require_role('package_revision_materialize', 'ql3_package_manager');
  IF p_document IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'document: must not be null';
  END IF;
  IF pg_catalog.octet_length(p_document::text) > 1048576 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'document: larger than 1 MiB';
  END IF;
  PERFORM ql3.canonical_json(p_document);  -- duplicate keys, floats, bad unicode -> QL001
  d := p_document::jsonb;
  PERFORM ql3.json_require_keys(d, 'document',
    ARRAY['schema', 'project_id', 'package_id', 'package_version', 'publisher_id', 'installation_id', 'tasks', 'workflows']);
  IF d ->> 'schema' IS DISTINCT FROM 'qinglong/package-materialized-revision@v1' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'document.schema: must be qinglong/package-materialized-revision@v1';
  END IF;
  v_project := ql3.check_id(ql3.json_text(d, 'project_id', 'document', 36), 'document.project_id');
  v_package := ql3.check_id(ql3.json_text(d, 'package_id', 'document', 36), 'document.package_id');
  IF pg_catalog.strpos(v_package, ':') > 0 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'document.package_id: must not contain '':'' (runtime Task ids are pkg:<package>:<task>)';
  END IF;
  v_version := ql3.json_text(d, 'package_version', 'document', 64);
  v_publisher := ql3.check_id(ql3.json_text(d, 'publisher_id', 'document', 36), 'document.publisher_id');
  v_installation := ql3.check_id(ql3.json_text(d, 'installation_id', 'document', 36), 'document.installation_id');
  IF pg_catalog.jsonb_typeof(d -> 'tasks') <> 'object' OR d -> 'tasks' = '{}'::jsonb THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'document.tasks: must be a non-empty object';
  END IF;
  IF (SELECT pg_catalog.count(*) FROM pg_catalog.jsonb_object_keys(d -> 'tasks')) > 256 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'document.tasks: more than 256 tasks';
  END IF;
  FOR k, t IN SELECT * FROM pg_catalog.jsonb_each(d -> 'tasks') LOOP
    PERFORM ql3.check_id(k, 'document.tasks key');
    PERFORM ql3.json_require_keys(t, 'document.tasks.' || k, ARRAY['enabled', 'executor_type', 'execution_template']);
    IF pg_catalog.jsonb_typeof(t -> 'enabled') <> 'boolean' THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('document.tasks.%s.enabled: must be a boolean', k);
    END IF;
    IF NOT (t ->> 'executor_type' = ANY (ARRAY['local_process', 'remote_worker'])) THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001',
        MESSAGE = pg_catalog.format('document.tasks.%s.executor_type: must be local_process or remote_worker', k);
    END IF;
    v_tasks := v_tasks || pg_catalog.jsonb_build_object(k, pg_catalog.jsonb_build_object(
      'enabled', t -> 'enabled', 'executor_type', t -> 'executor_type',
      'execution_template', ql3.execution_template_normalize(t -> 'execution_template')));
  END LOOP;
  IF pg_catalog.jsonb_typeof(d -> 'workflows') <> 'object' OR d -> 'workflows' = '{}'::jsonb THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'document.workflows: must be a non-empty object';
  END IF;
  FOR k, w IN SELECT * FROM pg_catalog.jsonb_each(d -> 'workflows') LOOP
    PERFORM ql3.check_id(k, 'document.workflows key');
    PERFORM ql3.json_require_keys(w, 'document.workflows.' || k, ARRAY['enabled', 'steps']);
    IF pg_catalog.jsonb_typeof(w -> 'enabled') <> 'boolean' THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('document.workflows.%s.enabled: must be a boolean', k);
    END IF;
    IF pg_catalog.jsonb_typeof(w -> 'steps') <> 'object' OR w -> 'steps' = '{}'::jsonb THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('document.workflows.%s.steps: must be a non-empty object', k);
    END IF;
    IF (SELECT pg_catalog.count(*) FROM pg_catalog.jsonb_object_keys(w -> 'steps')) > 128 THEN
      RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = pg_catalog.format('document.workflows.%s.steps: more than 128 steps', k);
    END IF;
    v_steps := '{}'::jsonb; v_dag := '{}'::jsonb;
    FOR sk, st IN SELECT * FROM pg_catalog.jsonb_each(w -> 'steps') LOOP
      PERFORM ql3.check_id(sk, pg_catalog.format('document.workflows.%s.steps key', k), 64);
      PERFORM ql3.json_require_keys(st, pg_catalog.format('document.workflows.%s.steps.%s', k, sk), ARRAY['task', 'needs']);
      IF NOT (v_tasks ? (st ->> 'task')) OR pg_catalog.jsonb_typeof(st -> 'task') <> 'string' THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001',
          MESSAGE = pg_catalog.format('document.workflows.%s.steps.%s.task: names no task of this package', k, sk);
      END IF;
      IF pg_catalog.jsonb_typeof(st -> 'needs') <> 'array'
         OR EXISTS (SELECT 1 FROM pg_catalog.jsonb_array_elements(st -> 'needs') x WHERE pg_catalog.jsonb_typeof(x) <> 'string')
         OR (SELECT pg_catalog.count(*) <> pg_catalog.count(DISTINCT x) FROM pg_catalog.jsonb_array_elements_text(st -> 'needs') x) THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001',
          MESSAGE = pg_catalog.format('document.workflows.%s.steps.%s.needs: must be an array of distinct step keys', k, sk);
      END IF;
      SELECT COALESCE(pg_catalog.jsonb_agg(x ORDER BY x COLLATE "C"), '[]'::jsonb) INTO v_needs
        FROM pg_catalog.jsonb_array_elements_text(st -> 'needs') x;
      v_steps := v_steps || pg_catalog.jsonb_build_object(sk, pg_catalog.jsonb_build_object('task', st -> 'task', 'needs', v_needs));
      v_dag := v_dag || pg_catalog.jsonb_build_object(sk, v_needs);
    END LOOP;
    PERFORM ql3.dag_check(v_dag, 'document.workflows.' || k || '.steps');
    v_workflows := v_workflows || pg_catalog.jsonb_build_object(k, pg_catalog.jsonb_build_object('enabled', w -> 'enabled', 'steps', v_steps));
  END LOOP;

  v_norm := pg_catalog.jsonb_build_object('schema', 'qinglong/package-materialized-revision@v1',
    'project_id', v_project, 'package_id', v_package, 'package_version', v_version,
    'publisher_id', v_publisher, 'installation_id', v_installation,
    'tasks', v_tasks, 'workflows', v_workflows);
  v_rev := ql3.domain_digest('qinglong/package-materialized-revision@v1', ql3.canonical_json(v_norm::json));
  v_lock := ql3.domain_digest('qinglong/package-lock@v1', ql3.canonical_json(pg_catalog.jsonb_build_object(
    'package_id', v_package, 'package_version', v_version, 'publisher_id', v_publisher,
    'tasks', v_tasks, 'workflows', v_workflows)::json));

  PERFORM ql3.advisory_lock('package-install', v_project || '/' || v_package);
  SELECT r.generation, r.lock_digest, r.installation_id INTO v_existing
    FROM ql3.package_materialized_revisions r
   WHERE r.project_id = v_project AND r.package_id = v_package AND r.revision_digest = v_rev;
  IF FOUND THEN
    RETURN QUERY SELECT 'idempotent'::text, v_project, v_package, v_existing.generation, v_rev,
                        v_existing.lock_digest, v_existing.installation_id;
    RETURN;
  END IF;
  IF EXISTS (SELECT 1 FROM ql3.package_materialized_revisions r WHERE r.revision_digest = v_rev) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL201', MESSAGE = 'revision digest already recorded for another package';
  END IF;
  SELECT COALESCE(pg_catalog.max(r.generation), 0) + 1 INTO v_gen
    FROM ql3.package_materialized_revisions r WHERE r.project_id = v_project AND r.package_id = v_package;
  v_now := ql3.now_ms();
  INSERT INTO ql3.package_materialized_revisions (project_id, package_id, generation, revision_digest,
    installation_id, lock_digest, publisher_id, package_version, document, created_at_ms)
  VALUES (v_project, v_package, v_gen, v_rev, v_installation, v_lock, v_publisher, v_version, v_norm, v_now);
  -- The package and publisher security boundary rows every start locks (ql3.start_guard).
  INSERT INTO ql3.security_boundaries (kind, id, version, changed_at_ms)
  VALUES ('package', v_project || '/' || v_package, 1, v_now), ('publisher', v_publisher, 1, v_now)
  ON CONFLICT (kind, id) DO NOTHING;
  INSERT INTO ql3.package_revision_tasks (project_id, package_id, generation, task_key, source_digest,
    enabled, executor_type, execution_template)
  SELECT v_project, v_package, v_gen, e.key,
         ql3.domain_digest('qinglong/package-task-source@v1', ql3.canonical_json(pg_catalog.jsonb_build_object(
           'package_id', v_package, 'task_key', e.key, 'executor_type', e.value -> 'executor_type',
           'execution_template', e.value -> 'execution_template')::json)),
         (e.value ->> 'enabled')::boolean, e.value ->> 'executor_type', e.value -> 'execution_template'
    FROM pg_catalog.jsonb_each(v_tasks) e;
  INSERT INTO ql3.package_revision_workflows (project_id, package_id, generation, workflow_key,
    semantic_digest, enabled, definition)
  SELECT v_project, v_package, v_gen, e.key,
         ql3.domain_digest('qinglong/workflow-semantic@v1', ql3.canonical_json(pg_catalog.jsonb_build_object(
           'package_id', v_package, 'workflow_key', e.key, 'steps', e.value -> 'steps')::json)),
         (e.value ->> 'enabled')::boolean, pg_catalog.jsonb_build_object('steps', e.value -> 'steps')
    FROM pg_catalog.jsonb_each(v_workflows) e;
  RETURN QUERY SELECT 'inserted'::text, v_project, v_package, v_gen, v_rev, v_lock, v_installation;
END
$fn$;
COMMENT ON FUNCTION ql3.package_revision_materialize(json) IS
  'Role ql3_package_manager. Records an immutable materialized package revision (ADR-0223 §1-2). Input: p_document json {schema "qinglong/package-materialized-revision@v1", project_id, package_id (no '':''), package_version, publisher_id, installation_id, tasks {key: {enabled, executor_type local_process|remote_worker, execution_template}}, workflows {key: {enabled, steps {key: {task, needs[]}}}}}; parsed as json so duplicate keys are seen; <= 1 MiB, <= 256 tasks, <= 128 steps per workflow, acyclic. Templates are normalised by the ExecutionSpec check. Returns (outcome inserted|idempotent, project_id, package_id, generation 1..2147483647 assigned per package, revision_digest = SHA-256 of the normalised document under qinglong/package-materialized-revision@v1, lock_digest under qinglong/package-lock@v1, installation_id). Same content again -> idempotent with the first generation; changed content -> the next generation. Errors: QL001 invalid input, QL002 limits, QL201 digest collision, QL601 caller not in role.';
REVOKE ALL ON FUNCTION ql3.package_revision_materialize(json) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.package_revision_materialize(json) TO ql3_package_manager;
