CREATE OR REPLACE FUNCTION ql3.task_revision_verify(r ql3.task_execution_revisions) RETURNS ql3.task_execution_revisions
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  v_norm jsonb;
  v_digest text;
BEGIN
  -- Fail-closed read (ADR-0023 §3): re-parse, re-normalise, recompute; any defect is QL501.
  BEGIN
    IF r.executor_type IS NULL OR r.executor_type NOT IN ('local_process', 'remote_worker') THEN
      RAISE EXCEPTION 'illegal executor_type';
    END IF;
    IF r.created_at_ms IS NULL OR r.created_at_ms < 0 OR r.created_at_ms > ql3.now_ms() + 86400000 THEN
      RAISE EXCEPTION 'damaged created_at_ms';
    END IF;
    v_norm := ql3.execution_template_normalize(r.execution_template);
    IF ql3.canonical_json(v_norm::json) <> ql3.canonical_json(r.execution_template::json) THEN
      RAISE EXCEPTION 'stored execution_template is not canonical';
    END IF;
    v_digest := ql3.execution_revision_digest(r.project_id, r.task_id, r.task_revision, r.executor_type,
                                              v_norm, r.context_ref);
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
  'Internal (owner only). Fail-closed verification of a stored Task Execution Revision: legal executor type, sane created_at_ms, template that re-normalises to the identical canonical bytes, and a recomputed content_digest equal to the stored one. Returns the row; raises QL501 otherwise. Source: ADR-0023 §3.';
REVOKE ALL ON FUNCTION ql3.task_revision_verify(ql3.task_execution_revisions) FROM PUBLIC;
