"""Task Attempt admission (ADR-0227 §1-3, issue 8 items 1-2): candidate pages, admission proofs,
Run-global attempt numbers, receipts, deterministic ids, replay and lost COMMIT responses."""

from __future__ import annotations

import json
import os
import time

import psycopg
import pytest

from qlpg import api, errors, plan as planmod

from helpers import check_audit_invariants
from test_attempt_support import admit, admit_run, candidates, footprint, install_pkg, roots, start, write_pkg

RECEIPT_KEYS = {
    "schema", "run_id", "plan_digest", "step_run_id", "step_run_version", "step_run_digest",
    "reconciliation_receipt_digest", "runtime_task_id", "task_revision", "task_definition_digest",
    "execution_digest", "executor_type", "attempt_id", "attempt", "event_id", "event_sequence", "run_version",
    "admitted_at_ms",
}


@pytest.fixture
def rt(as_role):
    return as_role("ql3_runtime")


def test_candidate_pages_keyset_bounded_and_cancel_excluded(qlpg_db, as_role, ql3_owner, rt, tmp_path):
    pkg = write_pkg(tmp_path, "cand", {"wide": roots(70)})
    install_pkg(as_role, pkg)
    r1, r2 = start(as_role, pkg, "wide", 2)
    first = api.task_attempt_candidates(rt, None, 64)
    assert len(first) == 64
    rest = api.task_attempt_candidates(rt, (first[-1]["run_id"], first[-1]["step_run_id"]), 64)
    allc = first + rest
    assert len(rest) == 64  # every page is bounded
    keys = [(c["run_id"], c["step_run_id"]) for c in first + rest]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert all(c["step_run_version"] == 1 and len(c["step_run_digest"]) == 64 for c in allc)
    with pytest.raises(errors.LimitExceeded):
        api.task_attempt_candidates(rt, None, 65)
    with pytest.raises(errors.InvalidInput):
        api.task_attempt_candidates(rt, None, 0)
    with pytest.raises(errors.InvalidInput):
        api.db.call(rt, "SELECT * FROM ql3.task_attempt_candidates(%s, NULL, 10)", ("run:x",))
    assert len(candidates(rt)) == 140
    # a Run with a cancel request is excluded (its epochs are frozen); the other stays listed
    api.run_cancel_request(as_role("ql3_admin"), r1, "user", "tester")
    left = candidates(rt)
    assert {c["run_id"] for c in left} == {r2} and len(left) == 70
    # admitted epochs leave the candidate set
    admit(rt, left[0])
    assert len(candidates(rt)) == 69
    check_audit_invariants(ql3_owner)


CANDIDATE_SQL = """
SELECT s.run_id, s.id, s.version, s.digest, s.step_key, s.task_key, s.ready_at_ms
  FROM ql3.step_runs s JOIN ql3.runs r ON r.id = s.run_id
 WHERE s.status = 'ready' AND NOT s.epoch_admitted
   AND (s.run_id, s.id) > (COALESCE($1::text, ''), COALESCE($2::text, ''))
   AND r.status = 'running' AND r.cancel_requested_at_ms IS NULL
 ORDER BY s.run_id, s.id LIMIT $3"""


def _plan(owner, after=(None, None), analyze=False):
    opts = "ANALYZE, BUFFERS, TIMING OFF, " if analyze else ""
    owner.execute("DEALLOCATE ALL")
    owner.execute(f"PREPARE cand(text, text, integer) AS {CANDIDATE_SQL}")
    owner.execute("SET plan_cache_mode = force_generic_plan")  # what plpgsql uses after a few calls
    args = ", ".join("NULL" if a is None else "'" + a.replace("'", "''") + "'" for a in after)
    rows = owner.execute(f"EXPLAIN ({opts}FORMAT JSON) EXECUTE cand({args}, 64)").fetchone()[0]
    owner.execute("RESET plan_cache_mode")
    return rows[0]["Plan"]


def _nodes(plan):
    yield plan
    for p in plan.get("Plans", []):
        yield from _nodes(p)


