"""Whole-run cancellation (ADR-0227 §5, ADR-0228).

A cancel request is stored on the Run once (admin only; reasons user, policy, shutdown). From then on
frontier and admission are frozen; ``run_cancel_converge`` cancels pending and ready steps and unstarted
(``claimed``) attempts; in-flight leases answer ``stop_requested(cancel)``; work past the start barrier
is never cancelled behind its worker's back; the Run ends ``cancelled`` only once every step is
terminal; a completion replayed after that returns its original receipt and rewrites nothing.
"""

from __future__ import annotations

import psycopg
import pytest

from qlpg import api, errors

from helpers import check_audit_invariants
from lifecycle_helpers import owner  # noqa: F401  (fixture)
from lifecycle_helpers import (ADMIN, RUNTIME, WORKER, admit_step, attempt, candidates, events, footprint,
                               lease_one, mutations, run_row, start_run, step, steps, task, write_package)

FAN = {
    "root": {"task": "quick"},
    "done": {"task": "quick", "needs": ["root"]},
    "ready": {"task": "quick", "needs": ["root"]},
    "claimed": {"task": "quick", "needs": ["root"]},
    "leased": {"task": "quick", "needs": ["root"]},
    "starting": {"task": "quick", "needs": ["root"]},
    "run-ok": {"task": "quick", "needs": ["root"]},
    "run-kill": {"task": "quick", "needs": ["root"]},
    "pend-a": {"task": "quick", "needs": ["run-ok"]},
    "pend-b": {"task": "quick", "needs": ["ready", "done"]},
}


@pytest.fixture
def pkg(tmp_path):
    return write_package(tmp_path, "cancelpkg", {"quick": task("true")}, {"fan": FAN, "one": {"a": {"task": "quick"}}})


def _run_to(wk, lease, outcome=None):
    api.attempt_start(wk, lease.attempt_id, lease.lease_token)
    api.attempt_running(wk, lease.attempt_id, lease.lease_token)
    if outcome:
        return api.attempt_complete(wk, lease.attempt_id, lease.lease_token, outcome, 0 if outcome == "succeeded" else 1)


