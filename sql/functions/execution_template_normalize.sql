-- ql3.execution_template_normalize(jsonb) -> jsonb
-- ExecutionSpec boundary check for Task Execution Revisions (ADR-0023 §3). Internal helper: not
-- SECURITY DEFINER, granted to no role. Python twin: qlpg.revision.normalize_execution_template
-- (same rules, same field paths in messages); tests/vectors/execution_revision.json binds both.

CREATE OR REPLACE FUNCTION ql3.execution_template_normalize(p_template jsonb)
RETURNS jsonb
LANGUAGE plpgsql
IMMUTABLE
STRICT
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    c_max_int   constant numeric := 9007199254740991::numeric;
    v_out       jsonb := '{}'::jsonb;
    v_val       jsonb;
    v_elem      jsonb;
    v_txt       text;
    v_n         integer;
    v_seen      text[] := ARRAY[]::text[];
    v_key       text;
    v_path      text;
BEGIN
    IF pg_catalog.jsonb_typeof(p_template) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001',
            MESSAGE = 'execution_template: must be a JSON object';
    END IF;

    -- Secrets rule (ADR-0023 §1/§3): the template never stores environment values. Unknown fields
    -- are dropped, but silently dropping an env/environment map would hide a secret-handling
    -- mistake, so a non-null value under either name is rejected.
    FOREACH v_key IN ARRAY ARRAY['env', 'environment'] LOOP
        IF pg_catalog.jsonb_typeof(p_template -> v_key) IS NOT NULL
           AND pg_catalog.jsonb_typeof(p_template -> v_key) <> 'null' THEN
            RAISE EXCEPTION USING ERRCODE = 'QL001',
                MESSAGE = 'execution_template.' || v_key
                          || ': environment values are not allowed; use env_names';
        END IF;
    END LOOP;

    -- command: required, 1..256 non-empty strings of at most 4096 UTF-8 bytes each.
    v_val := p_template -> 'command';
    IF v_val IS NULL OR pg_catalog.jsonb_typeof(v_val) = 'null' THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'execution_template.command: is required';
    ELSIF pg_catalog.jsonb_typeof(v_val) <> 'array' OR pg_catalog.jsonb_array_length(v_val) = 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001',
            MESSAGE = 'execution_template.command: must be a non-empty array of strings';
    ELSIF pg_catalog.jsonb_array_length(v_val) > 256 THEN
        RAISE EXCEPTION USING ERRCODE = 'QL002',
            MESSAGE = 'execution_template.command: more than 256 entries';
    END IF;
    v_n := pg_catalog.jsonb_array_length(v_val);
    FOR v_i IN 0 .. v_n - 1 LOOP
        v_elem := v_val -> v_i;
        v_path := 'execution_template.command[' || v_i::text || ']';
        IF pg_catalog.jsonb_typeof(v_elem) <> 'string' OR pg_catalog.length(v_elem #>> '{}') = 0 THEN
            RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = v_path || ': must be a non-empty string';
        ELSIF pg_catalog.octet_length(pg_catalog.convert_to(v_elem #>> '{}', 'UTF8')) > 4096 THEN
            RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = v_path || ': longer than 4096 bytes';
        END IF;
    END LOOP;
    v_out := v_out || pg_catalog.jsonb_build_object('command', v_val);

    -- working_directory: optional non-empty string of at most 4096 bytes.
    v_val := p_template -> 'working_directory';
    IF v_val IS NOT NULL AND pg_catalog.jsonb_typeof(v_val) <> 'null' THEN
        IF pg_catalog.jsonb_typeof(v_val) <> 'string' OR (v_val #>> '{}') = '' THEN
            RAISE EXCEPTION USING ERRCODE = 'QL001',
                MESSAGE = 'execution_template.working_directory: must be a non-empty string';
        ELSIF pg_catalog.octet_length(pg_catalog.convert_to(v_val #>> '{}', 'UTF8')) > 4096 THEN
            RAISE EXCEPTION USING ERRCODE = 'QL002',
                MESSAGE = 'execution_template.working_directory: longer than 4096 bytes';
        END IF;
        v_out := v_out || pg_catalog.jsonb_build_object('working_directory', v_val);
    END IF;

    -- timeout_ms: required integer 1..86400000 (milliseconds).
    v_val := p_template -> 'timeout_ms';
    IF v_val IS NULL OR pg_catalog.jsonb_typeof(v_val) = 'null' THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'execution_template.timeout_ms: is required';
    ELSIF (CASE WHEN pg_catalog.jsonb_typeof(v_val) <> 'number' THEN true
               WHEN v_val::text !~ '^-?[0-9]{1,17}$' THEN true
               ELSE v_val::text::numeric NOT BETWEEN 1 AND 86400000 END) THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001',
            MESSAGE = 'execution_template.timeout_ms: must be an integer from 1 to 86400000 (milliseconds)';
    END IF;
    v_out := v_out || pg_catalog.jsonb_build_object('timeout_ms', v_val);

    -- env_names: optional array of at most 128 unique bare variable names (never values).
    v_val := p_template -> 'env_names';
    IF v_val IS NOT NULL AND pg_catalog.jsonb_typeof(v_val) <> 'null' THEN
        IF pg_catalog.jsonb_typeof(v_val) <> 'array' THEN
            RAISE EXCEPTION USING ERRCODE = 'QL001',
                MESSAGE = 'execution_template.env_names: must be an array of variable names';
        ELSIF pg_catalog.jsonb_array_length(v_val) > 128 THEN
            RAISE EXCEPTION USING ERRCODE = 'QL002',
                MESSAGE = 'execution_template.env_names: more than 128 entries';
        END IF;
        v_n := pg_catalog.jsonb_array_length(v_val);
        FOR v_i IN 0 .. v_n - 1 LOOP
            v_elem := v_val -> v_i;
            v_path := 'execution_template.env_names[' || v_i::text || ']';
            IF pg_catalog.jsonb_typeof(v_elem) <> 'string' THEN
                RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = v_path || ': must be a string';
            END IF;
            v_txt := v_elem #>> '{}';
            IF pg_catalog.strpos(v_txt, '=') > 0 THEN
                RAISE EXCEPTION USING ERRCODE = 'QL001',
                    MESSAGE = v_path || ': must be a bare variable name; NAME=value pairs are not allowed (secrets never enter the template)';
            ELSIF v_txt !~ '^[A-Za-z_][A-Za-z0-9_]{0,127}$' THEN
                RAISE EXCEPTION USING ERRCODE = 'QL001',
                    MESSAGE = v_path || ': must match ^[A-Za-z_][A-Za-z0-9_]{0,127}$';
            ELSIF v_txt = ANY (v_seen) THEN
                RAISE EXCEPTION USING ERRCODE = 'QL001',
                    MESSAGE = v_path || ': duplicate name ' || v_txt;
            END IF;
            v_seen := v_seen || v_txt;
        END LOOP;
        v_out := v_out || pg_catalog.jsonb_build_object('env_names', v_val);
    END IF;

    -- resource_policy: optional object, at most 16 keys ^[a-z][a-z0-9_]{0,63}$, integer values
    -- 0..2^53-1 (units are part of the key name, e.g. max_output_bytes).
    v_val := p_template -> 'resource_policy';
    IF v_val IS NOT NULL AND pg_catalog.jsonb_typeof(v_val) <> 'null' THEN
        IF pg_catalog.jsonb_typeof(v_val) <> 'object' THEN
            RAISE EXCEPTION USING ERRCODE = 'QL001',
                MESSAGE = 'execution_template.resource_policy: must be a JSON object';
        END IF;
        SELECT pg_catalog.count(*)::integer INTO v_n FROM pg_catalog.jsonb_object_keys(v_val);
        IF v_n > 16 THEN
            RAISE EXCEPTION USING ERRCODE = 'QL002',
                MESSAGE = 'execution_template.resource_policy: more than 16 keys';
        END IF;
        FOR v_key, v_elem IN
            SELECT e.key, e.value FROM pg_catalog.jsonb_each(v_val) AS e(key, value)
             ORDER BY e.key COLLATE "C"
        LOOP
            IF v_key !~ '^[a-z][a-z0-9_]{0,63}$' THEN
                RAISE EXCEPTION USING ERRCODE = 'QL001',
                    MESSAGE = 'execution_template.resource_policy[' || pg_catalog.to_json(v_key)::text
                              || ']: key must match ^[a-z][a-z0-9_]{0,63}$';
            ELSIF (CASE WHEN pg_catalog.jsonb_typeof(v_elem) <> 'number' THEN true
                       WHEN v_elem::text !~ '^[0-9]{1,17}$' THEN true
                       ELSE v_elem::text::numeric > c_max_int END) THEN
                RAISE EXCEPTION USING ERRCODE = 'QL001',
                    MESSAGE = 'execution_template.resource_policy.' || v_key
                              || ': must be an integer from 0 to 9007199254740991';
            END IF;
        END LOOP;
        v_out := v_out || pg_catalog.jsonb_build_object('resource_policy', v_val);
    END IF;

    RETURN v_out;
END;
$fn$;

COMMENT ON FUNCTION ql3.execution_template_normalize(jsonb) IS
'Internal helper: the ExecutionSpec boundary check of ADR-0023 §3. Takes an execution template '
'(jsonb object) and returns a new object holding only the known fields that are present: '
'command (required; 1..256 non-empty strings, each at most 4096 UTF-8 bytes), working_directory '
'(optional non-empty string, at most 4096 bytes), timeout_ms (required integer 1..86400000, '
'milliseconds), env_names (optional array of at most 128 unique names matching '
'^[A-Za-z_][A-Za-z0-9_]{0,127}$; names only, never values) and resource_policy (optional object of '
'at most 16 keys matching ^[a-z][a-z0-9_]{0,63}$ with integer values 0..2^53-1, units in the key '
'name, e.g. max_output_bytes). Unknown top-level fields are dropped; an optional field given as '
'JSON null is treated as absent; no defaults are inserted; array order is kept. Decision: a '
'non-null top-level env or environment field is rejected (QL001, "environment values are not '
'allowed; use env_names") instead of being dropped, because silently dropping secrets hides a '
'mistake; an env_names entry containing "=" or that is not a bare name is rejected likewise. '
'Raises QL001 for a non-object template or a field of the wrong type, format or range, and QL002 '
'when a count or byte-length bound is exceeded; messages name the field, e.g. '
'execution_template.command[2]. Input is jsonb, so duplicate keys are already collapsed and 1e2 '
'arrives as 100; 1.0 is rejected. STRICT: SQL NULL in gives NULL out; callers reject NULL. '
'Not SECURITY DEFINER, granted to no role. Source: ADR-0023 §1, §3; DESIGN §6.';

REVOKE ALL ON FUNCTION ql3.execution_template_normalize(jsonb) FROM PUBLIC;
