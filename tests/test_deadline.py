"""Task deadlines (ADR-0227 §5): a Task-level stop intent, never a Run cancel.

* once database time passes ``deadline_at_ms``, ``lease_control`` answers ``stop_requested(timeout)``
  and writes exactly one ``workflow.task_timeout_requested`` event bound to StepRun and Attempt,
  however often it is called, and never touches the Run's cancel fields;
* completion and start-failure re-check the deadline against database time: Attempt and StepRun
  end ``timed_out``, dependents are skipped, the Run aggregates (``timed_out``, or ``failed`` when
  another step failed);
* the real worker kills the attempt's whole process group.
"""

from __future__ import annotations

import time

import pytest

from qlpg import api, errors

from helpers import check_audit_invariants
from lifecycle_helpers import owner  # noqa: F401  (fixture)
from lifecycle_helpers import (RUNTIME, WORKER, admit_step, attempt, events, footprint, lease_one, pid_alive,
                               kill_group_quietly, run_row, spawn_worker, start_run, step, steps, task,
                               wait_db_time_past, wait_until, write_package)

TIMEOUT_MS = 1500


@pytest.fixture
def pkg(tmp_path):
    return write_package(tmp_path, "deadline", {
        "slow": task("sleep", "30", timeout_ms=TIMEOUT_MS),
        "quick": task("true"),
        "bad": task("false"),
        "tree": task("bash", "-c", 'sleep 30 & echo $! > "$QLPG_RUN_DIR/grandchild.pid"; wait',
                     timeout_ms=TIMEOUT_MS),
    }, {
        "deadline": {"slow": {"task": "slow"}, "after": {"task": "quick", "needs": ["slow"]},
                     "later": {"task": "quick", "needs": ["after"]}},
        "mixed": {"slow": {"task": "slow"}, "late": {"task": "slow"}, "bad": {"task": "bad"},
                  "after": {"task": "quick", "needs": ["slow"]}},
        "tree": {"tree": {"task": "tree"}, "after": {"task": "quick", "needs": ["tree"]}},
    })


def _start(wk, lease, running=True):
    st = api.attempt_start(wk, lease.attempt_id, lease.lease_token)
    assert st["deadline_at_ms"] == st["started_at_ms"] + TIMEOUT_MS
    if running:
        api.attempt_running(wk, lease.attempt_id, lease.lease_token)
    return st


def test_lease_control_requests_timeout_once_and_completion_times_out(qlpg_db, owner, as_role, ql3_owner, pkg):
    run_id = start_run(as_role, pkg, "deadline")
    rt, wk = as_role(RUNTIME), as_role(WORKER)
    rec = admit_step(rt, run_id, "slow")
    lease = lease_one(wk, rec.attempt_id, lease_ms=5000)
    st = _start(wk, lease)

    ctl = api.lease_control(wk, lease.attempt_id, lease.lease_token, 5000)
    assert (ctl["decision"], ctl["reason"]) == ("continue", None)
    assert ctl["deadline_at_ms"] == st["deadline_at_ms"]

    wait_db_time_past(owner, st["deadline_at_ms"])
    version_before = run_row(owner, run_id)["version"]
    answers = [api.lease_control(wk, lease.attempt_id, lease.lease_token, 5000) for _ in range(4)]
    assert {(a["decision"], a["reason"]) for a in answers} == {("stop_requested", "timeout")}
    # exactly one durable timeout intent, bound to StepRun and Attempt; one Run version step for it
    tev = events(owner, run_id, "workflow.task_timeout_requested")
    assert len(tev) == 1
    assert tev[0]["attempt_id"] == lease.attempt_id and tev[0]["step_run_id"] == rec.receipt["step_run_id"]
    assert tev[0]["payload"]["deadline_at_ms"] == st["deadline_at_ms"]
    assert tev[0]["payload"]["observed_at_ms"] > st["deadline_at_ms"]
    r = run_row(owner, run_id)
    assert r["version"] == version_before + 1
    # a Task deadline is not a Run cancel
    assert (r["status"], r["cancel_requested_at_ms"], r["cancel_reason"], r["cancel_actor"]) == ("running", None, None, None)
    assert attempt(owner, lease.attempt_id)["stop_reason"] == "timeout"
    assert step(owner, run_id, "slow")["status"] == "running"

    # the worker killed its process and reports what it saw; the database clock decides: timed_out
    done = api.attempt_complete(wk, lease.attempt_id, lease.lease_token, "timed_out", None,
                                {"signal": 15, "stop_reason": "timeout"})
    assert done["outcome"] == "timed_out" and not done["replayed"]
    assert done["receipt"]["outcome"] == "timed_out" and done["receipt"]["step_run_status"] == "timed_out"
    assert attempt(owner, lease.attempt_id)["status"] == "timed_out"
    assert steps(owner, run_id) == {"slow": "timed_out", "after": "skipped", "later": "skipped"}
    r = run_row(owner, run_id)
    assert r["status"] == "timed_out" and r["cancel_requested_at_ms"] is None
    assert [e["type"] for e in events(owner, run_id)][-1] == "workflow.run_timed_out"
    assert len(events(owner, run_id, "workflow.task_timeout_requested")) == 1

    # the exact report again returns the same receipt and writes nothing; a different one is refused
    before = footprint(owner)
    again = api.attempt_complete(wk, lease.attempt_id, lease.lease_token, "timed_out", None,
                                 {"signal": 15, "stop_reason": "timeout"})
    assert again["replayed"] and again["receipt_digest"] == done["receipt_digest"]
    with pytest.raises(errors.ImmutableConflict):
        api.attempt_complete(wk, lease.attempt_id, lease.lease_token, "succeeded", 0)
    with pytest.raises(errors.LeaseInvalid):  # the lease ended with the attempt
        api.lease_control(wk, lease.attempt_id, lease.lease_token, 5000)
    assert footprint(owner) == before
    check_audit_invariants(ql3_owner, run_id)