def test_cancel_during_fanout_with_steps_in_every_state(owner, as_role, ql3_owner, pkg):
    run_id = start_run(as_role, pkg, "fan")
    rt, wk, adm = as_role(RUNTIME), as_role(WORKER), as_role(ADMIN)
    L = {}
    for key in ("root", "done"):
        L[key] = lease_one(wk, admit_step(rt, run_id, key).attempt_id)
        _run_to(wk, L[key], "succeeded")
    L["leased"] = lease_one(wk, admit_step(rt, run_id, "leased").attempt_id)
    L["starting"] = lease_one(wk, admit_step(rt, run_id, "starting").attempt_id)
    api.attempt_start(wk, L["starting"].attempt_id, L["starting"].lease_token)
    for key in ("run-ok", "run-kill"):
        L[key] = lease_one(wk, admit_step(rt, run_id, key).attempt_id)
        _run_to(wk, L[key])
    claimed = admit_step(rt, run_id, "claimed")
    A = {k: v.attempt_id for k, v in L.items()} | {"claimed": claimed.attempt_id}
    assert steps(owner, run_id) == {"root": "succeeded", "done": "succeeded", "ready": "ready", "claimed": "ready",
                                    "leased": "ready", "starting": "ready", "run-ok": "running",
                                    "run-kill": "running", "pend-a": "pending", "pend-b": "pending"}
    assert {k: (attempt(owner, a)["status"], attempt(owner, a)["lease_active"]) for k, a in A.items()
            if k not in ("root", "done")} == {
        "claimed": ("claimed", False), "leased": ("claimed", True), "starting": ("starting", True),
        "run-ok": ("running", True), "run-kill": ("running", True)}

    # ---- the request: admin only, validated, stored once
    before = footprint(owner)
    for role in (RUNTIME, WORKER, "ql3_package_executor", "ql3_package_manager", "nobody"):
        with pytest.raises((errors.NotInRole, psycopg.errors.InsufficientPrivilege)):
            api.run_cancel_request(as_role(role), run_id, "user", "mallory")
    with pytest.raises(errors.InvalidInput):
        api.run_cancel_request(adm, run_id, "because", "alice")
    with pytest.raises(errors.InvalidInput):
        api.run_cancel_request(adm, run_id, "user", "")
    with pytest.raises(errors.Unavailable):
        api.run_cancel_request(adm, "run-nope", "user", "alice")
    assert footprint(owner) == before
    first = api.run_cancel_request(adm, run_id, "user", "alice")
    assert first["outcome"] == "requested" and first["run_status"] == "running"
    again = api.run_cancel_request(adm, run_id, "shutdown", "bob")
    assert again["outcome"] == "idempotent" and again["cancel_requested_at_ms"] == first["cancel_requested_at_ms"]
    r = run_row(owner, run_id)
    assert (r["cancel_requested_at_ms"], r["cancel_reason"], r["cancel_actor"]) == (first["cancel_requested_at_ms"], "user", "alice")
    assert len(events(owner, run_id, "workflow.run_cancel_requested")) == 1

    # ---- frozen before any convergence: no candidates, no admission, no new lease, no start
    assert candidates(rt, run_id) == []
    ready = step(owner, run_id, "ready")
    snap = api.task_attempt_snapshot(rt, run_id, ready["id"], ready["version"])
    before = footprint(owner)
    with pytest.raises(errors.IllegalTransition):
        api.task_attempt_admit(rt, run_id, ready["id"], ready["version"], ready["digest"], snap["execution_revision"])
    assert api.lease_acquire(wk, "w-other", "local_process", 8, 30000) == []
    with pytest.raises(errors.IllegalTransition):
        api.attempt_start(wk, A["leased"], L["leased"].lease_token)
    assert footprint(owner) == before
    for key in ("leased", "starting", "run-ok", "run-kill"):
        ctl = api.lease_control(wk, A[key], L[key].lease_token, 30000)
        assert (ctl["decision"], ctl["reason"]) == ("stop_requested", "cancel"), key
    assert events(owner, run_id, "workflow.task_timeout_requested") == []

    # ---- convergence: unstarted work cancelled, started work left to its workers
    res = api.run_cancel_converge(rt, run_id, 64)
    assert res == {"changed": 7, "in_flight": 3, "run_status": "running"}
    assert steps(owner, run_id) == {"root": "succeeded", "done": "succeeded", "ready": "cancelled",
                                    "claimed": "cancelled", "leased": "cancelled", "starting": "ready",
                                    "run-ok": "running", "run-kill": "running", "pend-a": "cancelled",
                                    "pend-b": "cancelled"}
    for key in ("claimed", "leased"):
        a = attempt(owner, A[key])
        assert (a["status"], a["lease_active"], a["stop_reason"]) == ("cancelled", False, "cancel")
        assert a["started_at_ms"] is None
    assert owner.execute("SELECT status, end_reason FROM ql3.run_dispatch_leases WHERE attempt_id = %s",
                         (A["leased"],)).fetchone() == {"status": "released", "end_reason": "cancel"}
    with pytest.raises(errors.LeaseInvalid):
        api.lease_control(wk, A["leased"], L["leased"].lease_token, 30000)
    for key in ("starting", "run-ok", "run-kill"):  # not cancelled behind the worker's back
        assert attempt(owner, A[key])["status"] in ("starting", "running")
        assert api.lease_control(wk, A[key], L[key].lease_token, 30000)["reason"] == "cancel"
    before = footprint(owner)
    assert api.run_cancel_converge(rt, run_id, 64) == {"changed": 0, "in_flight": 3, "run_status": "running"}
    assert footprint(owner) == before

    # ---- started work ends by its workers' reports
    ok = api.attempt_complete(wk, A["run-ok"], L["run-ok"].lease_token, "succeeded", 0)
    assert ok["outcome"] == "succeeded"  # finished before it saw the stop: stays succeeded
    assert step(owner, run_id, "pend-a")["status"] == "cancelled"  # the frontier stays frozen
    killed = api.attempt_complete(wk, A["run-kill"], L["run-kill"].lease_token, "cancelled", None,
                                  {"signal": 15, "stop_reason": "cancel"})
    assert killed["outcome"] == "cancelled"
    assert run_row(owner, run_id)["status"] == "running"  # "starting" is still in flight
    assert api.run_cancel_converge(rt, run_id, 64)["run_status"] == "running"
    # the worker that was starting saw stop_requested(cancel) before spawning and reports it
    st = api.attempt_complete(wk, A["starting"], L["starting"].lease_token, "cancelled", None, {"stop_reason": "cancel"})
    assert st["outcome"] == "cancelled"
    assert mutations(owner, step(owner, run_id, "starting")["id"])[-2:] == [("ready", "running"), ("running", "cancelled")]
    assert steps(owner, run_id) == {"root": "succeeded", "done": "succeeded", "ready": "cancelled",
                                    "claimed": "cancelled", "leased": "cancelled", "starting": "cancelled",
                                    "run-ok": "succeeded", "run-kill": "cancelled", "pend-a": "cancelled",
                                    "pend-b": "cancelled"}
    r = run_row(owner, run_id)
    assert r["status"] == "cancelled" and r["ended_at_ms"] is not None
    assert events(owner, run_id)[-1]["type"] == "workflow.run_cancelled"
    assert api.run_inspect(adm, run_id)["run"]["status"] == "cancelled"

    # ---- after the end: exact replay returns the original receipt and rewrites nothing
    before = footprint(owner)
    rep = api.attempt_complete(wk, A["run-ok"], L["run-ok"].lease_token, "succeeded", 0)
    assert rep["replayed"] and rep["receipt"] == ok["receipt"] and rep["receipt_digest"] == ok["receipt_digest"]
    rep = api.attempt_complete(wk, A["run-kill"], L["run-kill"].lease_token, "cancelled", None, {"other": "detail"})
    assert rep["replayed"] and rep["receipt_digest"] == killed["receipt_digest"]
    with pytest.raises(errors.ImmutableConflict):
        api.attempt_complete(wk, A["run-ok"], L["run-ok"].lease_token, "failed", 1)
    assert api.run_cancel_request(adm, run_id, "policy", "carol")["outcome"] == "idempotent"
    assert api.run_cancel_converge(rt, run_id, 64) == {"changed": 0, "in_flight": 0, "run_status": "cancelled"}
    assert footprint(owner) == before
    assert run_row(owner, run_id)["version"] == r["version"]
    check_audit_invariants(ql3_owner, run_id)


