"""Activation, completion and fencing (ADR-0227 §4-5, issue 8 items 4, 5, 7): the start barrier,
StepRun-aware running and completion, the crash window, completion replay, parallel steps, late
reports after a new epoch, foreign tokens, and three parents completing at once."""

from __future__ import annotations

import time

import pytest

from qlpg import api, errors

from helpers import check_audit_invariants
from test_attempt_support import (admit, admit_run, candidates, footprint, install_pkg, roots, run_threads, start,
                                  step_id, write_pkg)

W = "ql3_worker_ingress"
RT = "ql3_runtime"


def run_row(owner, run_id):
    return owner.execute("SELECT status, version, event_sequence FROM ql3.runs WHERE id = %s", (run_id,)).fetchone()


def step_row(owner, sid):
    return owner.execute("SELECT status, version, attempt_count FROM ql3.step_runs WHERE id = %s", (sid,)).fetchone()


def events_of(owner, run_id, after_seq=0):
    return owner.execute("SELECT sequence, type, step_run_id, attempt_id FROM ql3.run_events WHERE run_id = %s"
                         " AND sequence > %s ORDER BY sequence", (run_id, after_seq)).fetchall()


def lease(wk, worker="w", lease_ms=30000, n=1):
    return api.lease_acquire(wk, worker, "local_process", n, lease_ms)


def test_activation_and_completion_keep_the_run_running(qlpg_db, as_role, ql3_owner, tmp_path):
    pkg = write_pkg(tmp_path, "act", {"chain": {"a": [], "b": ["a"]}}, timeout_ms=45000)
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "chain")
    rt, wk = as_role(RT), as_role(W)
    sa, sb = step_id(ql3_owner, run_id, "a"), step_id(ql3_owner, run_id, "b")
    (rec,) = admit_run(rt, run_id)
    (l,) = lease(wk)
    _, v0, _ = run_row(ql3_owner, run_id)
    st = api.attempt_start(wk, l.attempt_id, l.lease_token)
    assert st["status"] == "starting" and st["deadline_at_ms"] == st["started_at_ms"] + 45000
    assert run_row(ql3_owner, run_id) == ("running", v0 + 1, v0 + 1)
    assert step_row(ql3_owner, sa) == ("ready", 1, 0)  # the start barrier does not move the StepRun
    assert api.attempt_start(wk, l.attempt_id, l.lease_token) == st  # replay of a lost answer
    assert run_row(ql3_owner, run_id)[1] == v0 + 1
    ru = api.attempt_running(wk, l.attempt_id, l.lease_token)
    assert ru == {"attempt_id": l.attempt_id, "status": "running", "step_run_version": 2, "attempt_count": 1}
    assert step_row(ql3_owner, sa) == ("running", 2, 1)
    assert run_row(ql3_owner, run_id) == ("running", v0 + 3, v0 + 3)  # attempt running + step running events
    assert api.attempt_running(wk, l.attempt_id, l.lease_token) == ru
    done = api.attempt_complete(wk, l.attempt_id, l.lease_token, "succeeded", 0, {"note": "ok"})
    assert done["outcome"] == "succeeded" and not done["replayed"]
    assert step_row(ql3_owner, sa) == ("succeeded", 3, 1)
    assert step_row(ql3_owner, sb)[0] == "ready"  # frontier advanced in the same transaction
    assert run_row(ql3_owner, run_id)[0] == "running"  # only version/event_sequence moved
    types = [e[1] for e in events_of(ql3_owner, run_id, v0)]
    assert types == ["workflow.task_attempt_starting", "workflow.task_attempt_running", "workflow.step_run_running",
                     "workflow.task_attempt_succeeded", "workflow.step_run_succeeded", "workflow.step_run_ready"]
    a = ql3_owner.execute("SELECT status, lease_active, ended_at_ms IS NOT NULL FROM ql3.run_attempts WHERE id = %s",
                          (l.attempt_id,)).fetchone()
    assert a == ("succeeded", False, True)
    assert ql3_owner.execute("SELECT status, end_reason FROM ql3.run_dispatch_leases WHERE attempt_id = %s",
                             (l.attempt_id,)).fetchone() == ("completed", "complete")
    (rec_b,) = admit_run(rt, run_id)
    assert rec_b.attempt == 2
    (lb,) = lease(wk)
    api.attempt_start(wk, lb.attempt_id, lb.lease_token)
    api.attempt_running(wk, lb.attempt_id, lb.lease_token)
    api.attempt_complete(wk, lb.attempt_id, lb.lease_token, "succeeded", 0)
    assert run_row(ql3_owner, run_id)[0] == "succeeded"
    check_audit_invariants(ql3_owner)


