"""Workflow plan admission (ADR-0223 §3): one transaction, exact replay, lost COMMIT responses."""

from __future__ import annotations

import threading

import psycopg
import pytest

from qlpg import api, errors, install, plan as planmod

from helpers import EXAMPLES, check_audit_invariants


def test_same_plan_twice_is_one_run(qlpg_db, as_role, ql3_owner):
    pm = as_role("ql3_package_manager")
    install.install_package(pm, EXAMPLES / "pg-backup")
    pe = as_role("ql3_package_executor")
    plan, digest = install.prepare_plan(pe, "default", "pg-backup", "backup")
    first = install.admit_plan(pe, plan, digest)
    second = install.admit_plan(pe, plan, digest)
    assert not first.replayed and second.replayed
    assert (first.run_id, first.receipt, first.receipt_digest) == (second.run_id, second.receipt, second.receipt_digest)
    assert ql3_owner.execute("SELECT count(*) FROM ql3.runs").fetchone()[0] == 1
    assert ql3_owner.execute("SELECT count(*) FROM ql3.step_runs").fetchone()[0] == 8
    check_audit_invariants(ql3_owner)


def test_concurrent_admissions_of_one_plan(qlpg_db, as_role, ql3_owner):
    install.install_package(as_role("ql3_package_manager"), EXAMPLES / "fanout")
    plan, digest = install.prepare_plan(as_role("ql3_package_executor"), "default", "fanout", "fanout")
    conns = [as_role("ql3_package_executor") for _ in range(8)]
    results, errs = [], []
    barrier = threading.Barrier(len(conns))

    def go(c):
        barrier.wait()
        try:
            results.append(install.admit_plan(c, plan, digest))
        except Exception as exc:  # pragma: no cover - reported below
            errs.append(exc)

    ts = [threading.Thread(target=go, args=(c,)) for c in conns]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errs
    assert sum(not r.replayed for r in results) == 1
    assert len({r.receipt_digest for r in results}) == 1
    assert ql3_owner.execute("SELECT count(*) FROM ql3.runs").fetchone()[0] == 1
    check_audit_invariants(ql3_owner)


def test_lost_commit_response_is_answered_by_inspect(qlpg_db, as_role, ql3_owner):
    """Kill the admitting backend right after COMMIT: the client sees an error, inspect has the receipt."""
    install.install_package(as_role("ql3_package_manager"), EXAMPLES / "pg-backup")
    pe = as_role("ql3_package_executor")
    plan, digest = install.prepare_plan(pe, "default", "pg-backup", "backup")
    victim = as_role("ql3_package_executor")
    pid = victim.info.backend_pid
    # Admit inside an explicit transaction, COMMIT, then terminate the backend before the client
    # reads anything more: the durable receipt must be there although the session is gone.
    victim.autocommit = False
    import json

    row = victim.execute("SELECT receipt_digest FROM ql3.workflow_plan_admit(%s::json)",
                         (json.dumps(dict(plan, plan_digest=digest)),)).fetchone()
    victim.pgconn.send_query(b"COMMIT")  # the response is never read
    import time

    for _ in range(100):  # wait until the COMMIT is durable and visible, then kill the session
        if ql3_owner.execute("SELECT 1 FROM ql3.workflow_admissions WHERE plan_digest = %s", (digest,)).fetchone():
            break
        time.sleep(0.05)
    ql3_owner.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(psycopg.OperationalError):
        victim.execute("SELECT 1")
    rec = api.workflow_admission_inspect(pe, plan_digest=digest)
    assert rec.receipt_digest == row["receipt_digest"] and rec.replayed
    # and re-sending the same plan creates nothing new
    again = install.admit_plan(pe, plan, digest)
    assert again.replayed and again.run_id == rec.run_id
    assert ql3_owner.execute("SELECT count(*) FROM ql3.runs").fetchone()[0] == 1


def test_inspect_before_commit_is_unavailable(qlpg_db, as_role):
    pe = as_role("ql3_package_executor")
    with pytest.raises(errors.Unavailable):
        api.workflow_admission_inspect(pe, run_id="run:nothing")


@pytest.mark.parametrize("mutate, error", [
    (lambda p: p.update(generation=99), errors.StaleFence),
    (lambda p: p.update(publication_digest="0" * 64), errors.StaleFence),
    (lambda p: p["steps"].pop(), errors.InvalidInput),
    (lambda p: p["steps"][1].update(step_run_id=p["steps"][0]["step_run_id"]), errors.InvalidInput),
    (lambda p: p["steps"][0].update(source_digest="1" * 64), errors.StaleFence),
    (lambda p: p["steps"][0].update(task_reference="pkgref:v1:other:1:x"), errors.StaleFence),
    (lambda p: p.update(extra=1), errors.InvalidInput),
])
def test_drift_is_refused_and_writes_nothing(qlpg_db, as_role, ql3_owner, mutate, error):
    install.install_package(as_role("ql3_package_manager"), EXAMPLES / "pg-backup")
    pe = as_role("ql3_package_executor")
    plan, _ = install.prepare_plan(pe, "default", "pg-backup", "backup")
    mutate(plan)
    with pytest.raises(error):
        api.workflow_plan_admit(pe, plan)
    assert ql3_owner.execute("SELECT count(*) FROM ql3.runs").fetchone()[0] == 0
    assert ql3_owner.execute("SELECT count(*) FROM ql3.run_events").fetchone()[0] == 0


def test_plan_digest_mismatch_is_integrity_failure(qlpg_db, as_role):
    install.install_package(as_role("ql3_package_manager"), EXAMPLES / "pg-backup")
    pe = as_role("ql3_package_executor")
    plan, digest = install.prepare_plan(pe, "default", "pg-backup", "backup")
    with pytest.raises(errors.IntegrityFailure):
        api.workflow_plan_admit(pe, dict(plan, plan_digest="f" * 64))
    # Python and SQL agree on the digest of the accepted plan
    rec = api.workflow_plan_admit(pe, dict(plan, plan_digest=digest))
    assert rec.plan_digest == digest == planmod.plan_digest(plan)


@pytest.mark.parametrize("role", ["ql3_admin", "ql3_package_manager", "ql3_runtime", "ql3_worker_ingress", "nobody"])
def test_admission_as_wrong_role_is_denied(qlpg_db, as_role, role):
    install.install_package(as_role("ql3_package_manager"), EXAMPLES / "pg-backup")
    plan, digest = install.prepare_plan(as_role("ql3_package_executor"), "default", "pg-backup", "backup")
    with pytest.raises((errors.NotInRole, psycopg.errors.InsufficientPrivilege)):
        api.workflow_plan_admit(as_role(role), dict(plan, plan_digest=digest))
