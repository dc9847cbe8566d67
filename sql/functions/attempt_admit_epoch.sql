CREATE OR REPLACE FUNCTION ql3.attempt_admit_epoch(p_run_id text, p_step_run_id text, p_step_run_version integer,
                                                   p_step_run_digest text, p_execution_revision jsonb,
                                                   p_soft boolean DEFAULT false)
RETURNS TABLE (attempt_id text, attempt integer, event_id text, receipt jsonb, receipt_digest text,
               replayed boolean, skipped text)
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_variable
DECLARE
  r ql3.runs;
  x record;
  ad ql3.task_attempt_admissions;
  rev ql3.task_execution_revisions;
  v_claim_digest text;
  v_ids record;
  v_attempt integer;
  ev record;
  v_receipt jsonb;
  v_receipt_digest text;
  e jsonb := p_execution_revision;
BEGIN
  -- Caller holds the package/publisher boundaries (shared) and the Run lock, and has checked the
  -- shape of p_execution_revision. p_execution_revision NULL (page admission) means: admit the
  -- revision derived from the generation-bound reconciliation item (there is no caller claim).
  -- p_soft: an epoch that moved since the caller read it (stale version/digest, not ready, Run
  -- cancelled or ended, live attempt) is answered with skipped = <reason> instead of an error.

  -- Exact replay of the same ready epoch returns the identical receipt.
  SELECT * INTO ad FROM ql3.task_attempt_admissions t
   WHERE t.run_id = p_run_id AND t.step_run_id = p_step_run_id AND t.step_run_version = p_step_run_version;
  IF FOUND THEN
    IF e IS NOT NULL THEN
      SELECT * INTO rev FROM ql3.task_execution_revisions t
       WHERE t.project_id = (SELECT rr.project_id FROM ql3.runs rr WHERE rr.id = p_run_id) AND t.task_id = ad.runtime_task_id AND t.task_revision = ad.task_revision;
      v_claim_digest := ql3.attempt_claim_digest(e, ql3.attempt_revision_verify(rev));
    END IF;
    IF (e IS NOT NULL AND ad.execution_digest <> v_claim_digest) OR ad.receipt ->> 'step_run_digest' <> p_step_run_digest THEN
      RAISE EXCEPTION USING ERRCODE = 'QL201',
        MESSAGE = pg_catalog.format('epoch (%s, %s, %s) was admitted with another execution revision or StepRun digest',
                                    p_run_id, p_step_run_id, p_step_run_version);
    END IF;
    RETURN QUERY SELECT ad.attempt_id, ad.attempt, ad.event_id, ad.receipt, ad.receipt_digest, true, NULL::text;
    RETURN;
  END IF;

  x := ql3.step_execution_revision(p_run_id, p_step_run_id);
  r := x.run;
  IF r.status <> 'running' THEN
    IF p_soft THEN RETURN QUERY SELECT NULL::text, NULL::integer, NULL::text, NULL::jsonb, NULL::text, false, 'run_ended'; RETURN; END IF;
    RAISE EXCEPTION USING ERRCODE = 'QL203', MESSAGE = pg_catalog.format('run %s is %s, not running', p_run_id, r.status);
  END IF;
  IF r.cancel_requested_at_ms IS NOT NULL THEN
    IF p_soft THEN RETURN QUERY SELECT NULL::text, NULL::integer, NULL::text, NULL::jsonb, NULL::text, false, 'cancel_requested'; RETURN; END IF;
    RAISE EXCEPTION USING ERRCODE = 'QL203', MESSAGE = pg_catalog.format('run %s has a cancel request: admission is frozen', p_run_id);
  END IF;
  PERFORM ql3.start_guard(r.project_id, r.package_id, r.publisher_id, NULL);
  IF (x.step).version <> p_step_run_version THEN
    IF p_soft THEN RETURN QUERY SELECT NULL::text, NULL::integer, NULL::text, NULL::jsonb, NULL::text, false, 'stale_version'; RETURN; END IF;
    RAISE EXCEPTION USING ERRCODE = 'QL202',
      MESSAGE = pg_catalog.format('step run %s: version %s is stale (current %s)', p_step_run_id, p_step_run_version, (x.step).version);
  END IF;
  IF (x.step).status <> 'ready' THEN
    IF p_soft THEN RETURN QUERY SELECT NULL::text, NULL::integer, NULL::text, NULL::jsonb, NULL::text, false, 'not_ready'; RETURN; END IF;
    RAISE EXCEPTION USING ERRCODE = 'QL203', MESSAGE = pg_catalog.format('step run %s is %s, not ready', p_step_run_id, (x.step).status);
  END IF;
  IF (x.step).digest <> ql3.step_run_digest(p_run_id, p_step_run_id, (x.step).step_key, (x.step).task_key, (x.step).status,
                                            (x.step).version, (x.step).attempt_count, (x.step).ready_at_ms) THEN
    RAISE EXCEPTION USING ERRCODE = 'QL501', MESSAGE = pg_catalog.format('step run %s: stored digest does not verify', p_step_run_id);
  END IF;
  IF (x.step).digest <> p_step_run_digest THEN
    IF p_soft THEN RETURN QUERY SELECT NULL::text, NULL::integer, NULL::text, NULL::jsonb, NULL::text, false, 'stale_digest'; RETURN; END IF;
    RAISE EXCEPTION USING ERRCODE = 'QL202', MESSAGE = pg_catalog.format('step run %s: digest %s is stale', p_step_run_id, p_step_run_digest);
  END IF;
  IF e IS NOT NULL THEN
    -- The caller's claim must be exactly the generation-bound revision: same identity, same
    -- executor type and the same digest, which SQL recomputes (never trusting a claimed one).
    v_claim_digest := ql3.attempt_claim_digest(e, x.revision);
    IF e ->> 'project_id' <> (x.revision).project_id OR e ->> 'task_id' <> (x.item).runtime_task_id
       OR e ->> 'task_revision' <> (x.item).task_revision OR e ->> 'executor_type' <> (x.item).executor_type
       OR v_claim_digest <> (x.item).execution_digest THEN
      RAISE EXCEPTION USING ERRCODE = 'QL202',
        MESSAGE = pg_catalog.format('execution revision disagrees with the generation-bound reconciliation item (expected %s %s %s)',
                                    (x.item).runtime_task_id, (x.item).task_revision, (x.item).executor_type);
    END IF;
  END IF;
  IF EXISTS (SELECT 1 FROM ql3.run_attempts ra WHERE ra.step_run_id = p_step_run_id
              AND ra.status IN ('claimed', 'starting', 'running')) THEN
    IF p_soft THEN RETURN QUERY SELECT NULL::text, NULL::integer, NULL::text, NULL::jsonb, NULL::text, false, 'live_attempt'; RETURN; END IF;
    RAISE EXCEPTION USING ERRCODE = 'QL203', MESSAGE = pg_catalog.format('step run %s already has a live attempt', p_step_run_id);
  END IF;
  v_attempt := r.last_attempt + 1;
  IF v_attempt > 8192 THEN
    RAISE EXCEPTION USING ERRCODE = 'QL002', MESSAGE = pg_catalog.format('run %s: attempt number would exceed 8192', p_run_id);
  END IF;
  v_ids := ql3.attempt_ids(r.plan_digest, p_step_run_id, p_step_run_version);
  -- One event, one CAS of the Run (version, event_sequence, last_attempt) under the Run lock.
  -- (ql3.run_event_append inlined, so that last_attempt moves in the same UPDATE of the runs row)
  UPDATE ql3.runs rr
     SET version = rr.version + 1, event_sequence = rr.event_sequence + 1, last_attempt = v_attempt,
         observed_at_ms = GREATEST(rr.observed_at_ms, ql3.now_ms())
   WHERE rr.id = p_run_id AND rr.version = r.version
  RETURNING rr.event_sequence AS sequence, rr.observed_at_ms AS at_ms, rr.version INTO ev;
  IF ev.sequence IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'QL202', MESSAGE = pg_catalog.format('run %s: version moved under the Run lock', p_run_id);
  END IF;
  INSERT INTO ql3.run_events (run_id, sequence, type, step_run_id, attempt_id, payload, at_ms)
  VALUES (p_run_id, ev.sequence, 'workflow.task_attempt_admitted', p_step_run_id, v_ids.attempt_id,
          pg_catalog.jsonb_build_object('event_id', v_ids.event_id, 'attempt', v_attempt,
                                        'step_run_version', p_step_run_version, 'executor_type', (x.item).executor_type),
          ev.at_ms);
  v_receipt := pg_catalog.jsonb_build_object(
    'schema', 'qinglong/plugin-package-workflow-task-attempt-receipt@v1',
    'run_id', p_run_id, 'plan_digest', r.plan_digest,
    'step_run_id', p_step_run_id, 'step_run_version', p_step_run_version, 'step_run_digest', (x.step).digest,
    'reconciliation_receipt_digest', x.reconciliation_receipt_digest,
    'runtime_task_id', (x.item).runtime_task_id, 'task_revision', (x.item).task_revision,
    'task_definition_digest', (x.item).definition_digest, 'execution_digest', (x.item).execution_digest,
    'executor_type', (x.item).executor_type,
    'attempt_id', v_ids.attempt_id, 'attempt', v_attempt, 'event_id', v_ids.event_id,
    'event_sequence', ev.sequence, 'run_version', ev.version, 'admitted_at_ms', ev.at_ms);
  v_receipt_digest := ql3.domain_digest('qinglong/plugin-package-workflow-task-attempt-receipt@v1',
                                        ql3.canonical_json_flat(v_receipt));
  INSERT INTO ql3.task_attempt_admissions (run_id, step_run_id, step_run_version, attempt_id, attempt, event_id,
    runtime_task_id, task_revision, executor_type, execution_digest, receipt, receipt_digest, admitted_at_ms)
  VALUES (p_run_id, p_step_run_id, p_step_run_version, v_ids.attempt_id, v_attempt, v_ids.event_id,
          (x.item).runtime_task_id, (x.item).task_revision, (x.item).executor_type, (x.item).execution_digest,
          v_receipt, v_receipt_digest, ev.at_ms);
  INSERT INTO ql3.run_attempts (id, run_id, step_run_id, step_run_version, attempt, status, executor_type, project_id,
    runtime_task_id, task_revision, execution_digest, timeout_ms, created_at_ms)
  VALUES (v_ids.attempt_id, p_run_id, p_step_run_id, p_step_run_version, v_attempt, 'claimed', (x.item).executor_type,
          r.project_id, (x.item).runtime_task_id, (x.item).task_revision, (x.item).execution_digest,
          ((x.revision).execution_template ->> 'timeout_ms')::integer, ev.at_ms);
  UPDATE ql3.step_runs SET epoch_admitted = true, current_attempt_id = v_ids.attempt_id WHERE id = p_step_run_id;
  RETURN QUERY SELECT v_ids.attempt_id, v_attempt, v_ids.event_id, v_receipt, v_receipt_digest, false, NULL::text;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_admit_epoch(text, text, integer, text, jsonb, boolean) IS
  'Internal (owner only; caller holds the package/publisher boundaries shared and the Run lock). The Task Attempt admission of one ready epoch shared by ql3.task_attempt_admit and ql3.task_attempt_admit_page (ADR-0227 §1-3): exact replay returns the stored receipt (replayed); else checks plan, running Run without cancel request, start guard, exact ready StepRun version and verified digest, the caller''s execution revision (when given) against the generation-bound reconciliation item with a recomputed digest; allocates the Run-global attempt number, appends workflow.task_attempt_admitted (one Run CAS), inserts the receipt, the claimed RunAttempt and marks the epoch admitted. With p_soft an epoch that moved is answered with skipped = run_ended|cancel_requested|stale_version|not_ready|stale_digest|live_attempt instead of QL202/QL203.';
REVOKE ALL ON FUNCTION ql3.attempt_admit_epoch(text, text, integer, text, jsonb, boolean) FROM PUBLIC;