def test_converge_is_bounded_per_call(owner, as_role, ql3_owner, pkg):
    run_id = start_run(as_role, pkg, "fan")
    rt, wk, adm = as_role(RUNTIME), as_role(WORKER), as_role(ADMIN)
    root = lease_one(wk, admit_step(rt, run_id, "root").attempt_id)
    _run_to(wk, root, "succeeded")
    for key in ("claimed", "leased"):
        admit_step(rt, run_id, key)
    api.run_cancel_request(adm, run_id, "policy", "scheduler")
    seen = []
    while True:
        res = api.run_cancel_converge(rt, run_id, 2)
        assert res["changed"] <= 2
        seen.append(res["changed"])
        if res["run_status"] != "running":
            break
        assert len(seen) < 10
    assert sum(seen) == 2 + 9  # two claimed attempts, nine non-terminal steps
    assert run_row(owner, run_id)["status"] == "cancelled"
    assert set(steps(owner, run_id).values()) == {"succeeded", "cancelled"}
    check_audit_invariants(ql3_owner, run_id)


@pytest.mark.parametrize("reason", ["user", "policy", "shutdown"])
def test_cancel_reasons_and_ended_runs(owner, as_role, ql3_owner, pkg, reason):
    run_id = start_run(as_role, pkg, "one")
    rt, wk, adm = as_role(RUNTIME), as_role(WORKER), as_role(ADMIN)
    res = api.run_cancel_request(adm, run_id, reason, "ops")
    assert res["outcome"] == "requested" and run_row(owner, run_id)["cancel_reason"] == reason
    assert api.run_cancel_converge(rt, run_id, 64) == {"changed": 1, "in_flight": 0, "run_status": "cancelled"}
    # a Run that ended without a cancel request cannot be cancelled afterwards
    other = start_run(as_role, pkg, "one", install_first=False)
    lease = lease_one(wk, admit_step(rt, other, "a").attempt_id)
    _run_to(wk, lease, "succeeded")
    before = footprint(owner)
    assert api.run_cancel_request(adm, other, reason, "ops") == {
        "outcome": "already_ended", "cancel_requested_at_ms": None, "run_status": "succeeded"}
    assert footprint(owner) == before
    check_audit_invariants(ql3_owner)


def test_cancelled_run_whose_worker_died_ends_by_recovery(qlpg_db, owner, as_role, ql3_owner, pkg):
    """Started work of a cancelled Run whose worker vanished is ended by recovery (trusted evidence),
    never by convergence; the Run then ends cancelled."""
    from qlpg.runtime import Runtime

    from lifecycle_helpers import wait_db_time_past

    run_id = start_run(as_role, pkg, "fan")
    rt, wk, adm = as_role(RUNTIME), as_role(WORKER), as_role(ADMIN)
    root = lease_one(wk, admit_step(rt, run_id, "root").attempt_id, "w-dies", lease_ms=1000)
    _run_to(wk, root)
    api.run_cancel_request(adm, run_id, "shutdown", "ops")
    loop = Runtime(qlpg_db.conninfo_as(RUNTIME))
    try:
        loop.run_once()
        assert attempt(owner, root.attempt_id)["status"] == "running"
        assert set(steps(owner, run_id).values()) == {"running", "cancelled"}
        wait_db_time_past(owner, attempt(owner, root.attempt_id)["lease_expires_at_ms"])
        assert loop.run_once().recovery_retry == 1  # no evidence yet: nothing is assumed
        assert run_row(owner, run_id)["status"] == "running"
        api.recovery_evidence_record(adm, root.attempt_id, "not_running", "ops")
        assert loop.run_once().recovered == 1
    finally:
        loop.close()
    assert attempt(owner, root.attempt_id)["status"] == "lost"
    assert mutations(owner, step(owner, run_id, "root")["id"])[-2:] == [("running", "lost"), ("lost", "failed")]
    assert run_row(owner, run_id)["status"] == "cancelled"  # aggregation: a cancel request wins
    check_audit_invariants(ql3_owner, run_id)
