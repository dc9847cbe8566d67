"""Recovery races (ADR-0227 §6): resolution and completion share the attempt authority, and a
recovery claim is a fence that expires.

* a recovery resolution (with trusted ``not_running`` evidence, so it would fail the step) racing the
  real completion of the same attempt, both released by one barrier, many rounds, under SERIALIZABLE
  and READ COMMITTED: exactly one wins and the loser changes nothing;
* a loop that lets its claim expire loses it to the next loop: its late resolve is ``QL202``.
"""

from __future__ import annotations

import threading

import pytest

from qlpg import api, errors

from helpers import admit_all, check_audit_invariants
from lifecycle_helpers import owner  # noqa: F401  (fixture)
from lifecycle_helpers import (ADMIN, RUNTIME, WORKER, admit_step, attempt, control, events, footprint, run_row,
                               start_run, task, wait_db_time_past, write_package)

ROUNDS = 16


@pytest.fixture
def pkg(tmp_path):
    return write_package(tmp_path, "racepkg", {"quick": task("true")}, {
        "wide": {f"t{i:02d}": {"task": "quick"} for i in range(ROUNDS)},
        "one": {"a": {"task": "quick"}, "b": {"task": "quick", "needs": ["a"]}},
    })


def test_resolution_racing_completion_exactly_one_wins(qlpg_db, owner, as_role, ql3_owner, pkg, monkeypatch):
    run_id = start_run(as_role, pkg, "wide")
    rt, wk, adm = as_role(RUNTIME), as_role(WORKER), as_role(ADMIN)
    admit_all(rt)
    leases = {l.attempt_id: l for l in api.lease_acquire(wk, "w-race", "local_process", ROUNDS, 1000)}
    assert len(leases) == ROUNDS
    for l in leases.values():
        api.attempt_start(wk, l.attempt_id, l.lease_token)
        api.attempt_running(wk, l.attempt_id, l.lease_token)
    wait_db_time_past(owner, max(attempt(owner, a)["lease_expires_at_ms"] for a in leases))
    for a in leases:  # trusted evidence for all: a resolution would end the attempt lost -> failed
        api.recovery_evidence_record(adm, a, "not_running", "race-test")

    c_complete, c_resolve = as_role(WORKER), as_role(RUNTIME)
    wins = {"completion": 0, "recovery": 0}
    for rnd in range(ROUNDS):
        monkeypatch.setenv("QLPG_ISOLATION", "serializable" if rnd % 2 == 0 else "read committed")
        (claim,) = api.recovery_claim(rt, f"rt-race-{rnd}", 1, 30000)
        aid = claim["attempt_id"]
        lease = leases[aid]
        run_version = run_row(owner, run_id)["version"]
        barrier = threading.Barrier(2)
        out: dict = {}

        def complete():
            barrier.wait()
            try:
                out["complete"] = api.attempt_complete(c_complete, aid, lease.lease_token, "succeeded", 0)
            except errors.QlpgError as exc:
                out["complete"] = exc

        def resolve():
            barrier.wait()
            try:
                out["resolve"] = api.recovery_resolve(c_resolve, aid, claim["claim_token"])
            except errors.QlpgError as exc:
                out["resolve"] = exc

        ts = [threading.Thread(target=complete), threading.Thread(target=resolve)]
        [t.start() for t in ts]
        [t.join(30) for t in ts]
        att, rc = attempt(owner, aid), control(owner, aid)
        ev = [e["type"] for e in events(owner, run_id) if e["attempt_id"] == aid and e["sequence"] > run_version]
        ev_all = [e["type"] for e in events(owner, run_id) if e["sequence"] > run_version]
        done = owner.execute("SELECT count(*) AS n FROM ql3.run_attempt_completions WHERE attempt_id = %s",
                             (aid,)).fetchone()["n"]
        if isinstance(out["complete"], dict):
            # completion won: the resolution found the attempt ended and changed nothing but its control
            wins["completion"] += 1
            assert out["complete"]["outcome"] == "succeeded" and not out["complete"]["replayed"]
            assert out["resolve"]["resolution"] == "no_action" and out["resolve"]["attempt_status"] == "succeeded"
            assert (att["status"], rc["status"], rc["resolution"], done) == ("succeeded", "resolved", "no_action", 1)
            assert ev == ["workflow.task_attempt_succeeded", "workflow.step_run_succeeded"]
            assert "workflow.task_attempt_lost" not in ev_all
        else:
            # recovery won: the completion was fenced out (its lease ended) and wrote nothing
            wins["recovery"] += 1
            assert isinstance(out["complete"], errors.LeaseInvalid), out["complete"]
            assert out["resolve"]["resolution"] == "lost_after_start"
            assert (att["status"], rc["status"], done) == ("lost", "resolved", 0)
            assert ev == ["workflow.task_attempt_lost", "workflow.step_run_lost", "workflow.step_run_failed"]
            assert "workflow.task_attempt_succeeded" not in ev_all
        # the Run moved by exactly the winner's events (plus the final aggregation once)
        assert run_row(owner, run_id)["version"] == run_version + len(ev_all)
        assert len(ev_all) - len(ev) in (0, 1)
    assert sum(wins.values()) == ROUNDS
    r = run_row(owner, run_id)
    assert r["status"] == ("failed" if wins["recovery"] else "succeeded")
    check_audit_invariants(ql3_owner, run_id)
    print("race winners:", wins)


