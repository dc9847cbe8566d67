CREATE OR REPLACE FUNCTION ql3.workflow_plan_admit(p_plan json)
RETURNS TABLE (run_id text, plan_digest text, receipt jsonb, receipt_digest text, replayed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  n record;
  p jsonb;
  v_digest text;
  m record;
  pub record;
  w record;
  a record;
  bad record;
  v_run text;
  v_now bigint;
  v_nsteps integer;
  v_seq bigint;
  v_rows jsonb;
  v_steps_receipt jsonb;
  v_receipt jsonb;
  v_receipt_digest text;
  v_canon text;
  v_count bigint;
BEGIN
  PERFORM ql3.require_role('workflow_plan_admit', 'ql3_package_executor');
  n := ql3.workflow_plan_normalize(p_plan);
  p := n.plan;
  v_digest := n.plan_digest;
  v_run := p ->> 'run_id';
  v_nsteps := pg_catalog.jsonb_array_length(p -> 'steps');

  SELECT r.project_id, r.package_id, r.generation, r.installation_id, r.lock_digest, r.revision_digest, r.publisher_id
    INTO m FROM ql3.package_materialized_revisions r
   WHERE r.project_id = p ->> 'project_id' AND r.package_id = p ->> 'package_id'
     AND r.generation = (p ->> 'generation')::integer;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('plan generation drift: %s/%s has no generation %s',
                                  p ->> 'project_id', p ->> 'package_id', p ->> 'generation');
  END IF;
  -- Security boundary, shared for starts (quarantine/publish/withdraw and revocation take it
  -- exclusively; ql3.start_guard below also locks the boundary rows FOR SHARE), then the Run.
  PERFORM ql3.advisory_lock('package', m.project_id || '/' || m.package_id, true);
  PERFORM ql3.advisory_lock('publisher', m.publisher_id, true);
  PERFORM ql3.advisory_lock('run', v_run);

  -- Exact replay first: the same plan digest returns the durable receipt and creates nothing.
  SELECT x.run_id, x.plan_digest, x.receipt, x.receipt_digest INTO a
    FROM ql3.workflow_admissions x WHERE x.plan_digest = v_digest;
  IF FOUND THEN
    RETURN QUERY SELECT a.run_id, a.plan_digest, a.receipt, a.receipt_digest, true;
    RETURN;
  END IF;
  IF EXISTS (SELECT 1 FROM ql3.runs r WHERE r.id = v_run) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL201',
      MESSAGE = pg_catalog.format('run id collision: run %s exists with another plan', v_run);
  END IF;
  SELECT pg_catalog.min(sr.id) INTO bad FROM ql3.step_runs sr
   WHERE sr.id IN (SELECT x ->> 'step_run_id' FROM pg_catalog.jsonb_array_elements(p -> 'steps') x);
  IF bad.min IS NOT NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL201',
      MESSAGE = pg_catalog.format('StepRun id collision: StepRun %s of this plan already exists in another run', bad.min);
  END IF;

  -- Exact publication start guard, inside this transaction.
  SELECT x.publication_id, x.publication_digest, x.generation, x.project_id, x.package_id INTO pub
    FROM ql3.automation_publications x WHERE x.publication_id = p ->> 'publication_id';
  IF FOUND AND (pub.project_id <> m.project_id OR pub.package_id <> m.package_id OR pub.generation <> m.generation) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('plan publication drift: publication %s publishes %s/%s generation %s, the plan binds generation %s',
                                  pub.publication_id, pub.project_id, pub.package_id, pub.generation, m.generation);
  END IF;
  IF FOUND AND pub.publication_digest <> p ->> 'publication_digest' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('plan publication drift: publication %s has digest %s, the plan binds %s',
                                  pub.publication_id, pub.publication_digest, p ->> 'publication_digest');
  END IF;
  PERFORM ql3.start_guard(m.project_id, m.package_id, m.publisher_id, p ->> 'publication_id');
  IF m.installation_id <> p ->> 'installation_id' OR m.lock_digest <> p ->> 'lock_digest'
     OR m.revision_digest <> p ->> 'revision_digest' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('plan generation drift: %s of %s/%s generation %s differs from the materialized revision',
        CASE WHEN m.installation_id <> p ->> 'installation_id' THEN 'installation_id'
             WHEN m.lock_digest <> p ->> 'lock_digest' THEN 'lock_digest' ELSE 'revision_digest' END,
        m.project_id, m.package_id, m.generation);
  END IF;
  SELECT x.workflow_key, x.semantic_digest, x.enabled, x.definition INTO w FROM ql3.package_revision_workflows x
   WHERE x.project_id = m.project_id AND x.package_id = m.package_id AND x.generation = m.generation
     AND x.workflow_key = p ->> 'workflow_key';
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('plan reference drift: workflow %s is not in %s/%s generation %s',
                                  p ->> 'workflow_key', m.project_id, m.package_id, m.generation);
  END IF;
  IF w.semantic_digest <> p ->> 'workflow_semantic_digest' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('plan reference drift: workflow %s has semantic digest %s in generation %s, the plan binds %s',
                                  w.workflow_key, w.semantic_digest, m.generation, p ->> 'workflow_semantic_digest');
  END IF;
  IF NOT w.enabled THEN
    RAISE EXCEPTION USING ERRCODE = 'QL301', MESSAGE = pg_catalog.format('start guard: workflow %s is disabled', w.workflow_key);
  END IF;

  -- Every step binding at once; the first offending step (byte order of step keys) names the rule.
  SELECT c.problem, c.step_key, c.detail INTO bad FROM (
    SELECT CASE WHEN ps.s IS NULL THEN 1 WHEN ws.key IS NULL THEN 2
                WHEN ws.value ->> 'task' <> ps.s ->> 'task_key' THEN 3
                WHEN ws.value -> 'needs' <> ps.s -> 'needs' THEN 4
                WHEN t.source_digest <> ps.s ->> 'source_digest' THEN 5
                WHEN ps.s ->> 'task_reference' <> 'pkgref:v1:' || m.package_id || ':' || m.generation || ':' || t.task_key THEN 6
                WHEN NOT t.enabled THEN 7 END AS problem,
           COALESCE(ps.s ->> 'step_key', ws.key) AS step_key,
           CASE WHEN ps.s IS NULL OR ws.key IS NULL THEN NULL
                WHEN ws.value ->> 'task' <> ps.s ->> 'task_key' THEN ws.value ->> 'task'
                WHEN ws.value -> 'needs' <> ps.s -> 'needs' THEN (ws.value -> 'needs')::text
                WHEN t.source_digest <> ps.s ->> 'source_digest' THEN t.source_digest
                WHEN ps.s ->> 'task_reference' <> 'pkgref:v1:' || m.package_id || ':' || m.generation || ':' || t.task_key
                  THEN 'pkgref:v1:' || m.package_id || ':' || m.generation || ':' || t.task_key
                ELSE t.task_key END AS detail
      FROM pg_catalog.jsonb_array_elements(p -> 'steps') ps(s)
      FULL JOIN pg_catalog.jsonb_each(w.definition -> 'steps') ws ON ws.key = ps.s ->> 'step_key'
      LEFT JOIN ql3.package_revision_tasks t
        ON t.project_id = m.project_id AND t.package_id = m.package_id AND t.generation = m.generation
       AND t.task_key = ws.value ->> 'task') c
   WHERE c.problem IS NOT NULL
   ORDER BY c.problem > 2, c.step_key COLLATE "C"
   LIMIT 1;
  IF FOUND THEN
    CASE bad.problem
      WHEN 1 THEN RAISE EXCEPTION USING ERRCODE = 'QL001',
        MESSAGE = pg_catalog.format('plan.steps: step %s of workflow %s is missing from the plan (one StepRun id per step is required)', bad.step_key, w.workflow_key);
      WHEN 2 THEN RAISE EXCEPTION USING ERRCODE = 'QL001',
        MESSAGE = pg_catalog.format('plan.steps: step %s is not a step of workflow %s', bad.step_key, w.workflow_key);
      WHEN 3 THEN RAISE EXCEPTION USING ERRCODE = 'QL202',
        MESSAGE = pg_catalog.format('plan reference drift: step %s binds another task than the workflow definition (%s)', bad.step_key, bad.detail);
      WHEN 4 THEN RAISE EXCEPTION USING ERRCODE = 'QL202',
        MESSAGE = pg_catalog.format('plan reference drift: step %s needs differ from the workflow definition (%s)', bad.step_key, bad.detail);
      WHEN 5 THEN RAISE EXCEPTION USING ERRCODE = 'QL202',
        MESSAGE = pg_catalog.format('plan reference drift: step %s source digest is not the task''s source digest %s in generation %s', bad.step_key, bad.detail, m.generation);
      WHEN 6 THEN RAISE EXCEPTION USING ERRCODE = 'QL202',
        MESSAGE = pg_catalog.format('plan reference drift: step %s task_reference is not the generation-bound reference %s', bad.step_key, bad.detail);
      ELSE RAISE EXCEPTION USING ERRCODE = 'QL301',
        MESSAGE = pg_catalog.format('start guard: task %s of step %s is disabled', bad.detail, bad.step_key);
    END CASE;
  END IF;

  -- Create the Run, every StepRun (in step-key order: sequence 2..N+1), one event and one mutation
  -- each, and the receipt. ON CONFLICT DO NOTHING: a row committed by a transaction this snapshot
  -- cannot see raises 40001 at REPEATABLE READ/SERIALIZABLE (retried), never a unique violation.
  v_now := ql3.now_ms();
  v_seq := v_nsteps::bigint + 1;
  INSERT INTO ql3.runs (id, project_id, package_id, task_id, task_revision, publication_id, generation,
                        publisher_id, plan_digest, status, version, event_sequence, steps_total,
                        created_at_ms, observed_at_ms)
  VALUES (v_run, m.project_id, m.package_id, w.workflow_key, p ->> 'publication_digest', p ->> 'publication_id',
          m.generation, m.publisher_id, v_digest, 'running', v_seq, v_seq, v_nsteps, v_now, v_now)
  ON CONFLICT DO NOTHING;
  GET DIAGNOSTICS v_count = ROW_COUNT;
  IF v_count <> 1 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL201',
      MESSAGE = pg_catalog.format('run id collision: run %s exists with another plan', v_run);
  END IF;
  INSERT INTO ql3.run_events (run_id, sequence, type, payload, at_ms)
  VALUES (v_run, 1, 'workflow.run_admitted',
          pg_catalog.jsonb_build_object('plan_digest', v_digest, 'publication_id', p ->> 'publication_id',
                                        'generation', m.generation), v_now);
  SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
           'id', x.s ->> 'step_run_id', 'key', x.s ->> 'step_key', 'task', x.s ->> 'task_key',
           'status', x.s ->> 'initial_status', 'needs', x.s -> 'needs', 'seq', x.i + 1,
           'digest', ql3.step_run_digest(v_run, x.s ->> 'step_run_id', x.s ->> 'step_key', x.s ->> 'task_key',
                                         x.s ->> 'initial_status', 1, 0,
                                         CASE WHEN x.s ->> 'initial_status' = 'ready' THEN v_now END)) ORDER BY x.i)
    INTO v_rows
    FROM pg_catalog.jsonb_array_elements(p -> 'steps') WITH ORDINALITY x(s, i);
  INSERT INTO ql3.step_runs (id, run_id, step_key, task_key, status, version, attempt_count, digest, needs,
                             unmet_needs, ready_at_ms, created_at_ms, updated_at_ms)
  SELECT r.id, v_run, r.key, r.task, r.status, 1, 0, r.digest,
         ARRAY(SELECT pg_catalog.jsonb_array_elements_text(r.needs)), pg_catalog.jsonb_array_length(r.needs),
         CASE WHEN r.status = 'ready' THEN v_now END, v_now, v_now
    FROM pg_catalog.jsonb_to_recordset(v_rows) AS r(id text, key text, task text, status text, needs jsonb, seq bigint, digest text)
  ON CONFLICT DO NOTHING;
  GET DIAGNOSTICS v_count = ROW_COUNT;
  IF v_count <> v_nsteps THEN
    RAISE EXCEPTION USING ERRCODE = 'QL201',
      MESSAGE = 'StepRun id collision: a StepRun id of this plan was created concurrently by another run';
  END IF;
  INSERT INTO ql3.run_events (run_id, sequence, type, step_run_id, payload, at_ms)
  SELECT v_run, r.seq, 'workflow.step_run_created', r.id,
         pg_catalog.jsonb_build_object('step_key', r.key, 'to', r.status, 'version', 1), v_now
    FROM pg_catalog.jsonb_to_recordset(v_rows) AS r(id text, key text, status text, seq bigint);
  INSERT INTO ql3.step_run_mutations (step_run_id, version, run_id, from_status, to_status, run_sequence,
                                      digest, reason, at_ms)
  SELECT r.id, 1, v_run, NULL, r.status, r.seq, r.digest, 'admitted', v_now
    FROM pg_catalog.jsonb_to_recordset(v_rows) AS r(id text, status text, seq bigint, digest text);
  SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
           'step_key', r.key, 'step_run_id', r.id, 'status', r.status, 'version', 1, 'digest', r.digest) ORDER BY r.seq),
         pg_catalog.string_agg('{"digest":' || pg_catalog.to_json(r.digest)::text
                               || ',"status":' || pg_catalog.to_json(r.status)::text
                               || ',"step_key":' || pg_catalog.to_json(r.key)::text
                               || ',"step_run_id":' || pg_catalog.to_json(r.id)::text || ',"version":1}', ',' ORDER BY r.seq)
    INTO v_steps_receipt, v_canon
    FROM pg_catalog.jsonb_to_recordset(v_rows) AS r(id text, key text, status text, seq bigint, digest text);
  v_receipt := pg_catalog.jsonb_build_object(
    'schema', 'qinglong/plugin-package-workflow-admission-receipt@v1',
    'run_id', v_run, 'plan_digest', v_digest, 'project_id', m.project_id, 'package_id', m.package_id,
    'generation', m.generation, 'publication_id', p ->> 'publication_id',
    'publication_digest', p ->> 'publication_digest', 'workflow_key', w.workflow_key,
    'run_status', 'running', 'run_version', v_seq, 'event_sequence', v_seq,
    'admitted_at_ms', v_now, 'step_runs', v_steps_receipt);
  -- RFC 8785 text of this fixed shape written directly (keys in code-unit order, values ids, hex,
  -- integers and fixed words), byte-identical to ql3.canonical_json(v_receipt): the shell recomputes
  -- the receipt digest from the jsonb on every admission (qlpg.install.admit_plan).
  v_canon := '{"admitted_at_ms":' || v_now || ',"event_sequence":' || v_seq || ',"generation":' || m.generation
    || ',"package_id":' || pg_catalog.to_json(m.package_id::text)::text
    || ',"plan_digest":' || pg_catalog.to_json(v_digest)::text
    || ',"project_id":' || pg_catalog.to_json(m.project_id::text)::text
    || ',"publication_digest":' || pg_catalog.to_json(p ->> 'publication_digest')::text
    || ',"publication_id":' || pg_catalog.to_json(p ->> 'publication_id')::text
    || ',"run_id":' || pg_catalog.to_json(v_run)::text || ',"run_status":"running","run_version":' || v_seq
    || ',"schema":"qinglong/plugin-package-workflow-admission-receipt@v1","step_runs":[' || v_canon || ']'
    || ',"workflow_key":' || pg_catalog.to_json(w.workflow_key::text)::text || '}';
  v_receipt_digest := ql3.domain_digest('qinglong/plugin-package-workflow-admission-receipt@v1', v_canon);
  INSERT INTO ql3.workflow_admissions (run_id, plan_digest, plan, receipt, receipt_digest, publication_id, admitted_at_ms)
  VALUES (v_run, v_digest, p, v_receipt, v_receipt_digest, p ->> 'publication_id', v_now);
  INSERT INTO ql3.workflow_admission_steps (run_id, step_run_id, step_key, task_key, task_reference,
                                            source_digest, needs, initial_status)
  SELECT v_run, x ->> 'step_run_id', x ->> 'step_key', x ->> 'task_key', x ->> 'task_reference',
         x ->> 'source_digest', ARRAY(SELECT pg_catalog.jsonb_array_elements_text(x -> 'needs')), x ->> 'initial_status'
    FROM pg_catalog.jsonb_array_elements(p -> 'steps') x;
  RETURN QUERY SELECT v_run, v_digest, v_receipt, v_receipt_digest, false;