def test_crash_window_records_ready_running_terminal_atomically(qlpg_db, as_role, ql3_owner, tmp_path):
    pkg = write_pkg(tmp_path, "crash", {"one": {"a": [], "z": []}})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "one")
    rt, wk = as_role(RT), as_role(W)
    admit_run(rt, run_id)
    l, _ = lease(wk, n=2)
    sid = l.step_run_id
    api.attempt_start(wk, l.attempt_id, l.lease_token)
    seq0 = run_row(ql3_owner, run_id)[2]
    done = api.attempt_complete(wk, l.attempt_id, l.lease_token, "failed", 7)  # straight from starting
    assert done["outcome"] == "failed"
    muts = ql3_owner.execute("SELECT version, from_status, to_status, xmin::text FROM ql3.step_run_mutations"
                             " WHERE step_run_id = %s ORDER BY version", (sid,)).fetchall()
    assert [(m[1], m[2]) for m in muts] == [(None, "ready"), ("ready", "running"), ("running", "failed")]
    assert muts[1][3] == muts[2][3]  # one transaction wrote running and terminal
    assert step_row(ql3_owner, sid) == ("failed", 3, 1)  # attempt_count grew on entering running
    evs = events_of(ql3_owner, run_id, seq0)
    assert [e[1] for e in evs][:4] == ["workflow.task_attempt_running", "workflow.step_run_running",
                                       "workflow.task_attempt_failed", "workflow.step_run_failed"]
    assert [e[0] for e in evs] == list(range(seq0 + 1, seq0 + 1 + len(evs)))
    xmins = ql3_owner.execute("SELECT DISTINCT xmin::text FROM ql3.run_events WHERE run_id = %s AND sequence > %s",
                              (run_id, seq0)).fetchall()
    assert len(xmins) == 1
    assert run_row(ql3_owner, run_id)[0] == "running"  # the other step still runs
    check_audit_invariants(ql3_owner)


def test_completion_replay_same_receipt_other_report_refused(qlpg_db, as_role, ql3_owner, tmp_path):
    pkg = write_pkg(tmp_path, "replay", {"two": {"a": [], "b": []}})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "two")
    rt, wk = as_role(RT), as_role(W)
    admit_run(rt, run_id)
    la, lb = lease(wk, n=2)
    for l in (la, lb):
        api.attempt_start(wk, l.attempt_id, l.lease_token)
        api.attempt_running(wk, l.attempt_id, l.lease_token)
    first = api.attempt_complete(wk, la.attempt_id, la.lease_token, "succeeded", 0, {"log": "x"})
    before = footprint(ql3_owner)
    again = api.attempt_complete(wk, la.attempt_id, la.lease_token, "succeeded", 0, {"log": "x"})
    assert again["replayed"] and (again["receipt"], again["receipt_digest"]) == (first["receipt"], first["receipt_digest"])
    for bad in (("failed", 1), ("succeeded", 3)):
        with pytest.raises(errors.ImmutableConflict):
            api.attempt_complete(wk, la.attempt_id, la.lease_token, *bad)
    with pytest.raises(errors.LeaseInvalid):  # the other attempt's token
        api.attempt_complete(wk, la.attempt_id, lb.lease_token, "succeeded", 0)
    with pytest.raises(errors.LeaseInvalid):
        api.attempt_complete(wk, lb.attempt_id, la.lease_token, "succeeded", 0)
    with pytest.raises(errors.LeaseInvalid):  # the lease ended with the completion
        api.lease_control(wk, la.attempt_id, la.lease_token, 30000)
    with pytest.raises(errors.LeaseInvalid):
        api.attempt_running(wk, la.attempt_id, la.lease_token)
    assert footprint(ql3_owner) == before
    api.attempt_complete(wk, lb.attempt_id, lb.lease_token, "succeeded", 0)
    assert run_row(ql3_owner, run_id)[0] == "succeeded"
    # after the Run ended, the exact replay still answers the same receipt
    assert api.attempt_complete(wk, la.attempt_id, la.lease_token, "succeeded", 0, {"log": "x"})["receipt"] == first["receipt"]
    check_audit_invariants(ql3_owner)