def test_expired_recovery_claim_is_reclaimed_by_another_loop(qlpg_db, owner, as_role, ql3_owner, pkg):
    run_id = start_run(as_role, pkg, "one")
    rt_a, rt_b, wk = as_role(RUNTIME), as_role(RUNTIME), as_role(WORKER)
    rec = admit_step(rt_a, run_id, "a")
    (lease,) = api.lease_acquire(wk, "w-gone", "local_process", 1, 1000)
    wait_db_time_past(owner, lease.lease_expires_at_ms)

    (ca,) = api.recovery_claim(rt_a, "loop-a", 8, 1000)
    assert ca["attempt_id"] == rec.attempt_id and ca["attempt_status"] == "claimed"
    assert control(owner, rec.attempt_id)["claimed_by"] == "loop-a"
    assert api.recovery_claim(rt_b, "loop-b", 8, 30000) == []  # fenced while A's claim lives
    wait_db_time_past(owner, ca["claim_expires_at_ms"])
    before = footprint(owner)
    with pytest.raises(errors.StaleFence):  # an expired claim resolves nothing, even unclaimed by others
        api.recovery_resolve(rt_a, rec.attempt_id, ca["claim_token"])
    assert footprint(owner) == before and control(owner, rec.attempt_id)["status"] == "claimed"
    (cb,) = api.recovery_claim(rt_b, "loop-b", 8, 30000)
    assert cb["attempt_id"] == rec.attempt_id and cb["claim_token"] != ca["claim_token"]
    assert control(owner, rec.attempt_id)["claimed_by"] == "loop-b"

    before = footprint(owner)
    with pytest.raises(errors.StaleFence):
        api.recovery_resolve(rt_a, rec.attempt_id, ca["claim_token"])
    assert footprint(owner) == before
    res = api.recovery_resolve(rt_b, rec.attempt_id, cb["claim_token"])
    assert (res["status"], res["resolution"], res["attempt_status"], res["step_run_status"]) == \
        ("resolved", "lost_before_start", "lost", "ready")
    before = footprint(owner)
    for loop, token in ((rt_a, ca["claim_token"]), (rt_b, cb["claim_token"])):
        with pytest.raises(errors.StaleFence):  # neither claim can resolve again
            api.recovery_resolve(loop, rec.attempt_id, token)
    with pytest.raises(errors.StaleFence):
        api.recovery_resolve(rt_a, rec.attempt_id, "x" * 64)
    assert api.recovery_claim(rt_a, "loop-a", 8, 30000) == []  # nothing left to claim
    assert footprint(owner) == before
    assert len(events(owner, run_id, "workflow.task_attempt_lost")) == 1
    assert run_row(owner, run_id)["status"] == "running"
    check_audit_invariants(ql3_owner, run_id)