def test_candidate_page_cost_does_not_grow_with_history(qlpg_db, as_role, ql3_owner, rt, tmp_path):
    """20,000 finished StepRuns of history: the page is still an index scan of the partial index
    step_runs_candidates_idx that touches the same few buffers as on an empty history."""
    pkg = write_pkg(tmp_path, "hist", {"wide": roots(8)})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "wide")
    ql3_owner.execute("VACUUM ANALYZE ql3.step_runs")
    ql3_owner.execute("VACUUM ANALYZE ql3.runs")
    before = _plan(ql3_owner, analyze=True)
    hits_before = before["Shared Hit Blocks"] + before["Shared Read Blocks"]  # the root counts its subtree
    def add_history(lo, hi):  # finished Runs lo..hi with 100 terminal StepRuns each, written as the owner
        ql3_owner.execute("""
            INSERT INTO ql3.runs (id, project_id, package_id, task_id, task_revision, publication_id, generation,
                                  publisher_id, plan_digest, status, version, event_sequence, steps_total,
                                  created_at_ms, observed_at_ms, ended_at_ms)
            SELECT 'hist:' || g, 'default', 'hist', 'wide', repeat('0', 64), 'pub:hist', 1, 'qlpg-tests',
                   md5(g::text) || md5('x' || g), 'succeeded', 1, 1, 100, 0, 0, 1
              FROM generate_series(%s::int, %s::int) g""", (lo, hi))
        ql3_owner.execute("""
            INSERT INTO ql3.step_runs (id, run_id, step_key, task_key, status, version, attempt_count, digest, needs,
                                       unmet_needs, epoch_admitted, created_at_ms, updated_at_ms, ready_at_ms, ended_at_ms)
            SELECT 'hsr:' || g || ':' || k, 'hist:' || g, 's' || k, 't',
                   (ARRAY['succeeded','failed','skipped','cancelled','timed_out'])[1 + k %% 5], 3, 1, repeat('0', 64),
                   '{}', 0, k %% 2 = 0, 0, 0, 0, 1
              FROM generate_series(%s::int, %s::int) g, generate_series(1, 100) k""", (lo, hi))
        ql3_owner.execute("VACUUM ANALYZE ql3.step_runs")
        ql3_owner.execute("VACUUM ANALYZE ql3.runs")

    add_history(1, 100)  # 10,000 finished StepRuns
    mid_plan = _plan(ql3_owner, analyze=True)
    hits_mid = mid_plan["Shared Hit Blocks"] + mid_plan["Shared Read Blocks"]
    add_history(101, 200)  # 20,000
    assert ql3_owner.execute("SELECT count(*) FROM ql3.step_runs").fetchone()[0] == 20008
    after = _plan(ql3_owner, analyze=True)
    scans = [n for n in _nodes(after) if n.get("Relation Name") == "step_runs"]
    assert scans and all(n["Node Type"] == "Index Scan" and n["Index Name"] == "step_runs_candidates_idx"
                         for n in scans), json.dumps(after, indent=1)
    assert not any(n["Node Type"] == "Seq Scan" for n in _nodes(after)), json.dumps(after, indent=1)
    hits_after = after["Shared Hit Blocks"] + after["Shared Read Blocks"]
    # doubling the history does not change what a page reads (only a B-tree level, once, can)
    assert hits_after == hits_mid, (hits_before, hits_mid, hits_after, json.dumps(after, indent=1))
    assert scans[0]["Actual Rows"] == 8
    # a keyset page in the middle uses the index condition, not a filter over history
    mid = _plan(ql3_owner, after=(run_id, ""))
    scans = [n for n in _nodes(mid) if n.get("Relation Name") == "step_runs"]
    assert scans[0]["Index Name"] == "step_runs_candidates_idx" and "Index Cond" in scans[0]
    assert len(candidates(rt)) == 8
    out = os.environ.get("QLPG_CANDIDATE_PLAN_OUT")  # for docs/operations.md "Candidate paging"
    if out:
        ql3_owner.execute("SET plan_cache_mode = force_generic_plan")
        text = "\n".join(r[0] for r in ql3_owner.execute(
            "EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, SUMMARY OFF) EXECUTE cand(NULL, NULL, 64)").fetchall())
        with open(out, "w") as f:
            f.write(json.dumps({"before": hits_before, "10k": hits_mid, "20k": hits_after, "plan": after}, indent=1)
                    + "\n\n" + text + "\n")