def test_independent_ready_steps_run_in_parallel(qlpg_db, as_role, ql3_owner, tmp_path):
    pkg = write_pkg(tmp_path, "par", {"four": roots(4)})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "four")
    admit_run(as_role(RT), run_id)
    wks = [as_role(W) for _ in range(4)]
    ls = [lease(wk, f"w{i}")[0] for i, wk in enumerate(wks)]
    assert len({l.attempt_id for l in ls}) == 4
    v0 = run_row(ql3_owner, run_id)[1]

    def go(i, barrier):
        barrier.wait()
        api.attempt_start(wks[i], ls[i].attempt_id, ls[i].lease_token)
        return api.attempt_running(wks[i], ls[i].attempt_id, ls[i].lease_token)

    res = run_threads(4, go)
    assert all(isinstance(r, dict) and r["status"] == "running" for r in res), res
    assert ql3_owner.execute("SELECT count(*) FROM ql3.step_runs WHERE run_id = %s AND status = 'running'",
                             (run_id,)).fetchone()[0] == 4
    assert run_row(ql3_owner, run_id) == ("running", v0 + 12, v0 + 12)  # 3 events per step, serialised per Run

    def done(i, barrier):
        barrier.wait()
        return api.attempt_complete(wks[i], ls[i].attempt_id, ls[i].lease_token, "succeeded", 0)

    res = run_threads(4, done)
    assert all(isinstance(r, dict) for r in res), res
    assert run_row(ql3_owner, run_id)[0] == "succeeded"
    check_audit_invariants(ql3_owner)


def _wait_db_past(owner, ms):
    for _ in range(200):
        if owner.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint > %s", (ms,)).fetchone()[0]:
            return
        time.sleep(0.05)
    raise AssertionError("database time did not pass %s" % ms)


def test_late_reports_after_a_new_epoch_change_nothing(qlpg_db, as_role, ql3_owner, tmp_path):
    """Worker A leases (1 s) and stalls before the start barrier; recovery turns the expired lease
    into a new epoch; worker B is admitted and runs it. Every late call of A (start, running,
    heartbeat, complete, release), a token of another attempt and calls after B's lease ended are
    refused with QL401/QL202/QL201 and write nothing."""
    pkg = write_pkg(tmp_path, "fence", {"one": {"a": []}})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "one")
    rt, wa, wb = as_role(RT), as_role(W), as_role(W)
    sid = step_id(ql3_owner, run_id, "a")
    (rec_a,) = admit_run(rt, run_id)
    (la,) = lease(wa, "wa", lease_ms=1000)
    _wait_db_past(ql3_owner, la.lease_expires_at_ms)
    claims = api.recovery_claim(rt, "rt-test", 16, 30000)
    assert [c["attempt_id"] for c in claims] == [la.attempt_id]
    res = api.recovery_resolve(rt, la.attempt_id, claims[0]["claim_token"])
    assert res["resolution"] == "lost_before_start"
    assert step_row(ql3_owner, sid) == ("ready", 2, 0)  # ready -> ready: a new epoch
    (c,) = candidates(rt)
    assert c["step_run_version"] == 2
    rec_b = admit(rt, c)
    assert rec_b.attempt == 2 and rec_b.attempt_id != rec_a.attempt_id
    (lb,) = lease(wb, "wb")
    assert lb.attempt_id == rec_b.attempt_id
    api.attempt_start(wb, lb.attempt_id, lb.lease_token)
    api.attempt_running(wb, lb.attempt_id, lb.lease_token)

    before = footprint(ql3_owner)
    late = [
        lambda: api.attempt_start(wa, la.attempt_id, la.lease_token),
        lambda: api.attempt_running(wa, la.attempt_id, la.lease_token),
        lambda: api.attempt_complete(wa, la.attempt_id, la.lease_token, "succeeded", 0),
        lambda: api.attempt_start_failed(wa, la.attempt_id, la.lease_token, {"error": "late"}),
        lambda: api.lease_control(wa, la.attempt_id, la.lease_token, 30000),
        lambda: api.lease_release(wa, la.attempt_id, la.lease_token),
        # A's token on B's attempt, B's token on A's attempt
        lambda: api.attempt_complete(wa, lb.attempt_id, la.lease_token, "succeeded", 0),
        lambda: api.lease_control(wa, lb.attempt_id, la.lease_token, 30000),
        lambda: api.attempt_complete(wb, la.attempt_id, lb.lease_token, "failed", 1),
        lambda: api.attempt_complete_batch(wa, [(la.attempt_id, la.lease_token, "succeeded", 0, None)]),
    ]
    for call in late:
        with pytest.raises((errors.LeaseInvalid, errors.StaleFence)):
            call()
        assert footprint(ql3_owner) == before
    assert ql3_owner.execute("SELECT status FROM ql3.run_attempts WHERE id = %s", (la.attempt_id,)).fetchone()[0] == "lost"
    done = api.attempt_complete(wb, lb.attempt_id, lb.lease_token, "succeeded", 0)
    assert done["outcome"] == "succeeded" and run_row(ql3_owner, run_id)[0] == "succeeded"
    before = footprint(ql3_owner)
    for call, err in [
        (lambda: api.lease_control(wb, lb.attempt_id, lb.lease_token, 30000), errors.LeaseInvalid),
        (lambda: api.attempt_running(wb, lb.attempt_id, lb.lease_token), errors.LeaseInvalid),
        (lambda: api.lease_release(wb, lb.attempt_id, lb.lease_token), errors.LeaseInvalid),
        (lambda: api.attempt_complete(wb, lb.attempt_id, lb.lease_token, "failed", 1), errors.ImmutableConflict),
        (lambda: api.attempt_complete(wa, la.attempt_id, la.lease_token, "succeeded", 0), errors.LeaseInvalid),
    ]:
        with pytest.raises(err):
            call()
    assert footprint(ql3_owner) == before
    check_audit_invariants(ql3_owner)


