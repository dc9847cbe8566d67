"""The control loop and the operator commands through the real CLI, as subprocesses logged in as
the service logins (issue 5 §4): ``qlpg runtime --once`` pages candidates, admits, converges cancels
and runs recovery; ``qlpg cancel RUN``; ``qlpg status RUN [--json] [--events]``. A real worker gets
``stop_requested(cancel)`` and kills the attempt's whole process group.
"""

from __future__ import annotations

import json

import pytest

from qlpg import api

from helpers import check_audit_invariants
from lifecycle_helpers import owner  # noqa: F401  (fixture)
from lifecycle_helpers import (ADMIN, RUNTIME, attempt, kill_group_quietly, pid_alive, qlpg, run_row, spawn_worker,
                               start_run, steps, task, wait_until, write_package)

TREE = ("bash", "-c", 'sleep 60 & echo $! > "$QLPG_RUN_DIR/grandchild.pid"; wait')


@pytest.fixture
def pkg(tmp_path):
    return write_package(tmp_path, "clipkg", {"tree": task(*TREE, timeout_ms=120000), "quick": task("true")}, {
        "cancel-me": {"tree": {"task": "tree"}, "quick": {"task": "quick"},
                      "after": {"task": "quick", "needs": ["tree"]}},
    })


def test_runtime_cancel_status_through_the_cli(qlpg_db, owner, as_role, ql3_owner, pkg, tmp_path):
    run_id = start_run(as_role, pkg, "cancel-me")
    res = qlpg(qlpg_db, RUNTIME, "runtime", "--once")
    assert res.returncode == 0 and "admitted 2" in res.stdout, res.stdout + res.stderr
    res = qlpg(qlpg_db, RUNTIME, "runtime", "--once")  # nothing new: a pass is idempotent
    assert res.returncode == 0 and "admitted 0" in res.stdout, res.stdout + res.stderr

    state = tmp_path / "state"
    state.mkdir()
    pidfile = state / "runs" / run_id.replace(":", "_") / "grandchild.pid"
    # "quick" succeeds through the API; a real worker runs "tree" (a shell with a sleeping grandchild)
    wk = as_role("ql3_worker_ingress")
    for lease in api.lease_acquire(wk, "w-api", "local_process", 2, 30000):
        if lease.step_key == "quick":
            api.attempt_start(wk, lease.attempt_id, lease.lease_token)
            api.attempt_complete(wk, lease.attempt_id, lease.lease_token, "succeeded", 0)
        else:
            api.lease_release(wk, lease.attempt_id, lease.lease_token, "leave it to the real worker")
    proc = spawn_worker(qlpg_db, "w-cli", state, lease_ms=1000)
    gc = None
    try:
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), what="grandchild pid")
        gc = int(pidfile.read_text())
        (tree_attempt,) = [a for a in owner.execute("SELECT a.id, a.status FROM ql3.run_attempts a JOIN ql3.step_runs s"
                                                    " ON s.id = a.step_run_id WHERE s.step_key = 'tree'")]
        wait_until(lambda: attempt(owner, tree_attempt["id"])["status"] == "running", what="tree running")
        assert steps(owner, run_id) == {"tree": "running", "quick": "succeeded", "after": "pending"}

        # the status view while running, as admin, in JSON
        res = qlpg(qlpg_db, ADMIN, "status", run_id, "--json")
        assert res.returncode == 0, res.stderr
        view = json.loads(res.stdout)
        assert view["run"]["status"] == "running" and view["run"]["cancel_requested_at_ms"] is None
        assert {s["step_key"]: s["status"] for s in view["steps"]} == {"tree": "running", "quick": "succeeded",
                                                                       "after": "pending"}
        assert {a["status"] for a in view["attempts"]} == {"running", "succeeded"}
        assert "lease_token" not in res.stdout and "token_sha256" not in res.stdout

        # cancel: admin only, through the CLI
        res = qlpg(qlpg_db, RUNTIME, "cancel", run_id)
        assert res.returncode == 2 and "permission denied" in res.stderr, res.stderr
        res = qlpg(qlpg_db, ADMIN, "cancel", run_id, "--reason", "sideways")
        assert res.returncode == 2  # argparse refuses the reason before anything is sent
        assert run_row(owner, run_id)["cancel_requested_at_ms"] is None
        res = qlpg(qlpg_db, ADMIN, "cancel", run_id, "--reason", "policy", "--actor", "cli-test")
        assert res.returncode == 0 and "cancel requested" in res.stdout, res.stdout + res.stderr
        res = qlpg(qlpg_db, ADMIN, "cancel", run_id, "--reason", "user")
        assert res.returncode == 0 and "cancel idempotent" in res.stdout, res.stdout
        # a second Run, cancelled before anything was admitted: the pass must not admit it but cancel it
        idle = start_run(as_role, pkg, "cancel-me", install_first=False)
        assert qlpg(qlpg_db, ADMIN, "cancel", idle, "--reason", "shutdown").returncode == 0
        # the control loop converges; the worker hears stop_requested(cancel) on its next heartbeat
        # (whichever comes first: convergence cancels "after", or the worker's report skips it)
        res = qlpg(qlpg_db, RUNTIME, "runtime", "--once")
        assert res.returncode == 0 and "admitted 0" in res.stdout, res.stdout + res.stderr
        assert run_row(owner, idle)["status"] == "cancelled"
        assert steps(owner, idle) == {"tree": "cancelled", "quick": "cancelled", "after": "cancelled"}
        converged_first = "cancels converged 2" in res.stdout
        assert converged_first or "cancels converged 1" in res.stdout, res.stdout
        # the worker hears stop_requested(cancel) on its next heartbeat and kills the process group
        assert proc.wait(timeout=30) == 0, (state / "w-cli.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        if gc:
            wait_until(lambda: not pid_alive(gc), timeout=10, what="grandchild killed with its group")
            kill_group_quietly(gc)
    assert steps(owner, run_id) == {"tree": "cancelled", "quick": "succeeded",
                                    "after": "cancelled" if converged_first else "skipped"}
    r = run_row(owner, run_id)
    assert (r["status"], r["cancel_reason"], r["cancel_actor"]) == ("cancelled", "policy", "cli-test")

    res = qlpg(qlpg_db, ADMIN, "status", run_id, "--json", "--events")
    assert res.returncode == 0, res.stderr
    view = json.loads(res.stdout)
    assert view["run"]["status"] == "cancelled" and view["run"]["cancel_reason"] == "policy"
    tree = [a for a in view["attempts"] if a["step_key"] == "tree"][0]
    assert (tree["status"], tree["outcome"]) == ("cancelled", "cancelled")
    assert tree["detail"]["stop_reason"] == "cancel"
    types = [e["type"] for e in view["events"]]
    assert [e["sequence"] for e in view["events"]] == list(range(1, r["event_sequence"] + 1))
    assert types.count("workflow.run_cancel_requested") == 1 and types[-1] == "workflow.run_cancelled"
    assert types.index("workflow.run_cancel_requested") < types.index("workflow.task_attempt_cancelled")

    res = qlpg(qlpg_db, ADMIN, "status", run_id, "--events")
    assert res.returncode == 0 and "cancelled" in res.stdout and "workflow.run_cancelled" in res.stdout, res.stdout
    res = qlpg(qlpg_db, RUNTIME, "status", run_id, "--json")  # run_inspect is open to the runtime role
    assert res.returncode == 0 and json.loads(res.stdout)["run"]["status"] == "cancelled"
    res = qlpg(qlpg_db, ADMIN, "status", "run-does-not-exist")
    assert res.returncode == 1 and "QL101" in res.stderr, res.stderr
    res = qlpg(qlpg_db, "ql3_worker_ingress", "status", run_id)
    assert res.returncode == 2, res.stderr
    check_audit_invariants(ql3_owner, run_id)
