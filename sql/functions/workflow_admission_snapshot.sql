CREATE OR REPLACE FUNCTION ql3.workflow_admission_snapshot(p_project_id text, p_package_id text, p_workflow_key text)
RETURNS jsonb
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  h record;
  w ql3.package_revision_workflows;
  v_steps jsonb;
BEGIN
  PERFORM ql3.require_role('workflow_admission_snapshot', 'ql3_package_executor');
  PERFORM ql3.check_id(p_project_id, 'project_id');
  PERFORM ql3.check_id(p_package_id, 'package_id');
  PERFORM ql3.check_id(p_workflow_key, 'workflow_key');
  SELECT p.*, m.installation_id, m.lock_digest, m.publisher_id INTO h
    FROM ql3.automation_publication_heads hd
    JOIN ql3.automation_publications p ON p.publication_id = hd.publication_id
    JOIN ql3.package_materialized_revisions m
      ON m.project_id = p.project_id AND m.package_id = p.package_id AND m.generation = p.generation
   WHERE hd.project_id = p_project_id AND hd.package_id = p_package_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101', MESSAGE = pg_catalog.format('package %s/%s has no publication', p_project_id, p_package_id);
  END IF;
  PERFORM ql3.start_guard(p_project_id, p_package_id, h.publisher_id, h.publication_id);
  SELECT * INTO w FROM ql3.package_revision_workflows x
   WHERE x.project_id = p_project_id AND x.package_id = p_package_id AND x.generation = h.generation
     AND x.workflow_key = p_workflow_key;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL101',
      MESSAGE = pg_catalog.format('workflow %s not found in %s/%s generation %s', p_workflow_key, p_project_id, p_package_id, h.generation);
  END IF;
  IF NOT w.enabled THEN
    RAISE EXCEPTION USING ERRCODE = 'QL301', MESSAGE = pg_catalog.format('start guard: workflow %s is disabled', p_workflow_key);
  END IF;
  SELECT pg_catalog.jsonb_object_agg(e.key, pg_catalog.jsonb_build_object(
           'task_key', e.value ->> 'task', 'needs', e.value -> 'needs',
           'task_reference', 'pkgref:v1:' || p_package_id || ':' || h.generation || ':' || (e.value ->> 'task'),
           'source_digest', t.source_digest, 'task_enabled', t.enabled))
    INTO v_steps
    FROM pg_catalog.jsonb_each(w.definition -> 'steps') e
    JOIN ql3.package_revision_tasks t
      ON t.project_id = p_project_id AND t.package_id = p_package_id AND t.generation = h.generation
     AND t.task_key = e.value ->> 'task';
  RETURN pg_catalog.jsonb_build_object(
    'project_id', p_project_id, 'package_id', p_package_id, 'installation_id', h.installation_id,
    'lock_digest', h.lock_digest, 'generation', h.generation, 'revision_digest', h.revision_digest,
    'publication_id', h.publication_id, 'publication_digest', h.publication_digest,
    'workflow_key', p_workflow_key, 'workflow_semantic_digest', w.semantic_digest, 'steps', v_steps);
END
$fn$;
COMMENT ON FUNCTION ql3.workflow_admission_snapshot(text, text, text) IS
  'Role ql3_package_executor. The facts a Workflow start needs to build its immutable plan, read from the current publication head (package facts are otherwise unreadable to this role): jsonb {project_id, package_id, installation_id, lock_digest, generation, revision_digest, publication_id, publication_digest, workflow_key, workflow_semantic_digest, steps {step_key: {task_key, needs[], task_reference pkgref:v1:<package>:<generation>:<task>, source_digest, task_enabled}}}. Read-only; the start guard is checked again at admission. Errors: QL001 bad ids, QL101 no publication/workflow, QL301 start guard denied (withdrawn, quarantined, revoked, workflow disabled), QL601. Source: ADR-0223 §1-2.';
REVOKE ALL ON FUNCTION ql3.workflow_admission_snapshot(text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.workflow_admission_snapshot(text, text, text) TO ql3_package_executor;