END
$fn$;
COMMENT ON FUNCTION ql3.workflow_plan_admit(json) IS
  'Role ql3_package_executor. Single-transaction Workflow admission (ADR-0223 §3). Input: p_plan json, a qinglong/plugin-package-workflow-execution-plan@v1 document {schema, project_id, package_id, installation_id, lock_digest, generation, revision_digest, publication_id, publication_digest, workflow_key, workflow_semantic_digest, run_id, steps[{step_key, step_run_id, task_key, task_reference, source_digest, needs[], initial_status pending|ready}], optional plan_digest}; parsed as json (duplicate keys seen), <= 128 steps, <= 256 KiB canonical. Takes the package and publisher security boundaries shared (advisory locks, and their ql3.security_boundaries rows FOR SHARE in the start guard), then the Run lock; an exact replay (same plan digest) returns the stored receipt with replayed = true; else checks the publication start guard and every binding, then creates the Run (running), all StepRuns, ordered RunEvents and StepRun mutations and the immutable receipt (digest under qinglong/plugin-package-workflow-admission-receipt@v1). Returns (run_id, plan_digest, receipt jsonb, receipt_digest, replayed). Errors (nothing is written): QL001 invalid plan or missing/unknown step, QL002 limits, QL201 run or StepRun id collision, QL202 generation/publication/reference drift, QL301 start guard denied (withdrawn, not current, quarantined, revoked, workflow or task disabled), QL501 plan_digest mismatch, QL601 caller not in role; 40001 at REPEATABLE READ/SERIALIZABLE when a boundary changed or the same Run committed after this transaction''s snapshot (retry: the retry sees the change, or replays). Order of checks (the first failure wins): normalisation, generation exists, replay, run and StepRun id collision, publication drift, start guard, installation/lock/revision drift, workflow and its semantic digest, workflow enabled, steps (coverage, then per step in step-key order: task, needs, source digest, reference, task enabled).';
REVOKE ALL ON FUNCTION ql3.workflow_plan_admit(json) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.workflow_plan_admit(json) TO ql3_package_executor;
