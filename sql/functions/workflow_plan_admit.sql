CREATE OR REPLACE FUNCTION ql3.workflow_plan_admit(p_plan json)
RETURNS TABLE (run_id text, plan_digest text, receipt jsonb, receipt_digest text, replayed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  n record;
  p jsonb;
  v_digest text;
  m ql3.package_materialized_revisions;
  pub ql3.automation_publications;
  w ql3.package_revision_workflows;
  a ql3.workflow_admissions;
  s jsonb;
  def jsonb;
  t ql3.package_revision_tasks;
  v_run text;
  v_now bigint;
  v_seq bigint := 1;
  v_steps_receipt jsonb := '[]';
  v_step_digest text;
  v_receipt jsonb;
  v_receipt_digest text;
  v_count integer;
BEGIN
  PERFORM ql3.require_role('workflow_plan_admit', 'ql3_package_executor');
  n := ql3.workflow_plan_normalize(p_plan);
  p := n.plan;
  v_digest := n.plan_digest;
  v_run := p ->> 'run_id';

  SELECT * INTO m FROM ql3.package_materialized_revisions r
   WHERE r.project_id = p ->> 'project_id' AND r.package_id = p ->> 'package_id'
     AND r.generation = (p ->> 'generation')::integer;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('plan generation drift: %s/%s has no generation %s',
                                  p ->> 'project_id', p ->> 'package_id', p ->> 'generation');
  END IF;
  -- Security boundary, shared for starts (quarantine/publish/withdraw and revocation take it exclusively).
  PERFORM ql3.advisory_lock('package', m.project_id || '/' || m.package_id, true);
  PERFORM ql3.advisory_lock('publisher', m.publisher_id, true);
  PERFORM ql3.advisory_lock('run', v_run);

  -- Exact replay first: the same plan digest returns the durable receipt and creates nothing.
  SELECT * INTO a FROM ql3.workflow_admissions x WHERE x.plan_digest = v_digest;
  IF FOUND THEN
    RETURN QUERY SELECT a.run_id, a.plan_digest, a.receipt, a.receipt_digest, true;
    RETURN;
  END IF;
  IF EXISTS (SELECT 1 FROM ql3.runs r WHERE r.id = v_run) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL201',
      MESSAGE = pg_catalog.format('run id collision: run %s exists with another plan', v_run);
  END IF;
  SELECT pg_catalog.count(*) INTO v_count FROM ql3.step_runs sr
   WHERE sr.id IN (SELECT x ->> 'step_run_id' FROM pg_catalog.jsonb_array_elements(p -> 'steps') x);
  IF v_count > 0 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL201', MESSAGE = 'StepRun id collision: a StepRun id of this plan already exists';
  END IF;

  -- Exact publication start guard, inside this transaction.
  SELECT * INTO pub FROM ql3.automation_publications x WHERE x.publication_id = p ->> 'publication_id';
  IF FOUND AND (pub.publication_digest <> p ->> 'publication_digest' OR pub.generation <> m.generation
                OR pub.project_id <> m.project_id OR pub.package_id <> m.package_id) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('plan publication drift: publication %s does not bind digest %s at generation %s',
                                  pub.publication_id, p ->> 'publication_digest', m.generation);
  END IF;
  PERFORM ql3.start_guard(m.project_id, m.package_id, m.publisher_id, p ->> 'publication_id');
  IF m.installation_id <> p ->> 'installation_id' OR m.lock_digest <> p ->> 'lock_digest'
     OR m.revision_digest <> p ->> 'revision_digest' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = 'plan generation drift: installation, lock or revision digest differs from the materialized revision';
  END IF;
  SELECT * INTO w FROM ql3.package_revision_workflows x
   WHERE x.project_id = m.project_id AND x.package_id = m.package_id AND x.generation = m.generation
     AND x.workflow_key = p ->> 'workflow_key';
  IF NOT FOUND OR w.semantic_digest <> p ->> 'workflow_semantic_digest' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('plan reference drift: workflow %s with semantic digest %s is not in generation %s',
                                  p ->> 'workflow_key', p ->> 'workflow_semantic_digest', m.generation);
  END IF;
  IF NOT w.enabled THEN
    RAISE EXCEPTION USING ERRCODE = 'QL301', MESSAGE = pg_catalog.format('start guard: workflow %s is disabled', w.workflow_key);
  END IF;
  IF (SELECT pg_catalog.array_agg(k ORDER BY k COLLATE "C") FROM pg_catalog.jsonb_object_keys(w.definition -> 'steps') k)
     IS DISTINCT FROM
     (SELECT pg_catalog.array_agg(x ->> 'step_key' ORDER BY x ->> 'step_key' COLLATE "C") FROM pg_catalog.jsonb_array_elements(p -> 'steps') x) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001',
      MESSAGE = pg_catalog.format('plan.steps: the StepRun ids must cover exactly the steps of workflow %s (missing or unknown step)', w.workflow_key);
  END IF;
  FOR s IN SELECT x FROM pg_catalog.jsonb_array_elements(p -> 'steps') x LOOP
    def := w.definition -> 'steps' -> (s ->> 'step_key');
    IF def ->> 'task' <> s ->> 'task_key' OR def -> 'needs' <> s -> 'needs' THEN
      RAISE EXCEPTION USING ERRCODE = 'QL202',
        MESSAGE = pg_catalog.format('plan reference drift: step %s binds another task or other needs than the workflow definition', s ->> 'step_key');
    END IF;
    SELECT * INTO t FROM ql3.package_revision_tasks x
     WHERE x.project_id = m.project_id AND x.package_id = m.package_id AND x.generation = m.generation
       AND x.task_key = s ->> 'task_key';
    IF t.source_digest <> s ->> 'source_digest'
       OR s ->> 'task_reference' <> 'pkgref:v1:' || m.package_id || ':' || m.generation || ':' || t.task_key THEN
      RAISE EXCEPTION USING ERRCODE = 'QL202',
        MESSAGE = pg_catalog.format('plan reference drift: step %s source digest or generation-bound reference differs', s ->> 'step_key');
    END IF;
    IF NOT t.enabled THEN
      RAISE EXCEPTION USING ERRCODE = 'QL301', MESSAGE = pg_catalog.format('start guard: task %s is disabled', t.task_key);
    END IF;
  END LOOP;

  -- Create the Run, every StepRun, ordered events and mutations, and the receipt.
  v_now := ql3.now_ms();
  INSERT INTO ql3.runs (id, project_id, package_id, task_id, task_revision, publication_id, generation,
                        publisher_id, plan_digest, status, version, event_sequence, steps_total,
                        created_at_ms, observed_at_ms)
  VALUES (v_run, m.project_id, m.package_id, w.workflow_key, pub.publication_digest, pub.publication_id,
          m.generation, m.publisher_id, v_digest, 'running', 1, 1,
          pg_catalog.jsonb_array_length(p -> 'steps'), v_now, v_now);
  INSERT INTO ql3.run_events (run_id, sequence, type, payload, at_ms)
  VALUES (v_run, 1, 'workflow.run_admitted',
          pg_catalog.jsonb_build_object('plan_digest', v_digest, 'publication_id', pub.publication_id,
                                        'generation', m.generation), v_now);
  FOR s IN SELECT x FROM pg_catalog.jsonb_array_elements(p -> 'steps') x LOOP
    v_seq := v_seq + 1;
    v_step_digest := ql3.step_run_digest(v_run, s ->> 'step_run_id', s ->> 'step_key', s ->> 'task_key',
                                         s ->> 'initial_status', 1, 0,
                                         CASE WHEN s ->> 'initial_status' = 'ready' THEN v_now END);
    INSERT INTO ql3.step_runs (id, run_id, step_key, task_key, status, version, attempt_count, digest, needs,
                               unmet_needs, ready_at_ms, created_at_ms, updated_at_ms)
    VALUES (s ->> 'step_run_id', v_run, s ->> 'step_key', s ->> 'task_key', s ->> 'initial_status', 1, 0,
            v_step_digest, ARRAY(SELECT pg_catalog.jsonb_array_elements_text(s -> 'needs')),
            pg_catalog.jsonb_array_length(s -> 'needs'),
            CASE WHEN s ->> 'initial_status' = 'ready' THEN v_now END, v_now, v_now);
    INSERT INTO ql3.run_events (run_id, sequence, type, step_run_id, payload, at_ms)
    VALUES (v_run, v_seq, 'workflow.step_run_created', s ->> 'step_run_id',
            pg_catalog.jsonb_build_object('step_key', s ->> 'step_key', 'to', s ->> 'initial_status', 'version', 1),
            v_now);
    INSERT INTO ql3.step_run_mutations (step_run_id, version, run_id, from_status, to_status, run_sequence,
                                        digest, reason, at_ms)
    VALUES (s ->> 'step_run_id', 1, v_run, NULL, s ->> 'initial_status', v_seq, v_step_digest, 'admitted', v_now);
    v_steps_receipt := v_steps_receipt || pg_catalog.jsonb_build_array(pg_catalog.jsonb_build_object(
      'step_key', s ->> 'step_key', 'step_run_id', s ->> 'step_run_id', 'status', s ->> 'initial_status',
      'version', 1, 'digest', v_step_digest));
  END LOOP;
  UPDATE ql3.runs r SET version = v_seq, event_sequence = v_seq WHERE r.id = v_run;
  v_receipt := pg_catalog.jsonb_build_object(
    'schema', 'qinglong/plugin-package-workflow-admission-receipt@v1',
    'run_id', v_run, 'plan_digest', v_digest, 'project_id', m.project_id, 'package_id', m.package_id,
    'generation', m.generation, 'publication_id', pub.publication_id,
    'publication_digest', pub.publication_digest, 'workflow_key', w.workflow_key,
    'run_status', 'running', 'run_version', v_seq, 'event_sequence', v_seq,
    'admitted_at_ms', v_now, 'step_runs', v_steps_receipt);
  v_receipt_digest := ql3.domain_digest('qinglong/plugin-package-workflow-admission-receipt@v1',
                                        ql3.canonical_json(v_receipt::json));
  INSERT INTO ql3.workflow_admissions (run_id, plan_digest, plan, receipt, receipt_digest, publication_id, admitted_at_ms)
  VALUES (v_run, v_digest, p, v_receipt, v_receipt_digest, pub.publication_id, v_now);
  INSERT INTO ql3.workflow_admission_steps (run_id, step_run_id, step_key, task_key, task_reference,
                                            source_digest, needs, initial_status)
  SELECT v_run, x ->> 'step_run_id', x ->> 'step_key', x ->> 'task_key', x ->> 'task_reference',
         x ->> 'source_digest', ARRAY(SELECT pg_catalog.jsonb_array_elements_text(x -> 'needs')), x ->> 'initial_status'
    FROM pg_catalog.jsonb_array_elements(p -> 'steps') x;
  RETURN QUERY SELECT v_run, v_digest, v_receipt, v_receipt_digest, false;
END
$fn$;
COMMENT ON FUNCTION ql3.workflow_plan_admit(json) IS
  'Role ql3_package_executor. Single-transaction Workflow admission (ADR-0223 §3). Input: p_plan json, a qinglong/plugin-package-workflow-execution-plan@v1 document {schema, project_id, package_id, installation_id, lock_digest, generation, revision_digest, publication_id, publication_digest, workflow_key, workflow_semantic_digest, run_id, steps[{step_key, step_run_id, task_key, task_reference, source_digest, needs[], initial_status pending|ready}], optional plan_digest}; parsed as json (duplicate keys seen), <= 128 steps, <= 256 KiB canonical. Takes the package and publisher security boundaries shared, then the Run lock; an exact replay (same plan digest) returns the stored receipt with replayed = true; else checks the publication start guard and every binding, then creates the Run (running), all StepRuns, ordered RunEvents and StepRun mutations and the immutable receipt (digest under qinglong/plugin-package-workflow-admission-receipt@v1). Returns (run_id, plan_digest, receipt jsonb, receipt_digest, replayed). Errors (nothing is written): QL001 invalid plan or missing/unknown step, QL002 limits, QL201 run or StepRun id collision, QL202 generation/publication/reference drift, QL301 start guard denied (withdrawn, not current, quarantined, revoked, workflow or task disabled), QL501 plan_digest mismatch, QL601 caller not in role.';
REVOKE ALL ON FUNCTION ql3.workflow_plan_admit(json) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.workflow_plan_admit(json) TO ql3_package_executor;