def _claim(rt, c):
    return api.task_attempt_snapshot(rt, c["run_id"], c["step_run_id"], c["step_run_version"])["execution_revision"]


@pytest.mark.parametrize("mutate, error", [
    (lambda e, c: e.update(task_id="pkg:other:t"), errors.StaleFence),
    (lambda e, c: e.update(task_revision="qltd:v1:1:" + "0" * 64), errors.StaleFence),
    (lambda e, c: e.update(executor_type="remote_worker"), errors.StaleFence),
    (lambda e, c: e.update(project_id="other"), errors.StaleFence),
    (lambda e, c: e.update(content_digest="0" * 64), errors.StaleFence),
    (lambda e, c: e["execution_template"].update(timeout_ms=1234), errors.StaleFence),
    (lambda e, c: e["execution_template"].update(command=["false"]), errors.StaleFence),
    (lambda e, c: c.update(step_run_digest="0" * 64), errors.StaleFence),
    (lambda e, c: c.update(step_run_version=2), errors.StaleFence),
    (lambda e, c: e.update(extra=1), errors.InvalidInput),
    (lambda e, c: e.update(executor_type="shell"), errors.InvalidInput),
])
def test_disagreeing_claims_are_refused_with_zero_writes(qlpg_db, as_role, ql3_owner, rt, tmp_path, mutate, error):
    pkg = write_pkg(tmp_path, "claims", {"one": {"a": []}})
    install_pkg(as_role, pkg)
    start(as_role, pkg, "one")
    (c,) = candidates(rt)
    e = _claim(rt, c)
    mutate(e, c)
    before = footprint(ql3_owner)
    with pytest.raises(error):
        api.task_attempt_admit(rt, c["run_id"], c["step_run_id"], c["step_run_version"], c["step_run_digest"], e)
    assert footprint(ql3_owner) == before
    check_audit_invariants(ql3_owner)


def test_digest_is_recomputed_not_taken_from_the_claim(qlpg_db, as_role, ql3_owner, rt, tmp_path):
    """A claim that differs only by template fields the normaliser drops is the same revision: SQL
    recomputes its digest in full and admits it; the right content_digest is accepted too."""
    pkg = write_pkg(tmp_path, "recompute", {"one": {"a": [], "b": []}})
    install_pkg(as_role, pkg)
    start(as_role, pkg, "one")
    c1, c2 = candidates(rt)
    e = _claim(rt, c1)
    e["execution_template"]["unknown_future_field"] = {"x": 1}
    del e["content_digest"]
    rec = api.task_attempt_admit(rt, c1["run_id"], c1["step_run_id"], 1, c1["step_run_digest"], e)
    assert not rec.replayed and rec.receipt["execution_digest"] == _claim(rt, c2)["content_digest"]
    rec2 = api.task_attempt_admit(rt, c2["run_id"], c2["step_run_id"], 1, c2["step_run_digest"], _claim(rt, c2))
    assert rec2.attempt == 2
    check_audit_invariants(ql3_owner)


