CREATE OR REPLACE FUNCTION ql3.attempt_claim_digest(e jsonb, rev ql3.task_execution_revisions) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  -- The digest of a caller's execution revision claim e (shape already checked). When e equals
  -- the verified stored revision rev field by field (jsonb equality: same types, same values,
  -- no extra template field), its digest is rev.content_digest, which ql3.task_revision_verify
  -- recomputed from exactly this content; otherwise it is recomputed from e in full (normalising
  -- the template: unknown fields dropped, defaults applied), as ADR-0227 §1 requires.
  IF rev.project_id IS NOT NULL
     AND (e - 'content_digest' - 'context_ref') = pg_catalog.jsonb_build_object(
           'project_id', rev.project_id, 'task_id', rev.task_id, 'task_revision', rev.task_revision,
           'executor_type', rev.executor_type, 'execution_template', rev.execution_template)
     AND (e ->> 'context_ref') IS NOT DISTINCT FROM rev.context_ref THEN
    RETURN rev.content_digest;
  END IF;
  RETURN ql3.execution_revision_digest(ql3.json_text(e, 'project_id', 'execution_revision', 36),
    ql3.json_text(e, 'task_id', 'execution_revision', 128), ql3.json_text(e, 'task_revision', 'execution_revision', 128),
    e ->> 'executor_type', e -> 'execution_template', e ->> 'context_ref');
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_claim_digest(jsonb, ql3.task_execution_revisions) IS
  'Internal (owner only). The content digest of a caller-supplied execution revision claim: the stored revision''s verified content_digest when the claim equals that verified row field by field (jsonb equality), else recomputed in full by ql3.execution_revision_digest (template normalised). Never trusts a claimed content_digest. Source: ADR-0227 §1, DESIGN §6.';
REVOKE ALL ON FUNCTION ql3.attempt_claim_digest(jsonb, ql3.task_execution_revisions) FROM PUBLIC;
