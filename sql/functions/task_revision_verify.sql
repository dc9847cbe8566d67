CREATE OR REPLACE FUNCTION ql3.task_revision_verify(r ql3.task_execution_revisions) RETURNS ql3.task_execution_revisions
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  v_norm jsonb;
  v_digest text;
  v_canon text;
BEGIN
  -- Fail-closed read (ADR-0023 §3): re-parse, re-normalise, recompute; any defect is QL501.
  BEGIN
    IF r.executor_type IS NULL OR r.executor_type NOT IN ('local_process', 'remote_worker') THEN
      RAISE EXCEPTION 'illegal executor_type';
    END IF;
    IF r.created_at_ms IS NULL OR r.created_at_ms < 0 OR r.created_at_ms > ql3.now_ms() + 86400000 THEN
      RAISE EXCEPTION 'damaged created_at_ms';
    END IF;
    IF r.project_id IS NULL OR r.task_id IS NULL OR r.task_revision IS NULL OR r.content_digest IS NULL THEN
      RAISE EXCEPTION 'missing identity or digest';
    END IF;
    -- Re-normalise the stored template (ExecutionSpec check; QL001/QL002 become QL501 below) and
    -- compare canonical bytes: the stored template must already be exactly its normal form.
    v_norm := ql3.execution_template_normalize(r.execution_template);
    v_canon := ql3.task_revision_canonical(r.project_id, r.task_id, r.task_revision, r.executor_type,
                                           v_norm, r.context_ref);
    IF ql3.task_revision_canonical(r.project_id, r.task_id, r.task_revision, r.executor_type,
                                   r.execution_template, r.context_ref) <> v_canon THEN
      RAISE EXCEPTION 'stored execution_template is not canonical';
    END IF;
    -- Recompute the digest over identity, executor, normalised template and context_ref.
    v_digest := ql3.domain_digest('qinglong/task-execution-revision@v1', v_canon);
    IF v_digest IS DISTINCT FROM r.content_digest THEN
      RAISE EXCEPTION 'content_digest mismatch';
    END IF;
  EXCEPTION WHEN OTHERS THEN
    RAISE EXCEPTION USING ERRCODE = 'QL501',
      MESSAGE = pg_catalog.format('task execution revision (%s, %s, %s) failed verification: %s',
                                  r.project_id, r.task_id, r.task_revision, SQLERRM);
  END;
  RETURN r;
END
$fn$;
COMMENT ON FUNCTION ql3.task_revision_verify(ql3.task_execution_revisions) IS
  'Internal (owner only). Fail-closed verification of a stored Task Execution Revision (ADR-0023 §3): legal executor type, created_at_ms in 0..now+1 day (ms), identity and digest present, a template that re-normalises (ql3.execution_template_normalize) to a form whose canonical bytes equal the stored template''s, and content_digest recomputed over identity, executor type, normalised template and context_ref equal to the stored one. Returns the row unchanged; raises QL501 (message names the identity and the defect, e.g. "content_digest mismatch", "stored execution_template is not canonical", "damaged created_at_ms", "illegal executor_type", or the ExecutionSpec rule that failed) otherwise, including for an all-NULL (missing) row. Source: ADR-0023 §3.';
REVOKE ALL ON FUNCTION ql3.task_revision_verify(ql3.task_execution_revisions) FROM PUBLIC;