def test_three_parents_completing_concurrently_admit_the_child_once(qlpg_db, as_role, ql3_owner, tmp_path):
    """p1, p2, p3 -> child, 6 Runs: the three parents complete at the same instant on three
    connections; the child becomes ready exactly once, then 8 runtime sessions race to admit it:
    one attempt, every other session the identical receipt."""
    pkg = write_pkg(tmp_path, "join", {"join": {"p1": [], "p2": [], "p3": [], "child": ["p1", "p2", "p3"]}})
    install_pkg(as_role, pkg)
    runs = start(as_role, pkg, "join", 6)
    rt = as_role(RT)
    api.task_attempt_admit_page(rt, None, 64)
    wks = [as_role(W) for _ in range(3)]
    cws = [as_role(W) for _ in range(3)]
    rts = [as_role(RT) for _ in range(8)]
    leased = {}  # every parent attempt of every Run, spread over the three workers
    while True:
        got = [(i, x) for i in range(3) for x in lease(wks[i], f"w{i}", n=4)]
        if not got:
            break
        leased.update({x.attempt_id: (i, x) for i, x in got})
    assert len(leased) == 18
    for run_id in runs:
        mine = []
        for k in ("p1", "p2", "p3"):
            sid = step_id(ql3_owner, run_id, k)
            aid = ql3_owner.execute("SELECT id FROM ql3.run_attempts WHERE step_run_id = %s", (sid,)).fetchone()[0]
            mine.append(leased[aid])
        for i, x in mine:
            api.attempt_start(wks[i], x.attempt_id, x.lease_token)
            api.attempt_running(wks[i], x.attempt_id, x.lease_token)

        def complete(j, barrier):
            _, x = mine[j]
            barrier.wait()  # one connection per parent: the token, not the session, is the authority
            return api.attempt_complete(cws[j], x.attempt_id, x.lease_token, "succeeded", 0)

        res = run_threads(3, complete)
        assert all(isinstance(r, dict) and r["outcome"] == "succeeded" for r in res), res
        child = step_id(ql3_owner, run_id, "child")
        muts = ql3_owner.execute("SELECT from_status, to_status FROM ql3.step_run_mutations WHERE step_run_id = %s"
                                 " ORDER BY version", (child,)).fetchall()
        assert muts == [(None, "pending"), ("pending", "ready")]
        (c,) = candidates(rt, run_id)

        def race(j, barrier):
            e = api.task_attempt_snapshot(rts[j], c["run_id"], c["step_run_id"], c["step_run_version"])["execution_revision"]
            barrier.wait()
            return api.task_attempt_admit(rts[j], c["run_id"], c["step_run_id"], c["step_run_version"],
                                          c["step_run_digest"], e)

        recs = run_threads(8, race)
        assert all(isinstance(r, api.AttemptReceipt) for r in recs), recs
        assert sum(not r.replayed for r in recs) == 1 and len({r.receipt_digest for r in recs}) == 1
        assert ql3_owner.execute("SELECT count(*) FROM ql3.run_attempts WHERE step_run_id = %s", (child,)).fetchone()[0] == 1
    check_audit_invariants(ql3_owner)
