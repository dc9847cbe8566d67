"""Revocation and quarantine against concurrent starts (ADR-0223 §3-4), with real sessions.

(a) A revocation / quarantine that commits first blocks every later admission: four admissions
    that start while it is in flight wait on the security boundary (seen in ``pg_stat_activity`` and
    ``pg_locks``), and when it commits every one of them is refused with QL301 and writes nothing — at
    SERIALIZABLE (the shell's default), REPEATABLE READ and READ COMMITTED. (Before the boundary rows
    of ``ql3.security_boundaries`` existed, the first two admitted the Run on their stale snapshot.)
(b) An admission in flight (its transaction held open after ``workflow_plan_admit`` returned) makes the
    revocation / quarantine wait until it commits; the revocation then completes after it and covers
    the admitted Run: its next Task Attempt admission is refused (QL301).
(c) Quarantine and revocation refuse new Task Attempt admissions of the package's Runs, also when
    they commit while an attempt admission waits, while a step already running completes on its
    pinned revision.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from qlpg import api, errors, install as installmod, plan as planmod

from helpers import check_audit_invariants
from test_plan_support import DIAMOND, RUNTIME_TABLES, Driver, install, package, row_counts, run_state

PUBLISHER = "race-publisher"


def _setup(as_role, name="race"):
    pm = as_role("ql3_package_manager")
    install(pm, package(name, {"wf": DIAMOND}, publisher=PUBLISHER))
    return pm, as_role("ql3_package_executor")


def _boundary_change(conn: psycopg.Connection, kind: str, name: str = "race") -> list:
    """Quarantine, revoke, withdraw the current publication, or publish generation 2 (materialized and
    reconciled beforehand by :func:`_prepare_generation_2`) — in ``conn``'s transaction."""
    if kind == "revoke":
        return conn.execute("SELECT * FROM ql3.publisher_revoke(%s, 'key compromised', 'secops')", (PUBLISHER,)).fetchall()
    if kind == "quarantine":
        return conn.execute("SELECT * FROM ql3.package_quarantine('default', %s, 'malware', 'secops')", (name,)).fetchall()
    if kind == "withdraw":
        pub = conn.execute("SELECT publication_id FROM ql3.automation_publish('default', %s, 1)", (name,)).fetchone()
        return conn.execute("SELECT * FROM ql3.automation_withdraw(%s, 'retired')", (pub["publication_id"],)).fetchall()
    if kind == "publish":
        return conn.execute("SELECT * FROM ql3.automation_publish('default', %s, 2)", (name,)).fetchall()
    raise AssertionError(kind)


def _prepare_generation_2(pm, name: str = "race") -> None:
    from qlpg import manifest as manifestmod

    man = manifestmod.parse_manifest(package(name, {"wf": DIAMOND}, publisher=PUBLISHER, version="2.0.0"),
                                     path="<t>", directory=".")
    m = api.package_revision_materialize(pm, planmod.materialized_document(man))
    assert m["generation"] == 2
    api.task_reconciliation_record(pm, "default", name, 2)


