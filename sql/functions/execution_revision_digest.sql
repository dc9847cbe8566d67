-- ql3.execution_revision_digest(text, text, text, text, jsonb, text) -> text
-- content_digest of a Task Execution Revision (ADR-0023 §3). Internal helper: not SECURITY
-- DEFINER, granted to no role. Python twin: qlpg.revision.execution_revision_digest.

CREATE OR REPLACE FUNCTION ql3.execution_revision_digest(
    p_project_id    text,
    p_task_id       text,
    p_task_revision text,
    p_executor_type text,
    p_template      jsonb,
    p_context_ref   text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF p_project_id IS NULL OR p_project_id = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'project_id: must be a non-empty string';
    ELSIF p_task_id IS NULL OR p_task_id = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'task_id: must be a non-empty string';
    ELSIF p_task_revision IS NULL OR p_task_revision = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'task_revision: must be a non-empty string';
    ELSIF p_executor_type IS NULL OR p_executor_type NOT IN ('local_process', 'remote_worker') THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001',
            MESSAGE = 'executor_type: must be local_process or remote_worker';
    ELSIF p_template IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001', MESSAGE = 'execution_template: is required';
    ELSIF p_context_ref = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001',
            MESSAGE = 'context_ref: must be a non-empty string or null';
    END IF;

    RETURN ql3.domain_digest(
        'qinglong/task-execution-revision@v1',
        ql3.task_revision_canonical(p_project_id, p_task_id, p_task_revision, p_executor_type,
                                    ql3.execution_template_normalize(p_template), p_context_ref));
END;
$fn$;

COMMENT ON FUNCTION ql3.execution_revision_digest(text, text, text, text, jsonb, text) IS
'Internal helper. Takes a Task Execution Revision identity (project_id, task_id, task_revision: '
'non-empty text), executor_type (local_process or remote_worker), an execution template (jsonb, '
'normalized here with ql3.execution_template_normalize, so unknown fields do not change the '
'digest) and an opaque context_ref (text or NULL, stored as JSON null; never empty), and returns '
'content_digest = ql3.domain_digest(''qinglong/task-execution-revision@v1'', ql3.canonical_json('
'{project_id, task_id, task_revision, executor_type, execution_template, context_ref})) -- the '
'canonical text is built by ql3.task_revision_canonical, byte-identical to ql3.canonical_json: 64 '
'lowercase hex chars. Raises QL001 for NULL/empty identity fields, an unknown executor_type, an '
'empty context_ref or an invalid template, and QL002 for template bounds (see '
'ql3.execution_template_normalize). Not STRICT (context_ref may be NULL). Not SECURITY DEFINER, '
'granted to no role. Source: ADR-0023 §3; DESIGN §6.';

REVOKE ALL ON FUNCTION ql3.execution_revision_digest(text, text, text, text, jsonb, text) FROM PUBLIC;
