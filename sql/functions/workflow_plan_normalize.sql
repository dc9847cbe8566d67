CREATE OR REPLACE FUNCTION ql3.workflow_plan_normalize(p_plan json, OUT plan jsonb, OUT plan_digest text)
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  d jsonb;
  s jsonb;
  i integer := 0;
  v_steps jsonb := '[]'::jsonb;
  v_keys text[] := '{}'::text[];
  v_ids text[] := '{}'::text[];
  v_dag jsonb := '{}'::jsonb;
  v_needs jsonb;
  v_field text;
  v_canon text;
  v_ok boolean := false;
  v_sorted jsonb;
BEGIN
  IF p_plan IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'plan: must not be null';
  END IF;
  IF pg_catalog.octet_length(p_plan::text) > 1048576 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'plan: larger than 256 KiB canonical (input over 1 MiB)';
  END IF;

  -- Fast path (the common, valid case), set-based: accepts only plans the strict path below accepts
  -- with the same output; anything it does not accept goes to the strict path, which names the first
  -- violated rule exactly. Strictness without ql3.canonical_json on the raw text: the jsonb cast
  -- rejects undecodable strings (\u0000, lone surrogates); duplicate keys are found by comparing the
  -- json and jsonb key counts of the only objects a plan may hold (the plan and its steps); the only
  -- number, generation, must be written as a plain integer in the raw json text; every other value
  -- must be a string, or an array of strings (needs), so no float and no depth > 4 gets through.
  BEGIN
    d := p_plan::jsonb;
    v_ok := pg_catalog.jsonb_typeof(d) = 'object';
  EXCEPTION WHEN others THEN
    v_ok := false;
  END;
  IF v_ok THEN
    SELECT
      (d - 'plan_digest') ?& ARRAY['generation', 'installation_id', 'lock_digest', 'package_id', 'project_id',
        'publication_digest', 'publication_id', 'revision_digest', 'run_id', 'schema', 'steps', 'workflow_key',
        'workflow_semantic_digest']
      AND d - ARRAY['generation', 'installation_id', 'lock_digest', 'package_id', 'project_id',
        'publication_digest', 'publication_id', 'revision_digest', 'run_id', 'schema', 'steps', 'workflow_key',
        'workflow_semantic_digest', 'plan_digest'] = '{}'::jsonb
      AND (SELECT pg_catalog.count(*) FROM pg_catalog.json_object_keys(p_plan))
          = (SELECT pg_catalog.count(*) FROM pg_catalog.jsonb_object_keys(d))
      AND COALESCE(pg_catalog.jsonb_typeof(d -> 'plan_digest'), 'string') = 'string'
      AND pg_catalog.jsonb_typeof(d -> 'schema') = 'string'
      AND d ->> 'schema' = 'qinglong/plugin-package-workflow-execution-plan@v1'
      AND pg_catalog.jsonb_typeof(d -> 'project_id') = 'string' AND d ->> 'project_id' ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,35}$'
      AND pg_catalog.jsonb_typeof(d -> 'package_id') = 'string' AND d ->> 'package_id' ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,35}$'
      AND pg_catalog.jsonb_typeof(d -> 'installation_id') = 'string' AND d ->> 'installation_id' ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,35}$'
      AND pg_catalog.jsonb_typeof(d -> 'publication_id') = 'string' AND d ->> 'publication_id' ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,35}$'
      AND pg_catalog.jsonb_typeof(d -> 'workflow_key') = 'string' AND d ->> 'workflow_key' ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,35}$'
      AND pg_catalog.jsonb_typeof(d -> 'run_id') = 'string' AND d ->> 'run_id' ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,35}$'
      AND pg_catalog.jsonb_typeof(d -> 'lock_digest') = 'string' AND d ->> 'lock_digest' ~ '^[0-9a-f]{64}$'
      AND pg_catalog.jsonb_typeof(d -> 'revision_digest') = 'string' AND d ->> 'revision_digest' ~ '^[0-9a-f]{64}$'
      AND pg_catalog.jsonb_typeof(d -> 'publication_digest') = 'string' AND d ->> 'publication_digest' ~ '^[0-9a-f]{64}$'
      AND pg_catalog.jsonb_typeof(d -> 'workflow_semantic_digest') = 'string'
      AND d ->> 'workflow_semantic_digest' ~ '^[0-9a-f]{64}$'
      AND pg_catalog.jsonb_typeof(d -> 'generation') = 'number'
      AND (p_plan -> 'generation')::text ~ '^[1-9][0-9]{0,9}$'
      AND (d ->> 'generation')::bigint <= 2147483647
      AND pg_catalog.jsonb_typeof(d -> 'steps') = 'array'
      AND pg_catalog.jsonb_array_length(d -> 'steps') BETWEEN 1 AND 128
    INTO v_ok;
  END IF;
  IF v_ok THEN
    -- Every step checked, and (for use when all pass) the DAG, the sorted steps and their canonical text.
    SELECT pg_catalog.bool_and(
             pg_catalog.jsonb_typeof(x.s) = 'object'
             AND x.s ?& ARRAY['initial_status', 'needs', 'source_digest', 'step_key', 'step_run_id', 'task_key', 'task_reference']
             AND x.s - ARRAY['initial_status', 'needs', 'source_digest', 'step_key', 'step_run_id', 'task_key', 'task_reference'] = '{}'::jsonb
             AND pg_catalog.jsonb_typeof(x.s -> 'step_key') = 'string'
             AND x.s ->> 'step_key' ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$'
             AND pg_catalog.jsonb_typeof(x.s -> 'step_run_id') = 'string'
             AND x.s ->> 'step_run_id' ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$'
             AND pg_catalog.jsonb_typeof(x.s -> 'task_key') = 'string'
             AND x.s ->> 'task_key' ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,35}$'
             AND pg_catalog.jsonb_typeof(x.s -> 'task_reference') = 'string'
             AND pg_catalog.octet_length(x.s ->> 'task_reference') BETWEEN 1 AND 256
             AND pg_catalog.jsonb_typeof(x.s -> 'source_digest') = 'string'
             AND x.s ->> 'source_digest' ~ '^[0-9a-f]{64}$'
             AND pg_catalog.jsonb_typeof(x.s -> 'initial_status') = 'string'
             AND x.s ->> 'initial_status' IN ('pending', 'ready')
             AND pg_catalog.jsonb_typeof(x.s -> 'needs') = 'array'
             AND x.needs_ok
             AND (x.s ->> 'initial_status' = 'ready') = (x.n = '[]'::jsonb))
           AND pg_catalog.count(DISTINCT x.s ->> 'step_key') = pg_catalog.count(*)
           AND pg_catalog.count(DISTINCT x.s ->> 'step_run_id') = pg_catalog.count(*),
           pg_catalog.jsonb_object_agg(COALESCE(x.s ->> 'step_key', ''), x.n),
           pg_catalog.jsonb_agg(x.s || pg_catalog.jsonb_build_object('needs', x.n) ORDER BY x.s ->> 'step_key' COLLATE "C"),
           pg_catalog.string_agg(
             '{"initial_status":' || pg_catalog.to_json(x.s ->> 'initial_status')::text
             || ',"needs":' || x.nt
             || ',"source_digest":' || pg_catalog.to_json(x.s ->> 'source_digest')::text
             || ',"step_key":' || pg_catalog.to_json(x.s ->> 'step_key')::text
             || ',"step_run_id":' || pg_catalog.to_json(x.s ->> 'step_run_id')::text
             || ',"task_key":' || pg_catalog.to_json(x.s ->> 'task_key')::text
             || ',"task_reference":' || pg_catalog.to_json(x.s ->> 'task_reference')::text || '}',
             ',' ORDER BY x.s ->> 'step_key' COLLATE "C")
      INTO v_ok, v_dag, v_sorted, v_canon
      FROM (SELECT e.s, nn.n, nn.nt, nn.ok AS needs_ok
              FROM pg_catalog.jsonb_array_elements(d -> 'steps') e(s)
             CROSS JOIN LATERAL (
                   SELECT COALESCE(pg_catalog.jsonb_agg(v ORDER BY v #>> '{}' COLLATE "C"), '[]'::jsonb) AS n,
                          '[' || COALESCE(pg_catalog.string_agg(pg_catalog.to_json(v #>> '{}')::text, ','
                                                                ORDER BY v #>> '{}' COLLATE "C"), '') || ']' AS nt,
                          COALESCE(pg_catalog.bool_and(pg_catalog.jsonb_typeof(v) = 'string'), true)
                            AND pg_catalog.count(*) = pg_catalog.count(DISTINCT v) AS ok
                     FROM pg_catalog.jsonb_array_elements(CASE WHEN pg_catalog.jsonb_typeof(e.s -> 'needs') = 'array'
                                                               THEN e.s -> 'needs' ELSE '[]'::jsonb END) v) nn) x;
  END IF;
  IF v_ok THEN  -- duplicate keys inside a step object (jsonb kept one of them)
    SELECT pg_catalog.bool_and((SELECT pg_catalog.count(*) FROM pg_catalog.json_object_keys(j.s)) = 7) INTO v_ok
      FROM pg_catalog.json_array_elements(p_plan -> 'steps') j(s);
  END IF;
  IF v_ok THEN
    PERFORM ql3.dag_check(v_dag, 'plan.steps');
    plan := (d - 'plan_digest') || pg_catalog.jsonb_build_object('steps', v_sorted);
    -- RFC 8785 text of this fixed shape, written directly (keys in code-unit order; strings escaped by
    -- to_json, which produces the JCS escapes; ids and digests are ASCII): byte-identical to
    -- ql3.canonical_json(plan), which tests/test_plan_vectors.py checks.
    v_canon := '{"generation":' || (d ->> 'generation')
      || ',"installation_id":' || pg_catalog.to_json(d ->> 'installation_id')::text
      || ',"lock_digest":' || pg_catalog.to_json(d ->> 'lock_digest')::text
      || ',"package_id":' || pg_catalog.to_json(d ->> 'package_id')::text
      || ',"project_id":' || pg_catalog.to_json(d ->> 'project_id')::text
      || ',"publication_digest":' || pg_catalog.to_json(d ->> 'publication_digest')::text
      || ',"publication_id":' || pg_catalog.to_json(d ->> 'publication_id')::text
      || ',"revision_digest":' || pg_catalog.to_json(d ->> 'revision_digest')::text
      || ',"run_id":' || pg_catalog.to_json(d ->> 'run_id')::text
      || ',"schema":' || pg_catalog.to_json(d ->> 'schema')::text
      || ',"steps":[' || v_canon || ']'
      || ',"workflow_key":' || pg_catalog.to_json(d ->> 'workflow_key')::text
      || ',"workflow_semantic_digest":' || pg_catalog.to_json(d ->> 'workflow_semantic_digest')::text || '}';
    IF pg_catalog.octet_length(v_canon) > 262144 THEN
      RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = 'plan: canonical form larger than 256 KiB';
    END IF;
    plan_digest := ql3.domain_digest('qinglong/plugin-package-workflow-execution-plan@v1', v_canon);
    IF d ? 'plan_digest' AND (d ->> 'plan_digest') IS DISTINCT FROM plan_digest THEN
      RAISE EXCEPTION USING ERRCODE = 'QL501',
        MESSAGE = pg_catalog.format('plan.plan_digest: %s does not match the recomputed canonical digest %s',
                                    pg_catalog.left(d ->> 'plan_digest', 80), plan_digest);
    END IF;
    RETURN;
  END IF;

  -- Strict path: names the first violated rule (or, for a valid plan the fast path passed on,
  -- normalises it the long way).
  v_dag := '{}'::jsonb;
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
