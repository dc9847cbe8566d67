-- ql3.task_revision_canonical(text, text, text, text, jsonb, text) -> text
-- The canonical JSON document a Task Execution Revision's content_digest is computed over
-- (ADR-0023 §3), built directly for a normalised template. Internal helper: not SECURITY DEFINER,
-- granted to no role. Python twin: qlpg.revision.execution_revision_document + canonical_bytes.

CREATE OR REPLACE FUNCTION ql3.task_revision_canonical(
    p_project_id    text,
    p_task_id       text,
    p_task_revision text,
    p_executor_type text,
    p_template      jsonb,
    p_context_ref   text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    -- Fast path: the template has exactly the shape ql3.execution_template_normalize returns
    -- (known keys only; command/env_names arrays of strings; resource_policy an object of
    -- [a-z0-9_] keys with plain non-negative integers; timeout_ms a plain positive integer;
    -- working_directory a string). Then the RFC 8785 text is a fixed concatenation: keys are
    -- ASCII (byte order = UTF-16 order), strings are escaped by to_json (the escapes
    -- ql3.canonical_json emits) and integers are their digits. Anything else -- never the case
    -- for the callers, which normalise first -- takes the general ql3.canonical_json, so the
    -- result is byte-identical to ql3.canonical_json of the same document either way.
    IF p_project_id IS NULL OR p_task_id IS NULL OR p_task_revision IS NULL OR p_executor_type IS NULL
       OR p_template IS NULL OR pg_catalog.jsonb_typeof(p_template) <> 'object' THEN
        RETURN ql3.canonical_json(pg_catalog.json_build_object(
            'project_id', p_project_id, 'task_id', p_task_id, 'task_revision', p_task_revision,
            'executor_type', p_executor_type, 'execution_template', p_template::json,
            'context_ref', p_context_ref));
    END IF;
    IF NOT (p_template ?& ARRAY['command', 'timeout_ms']
            AND NOT EXISTS (SELECT 1 FROM pg_catalog.jsonb_object_keys(p_template) k
                             WHERE k NOT IN ('command', 'working_directory', 'timeout_ms', 'env_names',
                                             'resource_policy'))
            AND pg_catalog.jsonb_typeof(p_template -> 'command') = 'array'
            AND NOT EXISTS (SELECT 1 FROM pg_catalog.jsonb_array_elements(p_template -> 'command') e
                             WHERE pg_catalog.jsonb_typeof(e) <> 'string')
            AND (p_template -> 'timeout_ms')::text ~ '^[1-9][0-9]{0,14}$'
            AND (NOT p_template ? 'working_directory'
                 OR pg_catalog.jsonb_typeof(p_template -> 'working_directory') = 'string')
            AND (NOT p_template ? 'env_names'
                 OR (pg_catalog.jsonb_typeof(p_template -> 'env_names') = 'array'
                     AND NOT EXISTS (SELECT 1 FROM pg_catalog.jsonb_array_elements(p_template -> 'env_names') e
                                      WHERE pg_catalog.jsonb_typeof(e) <> 'string')))
            AND (NOT p_template ? 'resource_policy'
                 OR (pg_catalog.jsonb_typeof(p_template -> 'resource_policy') = 'object'
                     AND NOT EXISTS (SELECT 1 FROM pg_catalog.jsonb_each(p_template -> 'resource_policy') e
                                      WHERE e.key !~ '^[a-z0-9_]+$'
                                         OR e.value::text !~ '^(0|[1-9][0-9]{0,14})$')))) THEN
        RETURN ql3.canonical_json(pg_catalog.json_build_object(
            'project_id', p_project_id, 'task_id', p_task_id, 'task_revision', p_task_revision,
            'executor_type', p_executor_type, 'execution_template', p_template::json,
            'context_ref', p_context_ref));
    END IF;
    RETURN '{"context_ref":' || COALESCE(pg_catalog.to_json(p_context_ref)::text, 'null')
        || ',"execution_template":{"command":['
        || (SELECT pg_catalog.string_agg(pg_catalog.to_json(a.e)::text, ',' ORDER BY a.o)
              FROM pg_catalog.jsonb_array_elements_text(p_template -> 'command') WITH ORDINALITY a(e, o))
        || ']'
        || CASE WHEN p_template ? 'env_names' THEN
                ',"env_names":[' || COALESCE(
                    (SELECT pg_catalog.string_agg(pg_catalog.to_json(a.e)::text, ',' ORDER BY a.o)
                       FROM pg_catalog.jsonb_array_elements_text(p_template -> 'env_names') WITH ORDINALITY a(e, o)),
                    '') || ']'
           ELSE '' END
        || CASE WHEN p_template ? 'resource_policy' THEN
                ',"resource_policy":{' || COALESCE(
                    (SELECT pg_catalog.string_agg(pg_catalog.to_json(e.key)::text || ':' || e.value::text, ','
                                                  ORDER BY e.key COLLATE "C")
                       FROM pg_catalog.jsonb_each(p_template -> 'resource_policy') e),
                    '') || '}'
           ELSE '' END
        || ',"timeout_ms":' || (p_template -> 'timeout_ms')::text
        || CASE WHEN p_template ? 'working_directory' THEN
                ',"working_directory":' || pg_catalog.to_json(p_template ->> 'working_directory')::text
           ELSE '' END
        || '},"executor_type":' || pg_catalog.to_json(p_executor_type)::text
        || ',"project_id":' || pg_catalog.to_json(p_project_id)::text
        || ',"task_id":' || pg_catalog.to_json(p_task_id)::text
        || ',"task_revision":' || pg_catalog.to_json(p_task_revision)::text
        || '}';
END;
$fn$;

COMMENT ON FUNCTION ql3.task_revision_canonical(text, text, text, text, jsonb, text) IS
'Internal helper. Returns the RFC 8785 canonical text of the document a Task Execution Revision '
'digest covers: {project_id, task_id, task_revision, executor_type, execution_template, '
'context_ref (NULL -> JSON null)}, byte-identical to ql3.canonical_json of that document. '
'p_template must already be normalised (ql3.execution_template_normalize): that shape is '
'concatenated directly (about ten times cheaper than the general walk); any other value falls back '
'to ql3.canonical_json (and its QL001/QL002). Does not validate: callers normalise and check first. '
'Used by ql3.task_revision_write, ql3.task_revision_verify and ql3.execution_revision_digest. '
'Not SECURITY DEFINER, granted to no role. Source: ADR-0023 §3; DESIGN §6.';

REVOKE ALL ON FUNCTION ql3.task_revision_canonical(text, text, text, text, jsonb, text) FROM PUBLIC;