def test_attempt_numbers_ids_receipts_and_replay(qlpg_db, as_role, ql3_owner, rt, tmp_path):
    pkg = write_pkg(tmp_path, "ids", {"three": {"a": [], "b": [], "c": []}})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "three")
    plan_digest, v0 = ql3_owner.execute("SELECT plan_digest, version FROM ql3.runs WHERE id = %s", (run_id,)).fetchone()
    cands = candidates(rt)
    recs = [admit(rt, c) for c in cands]
    assert [r.attempt for r in recs] == [1, 2, 3]  # Run-global, allocated under the Run lock
    recon = ql3_owner.execute("SELECT receipt_digest FROM ql3.task_reconciliation_receipts").fetchone()[0]
    for i, (c, r) in enumerate(zip(cands, recs)):
        assert not r.replayed
        aid, eid = planmod.attempt_ids(plan_digest, c["step_run_id"], c["step_run_version"])
        sql_ids = ql3_owner.execute("SELECT * FROM ql3.attempt_ids(%s, %s, %s)",
                                    (plan_digest, c["step_run_id"], c["step_run_version"])).fetchone()
        assert (r.attempt_id, r.event_id) == (aid, eid) == tuple(sql_ids)
        assert len(aid.encode()) == 36 and aid.startswith("wta:") and eid.startswith("wte:")
        assert set(r.receipt) == RECEIPT_KEYS
        planmod.verify_receipt(r.receipt, r.receipt_digest, planmod.ATTEMPT_RECEIPT_DOMAIN)
        assert r.receipt["plan_digest"] == plan_digest and r.receipt["step_run_digest"] == c["step_run_digest"]
        assert r.receipt["reconciliation_receipt_digest"] == recon
        assert r.receipt["runtime_task_id"] == "pkg:ids:t" and r.receipt["task_revision"].startswith("qltd:v1:1:")
        assert r.receipt["executor_type"] == "local_process"
        assert r.receipt["run_version"] == r.receipt["event_sequence"] == v0 + i + 1  # one CAS per admission
    run = ql3_owner.execute("SELECT status, version, last_attempt FROM ql3.runs WHERE id = %s", (run_id,)).fetchone()
    assert run == ("running", v0 + 3, 3)
    steps = ql3_owner.execute("SELECT status, attempt_count, epoch_admitted FROM ql3.step_runs WHERE run_id = %s",
                              (run_id,)).fetchall()
    assert steps == [("ready", 0, True)] * 3  # claimed is only dispatch intent
    atts = ql3_owner.execute("SELECT status, executor_type, step_run_id FROM ql3.run_attempts ORDER BY attempt").fetchall()
    assert [a[:2] for a in atts] == [("claimed", "local_process")] * 3
    events = ql3_owner.execute("SELECT type, attempt_id, payload->>'event_id' FROM ql3.run_events WHERE run_id = %s"
                               " AND type = 'workflow.task_attempt_admitted' ORDER BY sequence", (run_id,)).fetchall()
    assert [(e[1], e[2]) for e in events] == [(r.attempt_id, r.event_id) for r in recs]
    # the same epoch again: the identical receipt, nothing written
    before = footprint(ql3_owner)
    again = admit(rt, cands[1])
    assert again.replayed and (again.attempt_id, again.receipt, again.receipt_digest) == (
        recs[1].attempt_id, recs[1].receipt, recs[1].receipt_digest)
    assert footprint(ql3_owner) == before
    # the ledger row is immutable, even for the owner
    with pytest.raises(psycopg.Error):
        ql3_owner.execute("UPDATE ql3.task_attempt_admissions SET attempt = 9")
    check_audit_invariants(ql3_owner)