def test_late_success_and_late_start_failure_time_out_and_failure_wins_aggregation(owner, as_role, ql3_owner, pkg):
    """A worker claiming success after the deadline, and a start failure reported after it, both end
    timed_out (database time decides); another step's failure makes the Run ``failed``."""
    run_id = start_run(as_role, pkg, "mixed")
    rt, wk = as_role(RUNTIME), as_role(WORKER)
    leases = {}
    for key, running in (("slow", True), ("late", False), ("bad", True)):
        rec = admit_step(rt, run_id, key)
        leases[key] = lease_one(wk, rec.attempt_id, lease_ms=5000)
        if key != "bad":
            _start(wk, leases[key], running)
        else:
            api.attempt_start(wk, rec.attempt_id, leases[key].lease_token)
            api.attempt_running(wk, rec.attempt_id, leases[key].lease_token)
    deadline = max(attempt(owner, leases[k].attempt_id)["deadline_at_ms"] for k in ("slow", "late"))
    wait_db_time_past(owner, deadline)

    ok = api.attempt_complete(wk, leases["slow"].attempt_id, leases["slow"].lease_token, "succeeded", 0)
    assert ok["outcome"] == "timed_out" and ok["receipt"]["reported_outcome"] == "succeeded"
    sf = api.attempt_start_failed(wk, leases["late"].attempt_id, leases["late"].lease_token, {"error": "exec failed"})
    assert sf["outcome"] == "timed_out"
    late = step(owner, run_id, "late")
    assert late["status"] == "timed_out" and late["attempt_count"] == 0  # never entered running
    assert [m["to_status"] for m in owner.execute(
        "SELECT to_status FROM ql3.step_run_mutations WHERE step_run_id = %s ORDER BY version", (late["id"],))] \
        == ["ready", "timed_out"]
    # no lease_control call happened, so no timeout intent was written: completion alone decides
    assert events(owner, run_id, "workflow.task_timeout_requested") == []
    assert run_row(owner, run_id)["status"] == "running"  # "bad" is still running

    bad = api.attempt_complete(wk, leases["bad"].attempt_id, leases["bad"].lease_token, "failed", 1)
    assert bad["outcome"] == "failed"  # its own deadline (20 s) is far away
    assert steps(owner, run_id) == {"slow": "timed_out", "late": "timed_out", "bad": "failed", "after": "skipped"}
    assert run_row(owner, run_id)["status"] == "failed"  # aggregation: failed beats timed_out
    check_audit_invariants(ql3_owner, run_id)


def test_start_failure_before_deadline_is_failed(qlpg_db, owner, as_role, ql3_owner, pkg):
    run_id = start_run(as_role, pkg, "deadline")
    rt, wk = as_role(RUNTIME), as_role(WORKER)
    rec = admit_step(rt, run_id, "slow")
    lease = lease_one(wk, rec.attempt_id)
    _start(wk, lease, running=False)
    assert api.attempt_start_failed(wk, lease.attempt_id, lease.lease_token, {"error": "x"})["outcome"] == "failed"
    assert steps(owner, run_id) == {"slow": "failed", "after": "skipped", "later": "skipped"}
    assert run_row(owner, run_id)["status"] == "failed"
    check_audit_invariants(ql3_owner, run_id)


def test_real_worker_kills_the_process_group_at_the_deadline(qlpg_db, owner, as_role, ql3_owner, pkg, tmp_path):
    run_id = start_run(as_role, pkg, "tree")
    admit_step(as_role(RUNTIME), run_id, "tree")
    state = tmp_path / "state"
    state.mkdir()
    t0 = time.monotonic()
    proc = spawn_worker(qlpg_db, "w-deadline", state, lease_ms=1000)
    pidfile = state / "runs" / run_id.replace(":", "_") / "grandchild.pid"
    try:
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), what="grandchild pid file")
        gc = int(pidfile.read_text())
        assert pid_alive(gc)
        assert proc.wait(timeout=30) == 0, (state / "w-deadline.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        if pidfile.exists() and pidfile.read_text().strip():
            kill_group_quietly(int(pidfile.read_text()))
    elapsed = time.monotonic() - t0
    assert elapsed < 20, elapsed  # nowhere near the task's own 30 s
    wait_until(lambda: not pid_alive(gc), timeout=5, what="grandchild gone")
    (a,) = owner.execute("SELECT * FROM ql3.run_attempts WHERE run_id = %s", (run_id,)).fetchall()
    c = owner.execute("SELECT * FROM ql3.run_attempt_completions WHERE attempt_id = %s", (a["id"],)).fetchone()
    assert a["status"] == "timed_out" and c["outcome"] == "timed_out"
    assert c["detail"]["stop_reason"] == "timeout" and c["detail"]["signal"] in (15, 9)
    assert steps(owner, run_id) == {"tree": "timed_out", "after": "skipped"}
    assert run_row(owner, run_id)["status"] == "timed_out"
    assert run_row(owner, run_id)["cancel_requested_at_ms"] is None
    # whichever noticed first (the local deadline or lease_control), at most one timeout intent exists
    assert len(events(owner, run_id, "workflow.task_timeout_requested")) <= 1
    check_audit_invariants(ql3_owner, run_id)
