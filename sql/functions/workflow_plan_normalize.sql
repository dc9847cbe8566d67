CREATE OR REPLACE FUNCTION ql3.workflow_plan_normalize(p_plan json, OUT plan jsonb, OUT plan_digest text)
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  d jsonb;
  s jsonb;
  i integer := 0;
  v_steps jsonb := '[]';
  v_keys text[] := '{}';
  v_ids text[] := '{}';
  v_dag jsonb := '{}';
  v_needs jsonb;
  v_field text;
  v_canon text;
BEGIN
  IF p_plan IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'plan: must not be null';
  END IF;
  IF pg_catalog.octet_length(p_plan::text) > 1048576 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'plan: larger than 256 KiB canonical (input over 1 MiB)';
  END IF;
  PERFORM ql3.canonical_json(p_plan);  -- duplicate keys, floats, invalid unicode, depth
  d := p_plan::jsonb;
  PERFORM ql3.json_require_keys(d, 'plan',
    ARRAY['schema', 'project_id', 'package_id', 'installation_id', 'lock_digest', 'generation',
          'revision_digest', 'publication_id', 'publication_digest', 'workflow_key',
          'workflow_semantic_digest', 'run_id', 'steps'],
    ARRAY['plan_digest']);
  IF d ->> 'schema' IS DISTINCT FROM 'qinglong/plugin-package-workflow-execution-plan@v1' THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'plan.schema: must be qinglong/plugin-package-workflow-execution-plan@v1';
  END IF;
  PERFORM ql3.check_id(ql3.json_text(d, 'project_id', 'plan', 36), 'plan.project_id');
  PERFORM ql3.check_id(ql3.json_text(d, 'package_id', 'plan', 36), 'plan.package_id');
  PERFORM ql3.check_id(ql3.json_text(d, 'installation_id', 'plan', 36), 'plan.installation_id');
  PERFORM ql3.check_id(ql3.json_text(d, 'publication_id', 'plan', 36), 'plan.publication_id');
  PERFORM ql3.check_id(ql3.json_text(d, 'workflow_key', 'plan', 36), 'plan.workflow_key');
  PERFORM ql3.check_id(ql3.json_text(d, 'run_id', 'plan', 36), 'plan.run_id');
  FOREACH v_field IN ARRAY ARRAY['lock_digest', 'revision_digest', 'publication_digest', 'workflow_semantic_digest'] LOOP
    IF ql3.json_text(d, v_field, 'plan', 64) !~ '^[0-9a-f]{64}$' THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('plan.%s: must be 64 lowercase hex', v_field);
    END IF;
  END LOOP;
  IF pg_catalog.jsonb_typeof(d -> 'generation') <> 'number' OR (d ->> 'generation') !~ '^[0-9]{1,10}$'
     OR (d ->> 'generation')::bigint NOT BETWEEN 1 AND 2147483647 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'plan.generation: must be an integer 1..2147483647';
  END IF;
  IF pg_catalog.jsonb_typeof(d -> 'steps') <> 'array' OR pg_catalog.jsonb_array_length(d -> 'steps') = 0 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'plan.steps: must be a non-empty array';
  END IF;
  IF pg_catalog.jsonb_array_length(d -> 'steps') > 128 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'plan.steps: more than 128 steps';
  END IF;
  FOR s IN SELECT x FROM pg_catalog.jsonb_array_elements(d -> 'steps') x LOOP
    v_field := pg_catalog.format('plan.steps[%s]', i);
    PERFORM ql3.json_require_keys(s, v_field,
      ARRAY['step_key', 'step_run_id', 'task_key', 'task_reference', 'source_digest', 'needs', 'initial_status']);
    PERFORM ql3.check_id(ql3.json_text(s, 'step_key', v_field, 64), v_field || '.step_key', 64);
    PERFORM ql3.check_id(ql3.json_text(s, 'step_run_id', v_field, 128), v_field || '.step_run_id', 128);
    PERFORM ql3.check_id(ql3.json_text(s, 'task_key', v_field, 36), v_field || '.task_key');
    PERFORM ql3.json_text(s, 'task_reference', v_field, 256);
    IF ql3.json_text(s, 'source_digest', v_field, 64) !~ '^[0-9a-f]{64}$' THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('%s.source_digest: must be 64 lowercase hex', v_field);
    END IF;
    IF (s ->> 'step_key') = ANY (v_keys) THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('%s.step_key: duplicate step %s', v_field, s ->> 'step_key');
    END IF;
    IF (s ->> 'step_run_id') = ANY (v_ids) THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('%s.step_run_id: duplicate StepRun id %s', v_field, s ->> 'step_run_id');
    END IF;
    v_keys := v_keys || (s ->> 'step_key');
    v_ids := v_ids || (s ->> 'step_run_id');
    IF pg_catalog.jsonb_typeof(s -> 'needs') <> 'array'
       OR EXISTS (SELECT 1 FROM pg_catalog.jsonb_array_elements(s -> 'needs') x WHERE pg_catalog.jsonb_typeof(x) <> 'string')
       OR (SELECT pg_catalog.count(*) <> pg_catalog.count(DISTINCT x) FROM pg_catalog.jsonb_array_elements_text(s -> 'needs') x) THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('%s.needs: must be an array of distinct step keys', v_field);
    END IF;
    SELECT COALESCE(pg_catalog.jsonb_agg(x ORDER BY x COLLATE "C"), '[]'::jsonb) INTO v_needs
      FROM pg_catalog.jsonb_array_elements_text(s -> 'needs') x;
    IF NOT (s ->> 'initial_status' = ANY (ARRAY['pending', 'ready'])) THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = pg_catalog.format('%s.initial_status: must be pending or ready', v_field);
    END IF;
    IF (s ->> 'initial_status' = 'ready') <> (v_needs = '[]'::jsonb) THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001',
        MESSAGE = pg_catalog.format('%s.initial_status: only root steps (no needs) are ready; steps with needs are pending', v_field);
    END IF;
    v_dag := v_dag || pg_catalog.jsonb_build_object(s ->> 'step_key', v_needs);
    v_steps := v_steps || pg_catalog.jsonb_build_array(s || pg_catalog.jsonb_build_object('needs', v_needs));
    i := i + 1;
  END LOOP;
  PERFORM ql3.dag_check(v_dag, 'plan.steps');
  SELECT pg_catalog.jsonb_agg(x ORDER BY x ->> 'step_key' COLLATE "C") INTO v_steps
    FROM pg_catalog.jsonb_array_elements(v_steps) x;
  plan := (d - 'plan_digest') || pg_catalog.jsonb_build_object('steps', v_steps);
  v_canon := ql3.canonical_json(plan::json);
  IF pg_catalog.octet_length(v_canon) > 262144 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'plan: canonical form larger than 256 KiB';
  END IF;
  plan_digest := ql3.domain_digest('qinglong/plugin-package-workflow-execution-plan@v1', v_canon);
  IF d ? 'plan_digest' AND (d ->> 'plan_digest') IS DISTINCT FROM plan_digest THEN
    RAISE EXCEPTION USING ERRCODE = 'QL501',
      MESSAGE = pg_catalog.format('plan.plan_digest: %s does not match the recomputed canonical digest %s',
                                  pg_catalog.left(d ->> 'plan_digest', 80), plan_digest);
  END IF;
END
$fn$;
COMMENT ON FUNCTION ql3.workflow_plan_normalize(json) IS
  'Internal (owner only). Strict normalisation of a qinglong/plugin-package-workflow-execution-plan@v1 document: unknown fields rejected, ids portable, digests 64 hex, 1..128 steps, distinct step keys and StepRun ids, needs distinct and sorted, acyclic, only roots ready, steps sorted by step_key, canonical form <= 256 KiB. Returns (plan jsonb normalised without plan_digest, plan_digest hex SHA-256 under the schema domain). Errors: QL001, QL002, QL501 when a given plan_digest differs from the recomputed one. Source: ADR-0223 §1.';
REVOKE ALL ON FUNCTION ql3.workflow_plan_normalize(json) FROM PUBLIC;
