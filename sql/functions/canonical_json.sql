-- ql3.canonical_json(json) -> text
-- RFC 8785 (JCS) canonical JSON, restricted per DESIGN §6. Internal helper: not SECURITY DEFINER,
-- granted to no role; SECURITY DEFINER functions owned by ql3_migration call it.
--
-- Layout: ql3.canonical_json does the work in one set-based query (recursive walk, tokens ordered
-- by sort path) inside one exception block that maps any internal PostgreSQL error to QL001;
-- ql3._canonical_json_locate runs only on that error path, to name the JSON path of a string whose
-- escapes PostgreSQL cannot decode (\u0000, lone surrogates).

CREATE OR REPLACE FUNCTION ql3._canonical_json_locate(p_doc json, p_path text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
STRICT
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    r     record;
    v_sub text;
    v_dummy text;
    v_child text;
BEGIN
    IF pg_catalog.json_typeof(p_doc) = 'object' THEN
        BEGIN
            PERFORM pg_catalog.count(*) FROM pg_catalog.json_each(p_doc);
        EXCEPTION WHEN others THEN
            -- PostgreSQL decodes every escape of an object's whole subtree when it enumerates the
            -- object, so the culprit cannot be isolated below this object.
            RETURN p_path || ': a key or string in this object is not valid unicode text '
                          || '(\u0000 or lone surrogate)';
        END;
        FOR r IN SELECT o.key, o.value FROM pg_catalog.json_each(p_doc) AS o(key, value) LOOP
            v_child := p_path || CASE WHEN r.key ~ '^[A-Za-z_][A-Za-z0-9_]*$' THEN '.' || r.key
                                      ELSE '[' || pg_catalog.to_json(r.key)::text || ']' END;
            v_sub := ql3._canonical_json_locate(r.value, v_child);
            IF v_sub IS NOT NULL THEN RETURN v_sub; END IF;
        END LOOP;
    ELSIF pg_catalog.json_typeof(p_doc) = 'array' THEN
        FOR r IN SELECT a.value, a.ord
                   FROM pg_catalog.json_array_elements(p_doc) WITH ORDINALITY AS a(value, ord) LOOP
            v_sub := ql3._canonical_json_locate(r.value, p_path || '[' || (r.ord - 1)::text || ']');
            IF v_sub IS NOT NULL THEN RETURN v_sub; END IF;
        END LOOP;
    ELSIF pg_catalog.json_typeof(p_doc) = 'string' THEN
        BEGIN
            v_dummy := p_doc #>> '{}';
        EXCEPTION WHEN others THEN
            RETURN p_path || ': string is not valid unicode text (\u0000 or lone surrogate)';
        END;
    END IF;
    RETURN NULL;
END;
$fn$;

COMMENT ON FUNCTION ql3._canonical_json_locate(json, text) IS
'Internal error-path helper of ql3.canonical_json: returns "<json path>: <rule>" for the first '
'string whose escapes cannot be decoded to text (\u0000, lone surrogate) -- inside an object, the path of the '
'outermost object below the last array, which PostgreSQL cannot enumerate -- or NULL. '
'Raises nothing. Do not call directly. Source: DESIGN §6.';

REVOKE ALL ON FUNCTION ql3._canonical_json_locate(json, text) FROM PUBLIC;


CREATE OR REPLACE FUNCTION ql3.canonical_json(p_doc json)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
STRICT
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    v_out   text;
    v_deep  text;
    v_err   text;
    v_dup   text;
    v_state text;
    v_msg   text;
    v_where text;
BEGIN
    -- One set-based pass over the whole document (no per-node function calls):
    --  * walk: every value with its sort path (bytea: per level, the member key's UTF-16-ordered
    --    bytes, or the array index as 16 hex digits, each segment followed by 0x00 -- keys are
    --    text and never contain 0x00, so a key that is a prefix of another sorts first), its
    --    display path and its depth;
    --  * every value emits an "open" token (",", "key":, then the scalar or "{" / "["), every
    --    container a "close" token at sort path || 0xff (after all its children: no segment
    --    starts with 0xff); ordering all tokens by sort path yields the JCS text.
    WITH RECURSIVE walk(spath, ppath, jpath, depth, key, value, typ) AS (
        SELECT ''::bytea, NULL::bytea, '$'::text, 1, NULL::text, p_doc,
               pg_catalog.json_typeof(p_doc)
      UNION ALL
        SELECT w.spath || c.sk || '\x00'::bytea, w.spath, w.jpath || c.seg, w.depth + 1, c.key, c.value,
               pg_catalog.json_typeof(c.value)
          FROM walk w
         CROSS JOIN LATERAL (
               SELECT o.key, o.value,
                      CASE WHEN o.key ~ '[\uE000-\uFFFF]' THEN
                        -- RFC 8785 §3.2.3 orders keys by UTF-16 code units. That equals UTF-8 byte
                        -- order except that U+E000..U+FFFF sort after all supplementary characters
                        -- (their surrogates D800-DFFF precede E000). Their UTF-8 lead bytes EE/EF
                        -- occur nowhere else; moving them to F8/F9 (unused in UTF-8) gives UTF-16
                        -- order bytewise.
                        (SELECT pg_catalog.string_agg(
                                  CASE WHEN pg_catalog.ascii(s.ch) BETWEEN 57344 AND 65535
                                       THEN pg_catalog.set_byte(pg_catalog.convert_to(s.ch, 'UTF8'), 0,
                                              pg_catalog.get_byte(pg_catalog.convert_to(s.ch, 'UTF8'), 0) + 10)
                                       ELSE pg_catalog.convert_to(s.ch, 'UTF8') END,
                                  ''::bytea ORDER BY s.i)
                           FROM pg_catalog.regexp_split_to_table(o.key, '') WITH ORDINALITY AS s(ch, i))
                      ELSE pg_catalog.convert_to(o.key, 'UTF8') END AS sk,
                      CASE WHEN o.key ~ '^[A-Za-z_][A-Za-z0-9_]*$' THEN '.' || o.key
                           ELSE '[' || pg_catalog.to_json(o.key)::text || ']' END AS seg
                 FROM pg_catalog.json_each(CASE WHEN w.typ = 'object' THEN w.value END) AS o(key, value)
               UNION ALL
               SELECT NULL::text, a.value, pg_catalog.convert_to(pg_catalog.lpad(pg_catalog.to_hex(a.ord), 16, '0'), 'UTF8'),
                      '[' || (a.ord - 1)::text || ']'
                 FROM pg_catalog.json_array_elements(CASE WHEN w.typ = 'array' THEN w.value END)
                      WITH ORDINALITY AS a(value, ord)
         ) c
         WHERE w.typ IN ('object', 'array') AND w.depth <= 32
    ), nodes AS (
        SELECT w.*,
               CASE WHEN w.typ = 'number' THEN w.value::text END AS num,
               pg_catalog.row_number() OVER (PARTITION BY w.ppath ORDER BY w.spath) AS sib,
               pg_catalog.count(*) OVER (PARTITION BY w.ppath, w.spath) AS same
          FROM walk w
    ), checked AS (
        SELECT n.*,
               CASE
                 WHEN n.typ <> 'number' THEN NULL
                 WHEN n.num !~ '^-?(0|[1-9][0-9]*)$'
                   THEN 'number must be an integer without fraction or exponent (got '
                        || pg_catalog.left(n.num, 40) || ')'
                 WHEN pg_catalog.length(n.num) > 17
                      OR pg_catalog.abs(n.num::numeric) > 9007199254740991
                   THEN 'integer out of range +-(2^53-1) (got ' || pg_catalog.left(n.num, 40) || ')'
               END AS err
          FROM nodes n
    ), tokens AS (
        SELECT c.spath,
               CASE WHEN c.sib > 1 THEN ',' ELSE '' END
               || CASE WHEN c.key IS NOT NULL THEN pg_catalog.to_json(c.key)::text || ':' ELSE '' END
               || CASE c.typ
                    WHEN 'object'  THEN '{'
                    WHEN 'array'   THEN '['
                    WHEN 'string'  THEN pg_catalog.to_json(c.value #>> '{}')::text
                    WHEN 'number'  THEN CASE WHEN c.err IS NOT NULL THEN ''
                                             WHEN c.num = '-0' THEN '0'
                                             ELSE c.num END
                    WHEN 'boolean' THEN c.value::text
                    ELSE 'null'
                  END AS tok
          FROM checked c
        UNION ALL
        SELECT c.spath || '\xff'::bytea, CASE c.typ WHEN 'object' THEN '}' ELSE ']' END
          FROM checked c
         WHERE c.typ IN ('object', 'array')
    )
    SELECT (SELECT pg_catalog.string_agg(t.tok, '' ORDER BY t.spath) FROM tokens t),
           (SELECT pg_catalog.min(c.jpath) FROM checked c
             WHERE c.typ IN ('object', 'array') AND c.depth > 32),
           (SELECT c.jpath || ': ' || c.err FROM checked c
             WHERE c.err IS NOT NULL ORDER BY c.spath LIMIT 1),
           (SELECT c.jpath FROM checked c WHERE c.same > 1 ORDER BY c.spath LIMIT 1)
      INTO v_out, v_deep, v_err, v_dup;

    IF v_deep IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'QL002',
            MESSAGE = v_deep || ': nesting depth exceeds 32 levels';
    ELSIF v_err IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = v_err;
    ELSIF v_dup IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = v_dup || ': duplicate object key';
    END IF;
    RETURN v_out;
EXCEPTION
    WHEN SQLSTATE 'QL001' OR SQLSTATE 'QL002' OR query_canceled THEN
        RAISE;
    WHEN program_limit_exceeded OR statement_too_complex OR out_of_memory THEN
        RAISE EXCEPTION USING ERRCODE = 'QL002',
            MESSAGE = '$: document too large or too deeply nested';
    WHEN others THEN
        GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT;
        v_where := ql3._canonical_json_locate(p_doc, '$');
        RAISE EXCEPTION USING ERRCODE = 'QL001',
            MESSAGE = COALESCE(v_where,
                        '$: invalid JSON for canonical form (' || v_state || ': ' || v_msg || ')');
END;
$fn$;

COMMENT ON FUNCTION ql3.canonical_json(json) IS
'Internal helper. Takes a json document (parsed as json, not jsonb, so duplicate keys are seen) and '
'returns its RFC 8785 (JCS) canonical text restricted per DESIGN §6: objects with unique keys '
'sorted by UTF-16 code units, arrays, strings, true/false/null and integers within +-(2^53-1) '
'(-0 becomes 0); strings escape only ", \, \b \f \n \r \t and other controls < 0x20 as \u00xx '
'(lowercase hex), everything else literal (incl. /, U+007F, U+2028/2029, non-ASCII). '
'Raises QL001 (message names the JSON path, e.g. $.steps[3].needs, and the rule) for numbers with '
'fraction or exponent (even 1.0, 1e2), integers out of range, duplicate keys, \u0000 or lone '
'surrogates, and maps any other internal error to QL001; raises QL002 when containers nest deeper '
'than 32 levels (top-level container = level 1). When several rules are violated, which one is '
'reported is unspecified. STRICT: SQL NULL in gives SQL NULL out (JSON null gives ''null''); '
'callers must reject NULL themselves. Not SECURITY DEFINER, granted to no role. '
'Source: DESIGN §6; ADR-0023 §3.';

REVOKE ALL ON FUNCTION ql3.canonical_json(json) FROM PUBLIC;


CREATE OR REPLACE FUNCTION ql3.canonical_json(p_doc jsonb)
RETURNS text
LANGUAGE sql
IMMUTABLE
STRICT
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT ql3.canonical_json(p_doc::pg_catalog.json);
$fn$;

COMMENT ON FUNCTION ql3.canonical_json(jsonb) IS
'Internal helper: ql3.canonical_json(json) for a jsonb value built inside the database (e.g. by '
'jsonb_build_object). jsonb has already collapsed duplicate keys and turned 1e2 into 100, so use '
'the json variant for untrusted input where those must be rejected; 1.0 is still rejected (QL001). '
'Same result, errors (QL001, QL002) and STRICT behaviour as the json variant. Not SECURITY '
'DEFINER, granted to no role. Source: DESIGN §6.';

REVOKE ALL ON FUNCTION ql3.canonical_json(jsonb) FROM PUBLIC;