def _wait_for_lock_waiters(owner, pids: list[int], timeout: float = 10.0) -> None:
    """Until every pid waits on a heavyweight lock (an advisory lock of the security boundary)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = owner.execute(
            "SELECT a.pid FROM pg_stat_activity a WHERE a.pid = ANY(%s) AND a.wait_event_type = 'Lock'"
            " AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND NOT l.granted AND l.locktype = 'advisory')",
            (pids,)).fetchall()
        if len(rows) == len(pids):
            return
        assert time.monotonic() < deadline, f"not all of {pids} wait on the advisory boundary: {rows}"
        time.sleep(0.02)


REFUSAL = {"revoke": "is revoked", "quarantine": "is quarantined", "withdraw": "is withdrawn",
           "publish": "is not the current publication"}


@pytest.mark.parametrize("kind, isolation", [(k, i) for k in ("revoke", "quarantine")
                                             for i in ("serializable", "repeatable read", "read committed")]
                         + [("withdraw", "serializable"), ("publish", "serializable")])
def test_boundary_change_committed_first_blocks_every_later_admission(qlpg_db, as_role, ql3_owner, monkeypatch,
                                                                       kind, isolation):
    monkeypatch.setenv("QLPG_ISOLATION", isolation)
    monkeypatch.setenv("QLPG_ADMISSION_ISOLATION", isolation)
    pm, pe = _setup(as_role)
    if kind == "publish":
        _prepare_generation_2(pm)
    snap = api.workflow_admission_snapshot(pe, "default", "race", "wf")
    plans = [planmod.build_plan(snap, f"run:late-{i}") for i in range(4)]
    conns = [as_role("ql3_package_executor") for _ in plans]
    pids = [c.info.backend_pid for c in conns]
    changer = as_role("ql3_package_manager", autocommit=False)
    _boundary_change(changer, kind)  # in flight: holds the exclusive boundary
    before = row_counts(ql3_owner, RUNTIME_TABLES)
    results: list = [None] * len(plans)

    def admit(i):
        try:
            results[i] = installmod.admit_plan(conns[i], plans[i], planmod.plan_digest(plans[i]))
        except Exception as exc:  # noqa: BLE001 - inspected below
            results[i] = exc

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(len(plans))]
    [t.start() for t in threads]
    _wait_for_lock_waiters(ql3_owner, pids)
    changer.commit()
    [t.join(30) for t in threads]
    assert all(isinstance(r, errors.StartGuardDenied) for r in results), results
    assert all(REFUSAL[kind] in str(r) for r in results), results
    assert row_counts(ql3_owner, RUNTIME_TABLES) == before
    # and from now on: the snapshot (except after a publish: it then answers generation 2) and any
    # admission of these plans are refused
    if kind != "publish":
        with pytest.raises(errors.StartGuardDenied):
            api.workflow_admission_snapshot(pe, "default", "race", "wf")
    with pytest.raises(errors.StartGuardDenied):
        installmod.admit_plan(pe, plans[0], planmod.plan_digest(plans[0]))
    assert row_counts(ql3_owner, RUNTIME_TABLES) == before


@pytest.mark.parametrize("kind, isolation", [("revoke", psycopg.IsolationLevel.READ_COMMITTED),
                                             ("quarantine", psycopg.IsolationLevel.SERIALIZABLE)])
def test_admission_in_flight_makes_the_boundary_change_wait(qlpg_db, as_role, ql3_owner, kind, isolation):
    pm, pe = _setup(as_role)
    plan, digest = installmod.prepare_plan(pe, "default", "race", "wf", "run:in-flight")
    admitter = as_role("ql3_package_executor", autocommit=False)
    admitter.isolation_level = isolation
    rec = admitter.execute("SELECT * FROM ql3.workflow_plan_admit(%s::json)",
                           (__import__("json").dumps(dict(plan, plan_digest=digest)),)).fetchone()
    assert rec["replayed"] is False  # the function returned; the transaction is still open
    held = ql3_owner.execute(
        "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND granted AND mode = 'ShareLock'",
        (admitter.info.backend_pid,)).fetchone()[0]
    assert held >= 2  # package and publisher boundaries, shared
    changer = as_role("ql3_package_manager")
    done: dict = {}

    def change():
        try:
            done["rows"] = (api.publisher_revoke(changer, PUBLISHER, "key compromised", "secops") if kind == "revoke"
                            else api.package_quarantine(changer, "default", "race", "malware", "secops"))
            done["at"] = time.monotonic()
        except Exception as exc:  # noqa: BLE001
            done["error"] = exc

    t = threading.Thread(target=change)
    t.start()
    _wait_for_lock_waiters(ql3_owner, [changer.info.backend_pid])
    time.sleep(0.3)
    assert t.is_alive() and not done, "the revocation did not wait for the admission in flight"
    # nothing of the in-flight admission is visible yet to anyone else
    assert ql3_owner.execute("SELECT count(*) FROM ql3.runs").fetchone()[0] == 0
    admitter.commit()
    committed_at = time.monotonic()
    t.join(30)
    assert "error" not in done, done
    assert done["rows"]["outcome"] == "inserted" and done["at"] >= committed_at
    # the admitted Run exists, was admitted before the change, and the change covers it
    run = ql3_owner.execute("SELECT id, created_at_ms FROM ql3.runs WHERE id = 'run:in-flight'").fetchone()
    changed_at = done["rows"]["revoked_at_ms" if kind == "revoke" else "quarantined_at_ms"]
    assert run is not None and run[1] <= changed_at
    drv = Driver(as_role)
    with pytest.raises(errors.StartGuardDenied):
        drv.admit()
    assert ql3_owner.execute("SELECT count(*) FROM ql3.task_attempt_admissions").fetchone()[0] == 0
    check_audit_invariants(ql3_owner, "run:in-flight")


@pytest.mark.parametrize("kind", ["revoke", "quarantine"])
def test_running_step_finishes_on_its_pinned_revision_but_no_new_attempt_starts(qlpg_db, as_role, ql3_owner, kind):
    wf = {"a": [], "b": [], "c": ["a"]}
    pm, pe = _setup(as_role, "pinned")
    install(pm, package("pinned", {"wf": wf}, publisher=PUBLISHER))
    rec = installmod.start_workflow(pe, "default", "pinned", "wf", "run:pinned")
    drv = Driver(as_role)
    admitted = {r.receipt["step_run_id"]: r for r in drv.admit()}
    leases = drv.lease_all()
    drv.start(leases["a"])  # a is running; b is claimed (admitted before the change, not started)
    pinned = leases["a"].execution_revision
    _boundary_change(pm, kind, "pinned")
    # a finishes on the revision it was admitted with
    done = drv.complete(leases["a"])
    assert done["outcome"] == "succeeded"
    row = ql3_owner.execute("SELECT task_revision, execution_digest FROM ql3.run_attempts WHERE id = %s",
                            (leases["a"].attempt_id,)).fetchone()
    assert (row[0], row[1]) == (pinned["task_revision"], pinned["content_digest"])
    assert admitted[leases["a"].step_run_id].receipt["execution_digest"] == pinned["content_digest"]
    # c became ready (frontier), but its Task Attempt admission is refused, by candidates and directly
    status, steps = run_state(ql3_owner, rec.run_id)
    assert status == "running" and steps["c"] == "ready" and steps["a"] == "succeeded"
    before = row_counts(ql3_owner)
    rt = as_role("ql3_runtime")
    cand = [c for c in api.task_attempt_candidates(rt) if c["run_id"] == rec.run_id]
    assert [c["step_run_id"] for c in cand] == [planmod.step_run_id(rec.run_id, "c")]
    c = cand[0]
    snap = ql3_owner.execute("SELECT ql3.task_attempt_snapshot(%s, %s, %s)",
                             (c["run_id"], c["step_run_id"], c["step_run_version"])).fetchone()[0]
    with pytest.raises(errors.StartGuardDenied, match="revoked" if kind == "revoke" else "quarantined"):
        api.task_attempt_admit(rt, c["run_id"], c["step_run_id"], c["step_run_version"], c["step_run_digest"],
                               snap["execution_revision"])
    assert row_counts(ql3_owner) == before
    check_audit_invariants(ql3_owner, rec.run_id)


@pytest.mark.parametrize("kind", ["revoke", "quarantine"])
def test_attempt_admission_waiting_on_a_boundary_change_is_refused(qlpg_db, as_role, ql3_owner, kind):
    """task_attempt_admit (shell default SERIALIZABLE) waits for the in-flight change, then QL301."""
    pm, pe = _setup(as_role)
    rec = installmod.start_workflow(pe, "default", "race", "wf", "run:att")
    rt = as_role("ql3_runtime")
    c = api.task_attempt_candidates(rt)[0]
    snap = api.task_attempt_snapshot(rt, c["run_id"], c["step_run_id"], c["step_run_version"])
    changer = as_role("ql3_package_manager", autocommit=False)
    _boundary_change(changer, kind)
    out: dict = {}

    def admit():
        try:
            out["r"] = api.task_attempt_admit(rt, c["run_id"], c["step_run_id"], c["step_run_version"],
                                              c["step_run_digest"], snap["execution_revision"])
        except Exception as exc:  # noqa: BLE001
            out["e"] = exc

    t = threading.Thread(target=admit)
    t.start()
    _wait_for_lock_waiters(ql3_owner, [rt.info.backend_pid])
    changer.commit()
    t.join(30)
    assert isinstance(out.get("e"), errors.StartGuardDenied), out
    assert ql3_owner.execute("SELECT count(*) FROM ql3.task_attempt_admissions").fetchone()[0] == 0
    assert run_state(ql3_owner, rec.run_id)[0] == "running"
    check_audit_invariants(ql3_owner, rec.run_id)
