"""The durable frontier and Run aggregation (ADR-0223 §4, DESIGN §4), driven through the SQL API.

* diamond: completing a step makes every dependent whose needs all succeeded ``ready`` in the same
  transaction (same ``xmin`` as the completing mutation), and only then;
* chain of 128: each step becomes ready in the transaction that completes its predecessor;
* fan-in: 3 parents complete concurrently, in separate transactions on separate connections (20
  rounds, SERIALIZABLE and READ COMMITTED): the child becomes ready exactly once, no deadlock;
* skip cascade through a step with several parents; failed, timed-out and cancelled parents skip
  every transitive dependent and nothing else; the Run ends by the aggregation rule.

Audit invariants (gapless events = event_sequence = version, StepRun mutation chains) after each.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from qlpg import api, install as installmod

from helpers import check_audit_invariants
from test_plan_support import DIAMOND, Driver, chain, install, package, run_state

TERMINAL = {"succeeded", "failed", "skipped", "cancelled", "timed_out"}


def _start(as_role, name: str, wf: dict, run_id: str, **kw) -> str:
    pm = as_role("ql3_package_manager")
    install(pm, package(name, {"wf": wf}, **kw))
    return installmod.start_workflow(as_role("ql3_package_executor"), "default", name, "wf", run_id).run_id


def _mutations(owner, run_id: str) -> list[tuple]:
    """(step_key, version, from, to, run_sequence, xmin, reason) of every StepRun mutation of the Run."""
    return owner.execute(
        """SELECT s.step_key, m.version, m.from_status, m.to_status, m.run_sequence, m.xmin::text::bigint, m.reason
             FROM ql3.step_run_mutations m JOIN ql3.step_runs s ON s.id = m.step_run_id
            WHERE m.run_id = %s ORDER BY m.run_sequence""", (run_id,)).fetchall()


def _xmin(muts, key: str, to: str) -> int:
    got = [m[5] for m in muts if m[0] == key and m[3] == to]
    assert len(got) == 1, (key, to, got)
    return got[0]


def _final_event(owner, run_id: str) -> str:
    return owner.execute("SELECT type FROM ql3.run_events WHERE run_id = %s ORDER BY sequence DESC LIMIT 1",
                         (run_id,)).fetchone()[0]


def test_diamond(qlpg_db, as_role, ql3_owner):
    run = _start(as_role, "diamond", DIAMOND, "run:diamond")
    drv = Driver(as_role)
    assert run_state(ql3_owner, run) == ("running", {"a": "ready", "b": "pending", "c": "pending", "d": "pending"})
    assert drv.step_ready() == ["a"]
    assert run_state(ql3_owner, run)[1] == {"a": "succeeded", "b": "ready", "c": "ready", "d": "pending"}
    # b and c: complete b alone first -> d still pending with one unmet need
    drv.admit()
    leases = drv.lease_all()
    drv.start(leases["b"]), drv.start(leases["c"])
    drv.complete(leases["b"])
    assert run_state(ql3_owner, run)[1]["d"] == "pending"
    assert ql3_owner.execute("SELECT unmet_needs FROM ql3.step_runs WHERE run_id = %s AND step_key = 'd'",
                             (run,)).fetchone()[0] == 1
    drv.complete(leases["c"])
    assert run_state(ql3_owner, run)[1]["d"] == "ready"
    assert drv.step_ready() == ["d"]
    assert run_state(ql3_owner, run) == ("succeeded", dict.fromkeys("abcd", "succeeded"))
    muts = _mutations(ql3_owner, run)
    # ready in the same transaction as the completion that satisfied the last need
    assert _xmin(muts, "b", "ready") == _xmin(muts, "c", "ready") == _xmin(muts, "a", "succeeded")
    assert _xmin(muts, "d", "ready") == _xmin(muts, "c", "succeeded") != _xmin(muts, "b", "succeeded")
    assert _final_event(ql3_owner, run) == "workflow.run_succeeded"
    check_audit_invariants(ql3_owner, run)


_DRIVE_ONE = """
CREATE FUNCTION pg_temp.drive_one(p_outcome text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE c record; s jsonb; l record;
BEGIN
  SELECT * INTO c FROM ql3.task_attempt_candidates(NULL, NULL, 1);
  IF NOT FOUND THEN RETURN NULL; END IF;
  s := ql3.task_attempt_snapshot(c.run_id, c.step_run_id, c.step_run_version);
  PERFORM ql3.task_attempt_admit(c.run_id, c.step_run_id, c.step_run_version, c.step_run_digest, s -> 'execution_revision');
  SELECT * INTO l FROM ql3.lease_acquire('sql-driver', 'local_process', 1, 30000);
  PERFORM ql3.attempt_start(l.attempt_id, l.lease_token);
  PERFORM ql3.attempt_running(l.attempt_id, l.lease_token);
  PERFORM ql3.attempt_complete(l.attempt_id, l.lease_token, p_outcome, 0, NULL);
  RETURN l.step_key;
END $$"""


def test_chain_of_128(qlpg_db, as_role, ql3_owner):
    """Driven in SQL as the superuser (a member of every role): one transaction per step, in which the
    runtime admits the only candidate and a worker leases, starts, runs and completes it."""
    steps = chain(128)
    run = _start(as_role, "chain", steps, "run:chain", task_of={k: "t" for k in steps})
    ql3_owner.execute(_DRIVE_ONE)
    done = []
    for _ in range(130):
        key = ql3_owner.execute("SELECT pg_temp.drive_one('succeeded')").fetchone()[0]
        if key is None:
            break
        done.append(key)
        # at every point exactly one step is ready (the next one) or none (the end)
        ready = ql3_owner.execute("SELECT array_agg(step_key) FROM ql3.step_runs WHERE run_id = %s AND status = 'ready'",
                                  (run,)).fetchone()[0]
        assert ready == (None if len(done) == 128 else [f"s{len(done):03d}"])
    assert done == sorted(steps)
    status, states = run_state(ql3_owner, run)
    assert status == "succeeded" and set(states.values()) == {"succeeded"}
    muts = _mutations(ql3_owner, run)
    for i in range(1, 128):
        assert _xmin(muts, f"s{i:03d}", "ready") == _xmin(muts, f"s{i - 1:03d}", "succeeded")
    assert _final_event(ql3_owner, run) == "workflow.run_succeeded"
    check_audit_invariants(ql3_owner, run)


@pytest.mark.parametrize("isolation", ["serializable", "read committed"])
def test_fan_in_three_parents_complete_concurrently(qlpg_db, as_role, ql3_owner, monkeypatch, isolation):
    monkeypatch.setenv("QLPG_ISOLATION", isolation)
    wf = {"p1": [], "p2": [], "p3": [], "child": ["p1", "p2", "p3"]}
    pm = as_role("ql3_package_manager")
    install(pm, package("fanin", {"wf": wf}))
    pe = as_role("ql3_package_executor")
    rounds = 10
    runs = [installmod.start_workflow(pe, "default", "fanin", "wf", f"run:fanin-{i:02d}").run_id for i in range(rounds)]
    drv = Driver(as_role)
    drv.admit()
    leases: dict[tuple[str, str], api.Lease] = {}
    for lease in api.lease_acquire(drv.wi, "w", max_=64):
        leases[(lease.run_id, lease.step_key)] = lease
        drv.start(lease)
    workers = [as_role("ql3_worker_ingress") for _ in range(3)]
    for run in runs:
        barrier = threading.Barrier(3)
        out: list = [None] * 3

        def complete(k: int, run=run, barrier=barrier, out=out) -> None:
            lease = leases[(run, f"p{k + 1}")]
            barrier.wait()
            try:
                out[k] = api.attempt_complete(workers[k], lease.attempt_id, lease.lease_token, "succeeded", 0)
            except Exception as exc:  # noqa: BLE001 - a deadlock or anything else fails the test below
                out[k] = exc

        ts = [threading.Thread(target=complete, args=(k,)) for k in range(3)]
        [t.start() for t in ts]
        [t.join(30) for t in ts]
        assert all(isinstance(o, dict) and o["outcome"] == "succeeded" for o in out), out
        muts = _mutations(ql3_owner, run)
        child = [m for m in muts if m[0] == "child"]
        assert [(m[1], m[2], m[3]) for m in child] == [(1, None, "pending"), (2, "pending", "ready")], child
        # the child became ready in the transaction of the parent that committed last
        parents = sorted((m[4], m[5]) for m in muts if m[0] != "child" and m[3] == "succeeded")
        assert len(parents) == 3 and child[1][5] == parents[-1][1] and child[1][4] == parents[-1][0] + 1
        assert ql3_owner.execute("SELECT status, unmet_needs FROM ql3.step_runs WHERE run_id = %s AND step_key = 'child'",
                                 (run,)).fetchone() == ("ready", 0)
        check_audit_invariants(ql3_owner, run)
    assert drv.drive() == 1
    for run in runs:
        assert run_state(ql3_owner, run) == ("succeeded", dict.fromkeys(wf, "succeeded"))
        check_audit_invariants(ql3_owner, run)


def test_skip_cascade_through_a_step_with_several_parents(qlpg_db, as_role, ql3_owner):
    # a, b roots; c needs a and b; d needs c; e needs d and b; f needs b only
    wf = {"a": [], "b": [], "c": ["a", "b"], "d": ["c"], "e": ["d", "b"], "f": ["b"]}
    run = _start(as_role, "cascade", wf, "run:cascade")
    drv = Driver(as_role)
    drv.admit()
    leases = drv.lease_all()
    drv.start(leases["a"]), drv.start(leases["b"])
    drv.complete(leases["a"], "failed", 2)
    status, states = run_state(ql3_owner, run)
    assert status == "running"
    assert states == {"a": "failed", "b": "running", "c": "skipped", "d": "skipped", "e": "skipped", "f": "pending"}
    muts = _mutations(ql3_owner, run)
    for k in "cde":
        assert [(m[2], m[3]) for m in muts if m[0] == k] == [(None, "pending"), ("pending", "skipped")]
        assert _xmin(muts, k, "skipped") == _xmin(muts, "a", "failed")
        assert next(m[6] for m in muts if m[0] == k and m[3] == "skipped") == "dependency a ended failed"
    drv.complete(leases["b"])  # b succeeds: only f becomes ready; skipped steps stay skipped
    assert run_state(ql3_owner, run)[1] == {"a": "failed", "b": "succeeded", "c": "skipped", "d": "skipped",
                                            "e": "skipped", "f": "ready"}
    assert drv.step_ready() == ["f"]
    assert run_state(ql3_owner, run)[0] == "failed"
    assert _final_event(ql3_owner, run) == "workflow.run_failed"
    check_audit_invariants(ql3_owner, run)


CHAIN_WITH_SIDE = {"a": [], "b": ["a"], "c": ["b"], "d": ["a", "side"], "side": [], "other": ["side"]}


@pytest.mark.parametrize("outcome", ["failed", "timed_out", "cancelled"])
def test_failed_timed_out_or_cancelled_parent_skips_every_transitive_dependent(qlpg_db, as_role, ql3_owner, outcome):
    """a ends ``outcome``: b, c (transitive) and d (a and side) are skipped; side and other are not.
    timed_out is decided by database time (a 1 ms task deadline, completed later); cancelled needs a
    Run cancel request, which also decides the Run's end."""
    run = _start(as_role, f"skip-{outcome.replace('_', '-')}", CHAIN_WITH_SIDE, f"run:skip-{outcome}",
                 timeouts={"t-a": 1} if outcome == "timed_out" else {})
    drv = Driver(as_role)
    drv.admit()
    leases = drv.lease_all()
    assert set(leases) == {"a", "side"}
    if outcome == "timed_out":
        drv.start(leases["a"], running=False)
        time.sleep(0.05)
        drv.complete(leases["a"], "succeeded")  # the worker says succeeded; the database says timed_out
    else:
        drv.start(leases["a"])
        if outcome == "cancelled":
            api.run_cancel_request(as_role("ql3_admin"), run, "user", "tester")
        drv.complete(leases["a"], outcome)
    status, states = run_state(ql3_owner, run)
    assert states == {"a": outcome, "b": "skipped", "c": "skipped", "d": "skipped",
                      "side": "ready", "other": "pending"}
    muts = _mutations(ql3_owner, run)
    for k in ("b", "c", "d"):
        assert _xmin(muts, k, "skipped") == _xmin(muts, "a", outcome)
    assert status == "running"
    if outcome == "cancelled":
        rt = as_role("ql3_runtime")
        api.run_cancel_converge(rt, run)  # unstarted work (side's claimed attempt, other) is cancelled
        expected = "cancelled"
    else:
        drv.start(leases["side"])
        drv.complete(leases["side"])
        assert run_state(ql3_owner, run)[1]["other"] == "ready"
        drv.drive()
        expected = outcome
    status, states = run_state(ql3_owner, run)
    assert status == expected and set(states.values()) <= TERMINAL, states
    assert _final_event(ql3_owner, run) == f"workflow.run_{expected}"
    check_audit_invariants(ql3_owner, run)


@pytest.mark.parametrize("outcomes, expected", [
    ({"r1": "succeeded", "r2": "succeeded"}, "succeeded"),
    ({"r1": "failed", "r2": "timed_out"}, "failed"),
    ({"r1": "timed_out", "r2": "succeeded"}, "timed_out"),
])
def test_run_aggregation_rule(qlpg_db, as_role, ql3_owner, outcomes, expected):
    """Once every step is terminal: failed if any failed, else timed_out if any timed out, else
    succeeded (the cancelled case is in the test above)."""
    wf = {"r1": [], "r2": [], "j": ["r1", "r2"]}
    slow = {f"t-{k}": 1 for k, o in outcomes.items() if o == "timed_out"}  # a 1 ms task deadline
    run = _start(as_role, f"agg-{expected.replace('_', '-')}", wf, f"run:agg-{expected}", timeouts=slow)
    drv = Driver(as_role)
    drv.admit()
    leases = drv.lease_all()
    for k in ("r1", "r2"):
        if outcomes[k] == "timed_out":
            # database time decides: completed after its 1 ms deadline, whatever the worker says
            drv.start(leases[k], running=False)
            time.sleep(0.05)
            drv.complete(leases[k], "succeeded")
        else:
            drv.start(leases[k])
            drv.complete(leases[k], outcomes[k])
    status, states = run_state(ql3_owner, run)
    if expected == "succeeded":
        assert states["j"] == "ready"
        drv.drive()
        status, states = run_state(ql3_owner, run)
    else:
        assert states["j"] == "skipped"
    assert status == expected, states
    assert _final_event(ql3_owner, run) == f"workflow.run_{expected}"
    check_audit_invariants(ql3_owner, run)