def test_lost_commit_is_answered_by_inspect(qlpg_db, as_role, ql3_owner, rt, tmp_path):
    """Terminate the admitting backend right after COMMIT: inspect returns the durable receipt and a
    second admission of the epoch creates nothing."""
    pkg = write_pkg(tmp_path, "lost", {"one": {"a": []}})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "one")
    (c,) = candidates(rt)
    e = _claim(rt, c)
    with pytest.raises(errors.Unavailable):
        api.task_attempt_inspect(rt, c["run_id"], c["step_run_id"], 1)
    victim = as_role("ql3_runtime")
    pid = victim.info.backend_pid
    victim.autocommit = False
    row = victim.execute("SELECT * FROM ql3.task_attempt_admit(%s, %s, %s, %s, %s)",
                         (c["run_id"], c["step_run_id"], 1, c["step_run_digest"], psycopg.types.json.Jsonb(e))).fetchone()
    victim.pgconn.send_query(b"COMMIT")  # the answer is never read
    for _ in range(200):
        if ql3_owner.execute("SELECT 1 FROM ql3.task_attempt_admissions WHERE run_id = %s", (run_id,)).fetchone():
            break
        time.sleep(0.02)
    ql3_owner.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(psycopg.OperationalError):
        victim.execute("SELECT 1")
    rec = api.task_attempt_inspect(rt, c["run_id"], c["step_run_id"], 1)
    assert rec.replayed and rec.attempt_id == row["attempt_id"] and rec.receipt_digest == row["receipt_digest"]
    again = api.task_attempt_admit(rt, c["run_id"], c["step_run_id"], 1, c["step_run_digest"], e)
    assert again.replayed and again.receipt_digest == rec.receipt_digest
    assert ql3_owner.execute("SELECT count(*) FROM ql3.run_attempts").fetchone()[0] == 1
    check_audit_invariants(ql3_owner)


def test_admit_page_matches_single_admission(qlpg_db, as_role, ql3_owner, rt, tmp_path):
    """The batched page admission writes exactly what one-by-one admission writes (same ids, events,
    receipts shape); a replay through task_attempt_admit returns its receipts."""
    pkg = write_pkg(tmp_path, "page", {"wide": roots(70)})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "wide")
    v0 = ql3_owner.execute("SELECT version FROM ql3.runs").fetchone()[0]
    cands = candidates(rt)
    page1 = api.task_attempt_admit_page(rt, None, 64)
    assert [r["outcome"] for r in page1] == ["admitted"] * 64
    page2 = api.task_attempt_admit_page(rt, (page1[-1]["run_id"], page1[-1]["step_run_id"]), 64)
    assert len(page2) == 6 and api.task_attempt_admit_page(rt, None, 64) == []
    rows = page1 + page2
    assert sorted(r["attempt"] for r in rows) == list(range(1, 71))
    plan_digest = ql3_owner.execute("SELECT plan_digest FROM ql3.runs").fetchone()[0]
    for c, r in zip(cands, rows):
        assert r["attempt_id"] == planmod.attempt_ids(plan_digest, c["step_run_id"], 1)[0]
        assert set(r["receipt"]) == RECEIPT_KEYS
        planmod.verify_receipt(r["receipt"], r["receipt_digest"], planmod.ATTEMPT_RECEIPT_DOMAIN)
        rep = admit(rt, c)
        assert rep.replayed and rep.receipt_digest == r["receipt_digest"]
    assert ql3_owner.execute("SELECT version FROM ql3.runs").fetchone()[0] == v0 + 70  # one CAS per admission
    check_audit_invariants(ql3_owner)


def test_admit_page_skips_moved_epochs_and_refuses_quarantine(qlpg_db, as_role, ql3_owner, rt, tmp_path):
    pkg = write_pkg(tmp_path, "pageq", {"wide": roots(3)})
    install_pkg(as_role, pkg)
    r1, r2 = start(as_role, pkg, "wide", 2)
    api.run_cancel_request(as_role("ql3_admin"), r2, "user", "tester")
    rows = api.task_attempt_admit_page(rt, None, 64)  # r2 is no candidate any more
    assert {r["run_id"] for r in rows} == {r1} and all(r["outcome"] == "admitted" for r in rows)
    pkg2 = write_pkg(tmp_path, "pageq2", {"wide": roots(2)})
    install_pkg(as_role, pkg2)
    start(as_role, pkg2, "wide")
    api.package_quarantine(as_role("ql3_package_manager"), "default", "pageq2", "test", "tester")
    before = footprint(ql3_owner)
    with pytest.raises(errors.StartGuardDenied):
        api.task_attempt_admit_page(rt, None, 64)
    assert footprint(ql3_owner) == before
    check_audit_invariants(ql3_owner)
