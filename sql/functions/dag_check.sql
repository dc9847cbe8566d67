CREATE OR REPLACE FUNCTION ql3.dag_check(p_needs jsonb, p_field text) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  k text;
  n jsonb;
  v_keys text[];
  v_indeg integer[];
  v_cnt integer[];
  v_off integer[];
  v_dep integer[];
  v_queue integer[];
  v_n integer;
  v_head integer := 1;
  v_done integer := 0;
  i integer;
BEGIN
  -- p_needs: {step_key: [needed step keys]}. Raises QL001 on an unknown need, a self-dependency
  -- or a cycle.
  FOR k, n IN SELECT e.key, e.value FROM pg_catalog.jsonb_each(p_needs) e
               WHERE EXISTS (SELECT 1 FROM pg_catalog.jsonb_array_elements_text(e.value) x
                              WHERE NOT (p_needs ? x) OR x = e.key)
               ORDER BY e.key COLLATE "C" LIMIT 1 LOOP
    IF EXISTS (SELECT 1 FROM pg_catalog.jsonb_array_elements_text(n) x WHERE NOT (p_needs ? x)) THEN
      RAISE EXCEPTION USING ERRCODE = 'QL001',
        MESSAGE = pg_catalog.format('%s.%s.needs: names a step that does not exist', p_field, k);
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'QL001',
      MESSAGE = pg_catalog.format('%s.%s.needs: a step cannot need itself', p_field, k);
  END LOOP;
  -- Kahn's algorithm over integer arrays, O(steps + needs): step i (1-based, byte order of keys)
  -- has v_indeg[i] unmet needs; the steps needing step i are v_dep[v_off[i] .. v_off[i] + v_cnt[i] - 1].
  SELECT pg_catalog.array_agg(u.k ORDER BY u.k COLLATE "C") INTO v_keys FROM pg_catalog.jsonb_object_keys(p_needs) u(k);
  v_n := COALESCE(pg_catalog.cardinality(v_keys), 0);
  WITH idx AS (SELECT u.k, u.i::integer AS i, pg_catalog.jsonb_array_length(p_needs -> u.k) AS indeg
                 FROM pg_catalog.unnest(v_keys) WITH ORDINALITY u(k, i)),
       edges AS (SELECT nd.i AS need_i, dp.i AS dep_i
                   FROM idx dp
                  CROSS JOIN LATERAL pg_catalog.jsonb_array_elements_text(p_needs -> dp.k) x(need)
                   JOIN idx nd ON nd.k = x.need),
       cnt AS (SELECT e.need_i, pg_catalog.count(*)::integer AS c FROM edges e GROUP BY e.need_i)
  SELECT (SELECT pg_catalog.array_agg(idx.indeg ORDER BY idx.i) FROM idx),
         (SELECT pg_catalog.array_agg(COALESCE(cnt.c, 0) ORDER BY idx.i) FROM idx LEFT JOIN cnt ON cnt.need_i = idx.i),
         (SELECT COALESCE(pg_catalog.array_agg(e.dep_i ORDER BY e.need_i, e.dep_i), '{}'::integer[]) FROM edges e),
         (SELECT COALESCE(pg_catalog.array_agg(idx.i ORDER BY idx.i), '{}'::integer[]) FROM idx WHERE idx.indeg = 0)
    INTO v_indeg, v_cnt, v_dep, v_queue;
  v_off := pg_catalog.array_fill(1, ARRAY[GREATEST(v_n, 1)]);
  FOR i IN 2 .. v_n LOOP
    v_off[i] := v_off[i - 1] + v_cnt[i - 1];
  END LOOP;
  WHILE v_head <= pg_catalog.cardinality(v_queue) LOOP
    i := v_queue[v_head];
    v_head := v_head + 1;
    v_done := v_done + 1;
    FOR j IN v_off[i] .. v_off[i] + v_cnt[i] - 1 LOOP
      v_indeg[v_dep[j]] := v_indeg[v_dep[j]] - 1;
      IF v_indeg[v_dep[j]] = 0 THEN
        v_queue := v_queue || v_dep[j];
      END IF;
    END LOOP;
  END LOOP;
  IF v_done < v_n THEN
    RAISE EXCEPTION USING ERRCODE = 'QL001',
      MESSAGE = pg_catalog.format('%s: needs form a cycle among steps %s', p_field,
        (SELECT pg_catalog.string_agg(v_keys[u.i], ', ' ORDER BY v_keys[u.i] COLLATE "C")
           FROM pg_catalog.generate_subscripts(v_indeg, 1) u(i) WHERE v_indeg[u.i] > 0));
  END IF;
END
$fn$;
COMMENT ON FUNCTION ql3.dag_check(jsonb, text) IS
  'Internal (owner only). Checks that p_needs ({step_key: [needed step keys]}) is a DAG: every need names an existing step, no step needs itself, no cycle. Raises QL001 naming p_field and the offending steps: for the first step (byte order) with a bad need, an unknown need before a self-need; for a cycle, every step left over (byte order). Source: ADR-0223 §2.';
REVOKE ALL ON FUNCTION ql3.dag_check(jsonb, text) FROM PUBLIC;
