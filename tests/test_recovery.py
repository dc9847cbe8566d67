"""Lost-attempt recovery with real worker processes and ``kill -9`` (ADR-0227 §6).

* a ``claimed`` attempt that never had a lease is dispatcher backlog: recovery never touches it;
* lease expired while ``claimed`` (a dead holder never started it) → Attempt ``lost``, StepRun
  ``ready → ready`` (version + 1, new digest, attempt count and ready time kept), Run ``running``;
  the new epoch is admitted again with the next Run-global attempt number and completes;
* lease expired while ``starting``/``running`` → without trusted evidence the control goes to
  ``retry`` with backoff and to ``manual`` after 5 tries, changing nothing else; trusted
  ``not_running`` evidence (a worker restarting under the same id, or an operator through
  ``qlpg recover``) → Attempt ``lost``, StepRun ``failed`` (``running → lost → failed``), dependents
  skipped; never a silent retry past the start barrier.
"""

from __future__ import annotations

import psycopg
import psycopg.rows
import pytest

from qlpg import api, errors
from qlpg.runtime import Runtime
from qlpg.worker import Worker

from helpers import check_audit_invariants
from lifecycle_helpers import owner  # noqa: F401  (fixture)
from lifecycle_helpers import (ADMIN, RUNTIME, WORKER, admit_step, attempt, candidates, control, events,
                               footprint, kill9, kill_group_quietly, lease_one, mutations, owner_conn,
                               pid_alive, qlpg, require_direct_sessions, run_row, spawn_worker, start_run,
                               step, steps, task, terminate_backends, wait_db_time_past, wait_until,
                               write_package)

LEASE_MS = 1000
# Leases that must outlive a worker subprocess start-up and a kill before the "nothing is lost yet"
# assertion, even on a loaded machine.
SLOW_LEASE_MS = 8000
SLEEPER = ("bash", "-c", 'echo $$ > "$QLPG_RUN_DIR/$QLPG_STEP_KEY.pid"; exec sleep 60')


@pytest.fixture
def pkg(tmp_path):
    return write_package(tmp_path, "recovpkg", {"quick": task("true"), "sleeper": task(*SLEEPER, timeout_ms=120000)}, {
        "prestart": {"a": {"task": "quick"}, "b": {"task": "quick"}, "c": {"task": "quick"},
                     "d": {"task": "quick", "needs": ["a", "b", "c"]}},
        "poststart": {"s": {"task": "sleeper"}, "r": {"task": "sleeper"}, "z": {"task": "quick"},
                      "s-next": {"task": "quick", "needs": ["s"]}, "r-next": {"task": "quick", "needs": ["r"]}},
    })


def _drain(qlpg_db, tmp_path, run_id: str, owner) -> None:
    """Drive runtime passes and an in-process worker until the Run ends."""
    rt = Runtime(qlpg_db.conninfo_as(RUNTIME))
    wk = Worker(qlpg_db.conninfo_as(WORKER), "w-drain", tmp_path / "drain", lease_ms=5000)
    try:
        for _ in range(20):
            rt.run_once()
            while wk.run_once():
                pass
            if run_row(owner, run_id)["status"] != "running":
                return
        raise AssertionError(f"run {run_id} did not end: {steps(owner, run_id)}")
    finally:
        rt.close()
        wk.close()


def test_pre_start_loss_opens_a_new_epoch_and_backlog_is_untouched(qlpg_db, owner, as_role, ql3_owner, pkg, tmp_path):
    require_direct_sessions()
    run_id = start_run(as_role, pkg, "prestart")
    rt, wk = as_role(RUNTIME), as_role(WORKER)
    state = tmp_path / "state"
    state.mkdir()
    # a: leased through the SQL API by a holder that dies without ever starting it
    a1 = admit_step(rt, run_id, "a")
    dead = lease_one(wk, a1.attempt_id, "w-dead", lease_ms=SLOW_LEASE_MS)
    # b: a real `qlpg worker` leases it and is killed -9 before its start barrier (it is held at
    # attempt_start by the Run lock this test takes; lease_acquire does not need that lock)
    b1 = admit_step(rt, run_id, "b")
    blocker = owner_conn(qlpg_db)
    blocker.autocommit = False
    blocker.execute("SELECT pg_advisory_xact_lock(hashtextextended('ql3-run:' || %s, 0))", (run_id,))
    proc = spawn_worker(qlpg_db, "w-kill-b", state, lease_ms=SLOW_LEASE_MS)
    try:
        wait_until(lambda: attempt(owner, b1.attempt_id)["lease_active"], what="b leased by the worker")
        wait_until(lambda: owner.execute(
            "SELECT 1 FROM pg_stat_activity WHERE application_name = 'qlpg-worker:w-kill-b'"
            " AND wait_event_type = 'Lock' AND query LIKE %s", ("%attempt_start%",)).fetchone(),
            what="worker waiting in attempt_start")
        kill9(proc)
        terminate_backends(owner, "w-kill-b")
    finally:
        if proc.poll() is None:
            proc.kill()
        blocker.rollback()
        blocker.close()
    assert attempt(owner, b1.attempt_id)["status"] == "claimed"
    # c: admitted, never leased: dispatcher backlog
    c1 = admit_step(rt, run_id, "c")
    before = {k: step(owner, run_id, k) for k in ("a", "b", "c")}
    run_before = run_row(owner, run_id)

    # nothing is lost before the leases expire (database time)
    assert api.recovery_claim(rt, "rt-early", 64, 30000) == []
    wait_db_time_past(owner, max(attempt(owner, x)["lease_expires_at_ms"] for x in (a1.attempt_id, b1.attempt_id)))
    res = qlpg(qlpg_db, RUNTIME, "runtime", "--once")
    assert res.returncode == 0, res.stderr
    assert "recovered 2" in res.stdout, res.stdout

    for key, rec in (("a", a1), ("b", b1)):
        att = attempt(owner, rec.attempt_id)
        assert (att["status"], att["lease_active"], att["started_at_ms"]) == ("lost", False, None)
        s = step(owner, run_id, key)
        b = before[key]
        assert s["status"] == "ready" and s["version"] == b["version"] + 1 and s["digest"] != b["digest"]
        assert (s["attempt_count"], s["ready_at_ms"]) == (b["attempt_count"], b["ready_at_ms"]) == (0, b["ready_at_ms"])
        assert mutations(owner, s["id"])[-1] == ("ready", "ready")
        (lost,) = events(owner, run_id, "workflow.task_attempt_lost", rec.attempt_id)
        assert lost["payload"]["before_start"] is True
        rc = control(owner, rec.attempt_id)
        assert (rc["status"], rc["resolution"]) == ("resolved", "lost_before_start")
        assert owner.execute("SELECT end_reason FROM ql3.run_dispatch_leases WHERE attempt_id = %s",
                             (rec.attempt_id,)).fetchone()["end_reason"] == "expired"
    # backlog untouched
    assert attempt(owner, c1.attempt_id)["status"] == "claimed" and control(owner, c1.attempt_id) is None
    assert step(owner, run_id, "c") == before["c"]
    r = run_row(owner, run_id)
    assert r["status"] == "running" and r["cancel_requested_at_ms"] is None and r["last_attempt"] == run_before["last_attempt"]
    # the dead holder's token cannot start anything any more
    with pytest.raises(errors.LeaseInvalid):
        api.attempt_start(wk, dead.attempt_id, dead.lease_token)

    # a second admission of each new epoch, with the next Run-global attempt numbers
    assert {c["step_key"] for c in candidates(rt, run_id)} == {"a", "b"}
    a2, b2 = admit_step(rt, run_id, "a"), admit_step(rt, run_id, "b")
    assert sorted([a2.attempt, b2.attempt]) == [4, 5] and a2.attempt_id != a1.attempt_id
    assert a2.receipt["step_run_version"] == before["a"]["version"] + 1
    _drain(qlpg_db, tmp_path, run_id, owner)
    assert run_row(owner, run_id)["status"] == "succeeded"
    assert steps(owner, run_id) == {"a": "succeeded", "b": "succeeded", "c": "succeeded", "d": "succeeded"}
    assert step(owner, run_id, "a")["attempt_count"] == 1
    assert owner.execute("SELECT count(*) AS n FROM ql3.run_attempts WHERE run_id = %s", (run_id,)).fetchone()["n"] == 6
    check_audit_invariants(ql3_owner, run_id)


def test_kill9_after_start_needs_trusted_evidence(qlpg_db, owner, as_role, ql3_owner, pkg, tmp_path):
    require_direct_sessions()
    run_id = start_run(as_role, pkg, "poststart")
    rt, wk, adm = as_role(RUNTIME), as_role(WORKER), as_role(ADMIN)
    state = tmp_path / "state"
    state.mkdir()
    rundir = state / "runs" / run_id.replace(":", "_")
    children = []
    try:
        # s: the worker passed the start barrier and is held before its `running` report (this test
        # row-locks the StepRun, which only the running transition needs); kill -9 while `starting`
        s1 = admit_step(rt, run_id, "s")
        locker = owner_conn(qlpg_db)
        locker.autocommit = False
        locker.execute("SELECT 1 FROM ql3.step_runs WHERE run_id = %s AND step_key = 's' FOR NO KEY UPDATE", (run_id,))
        ps = spawn_worker(qlpg_db, "w-s", state, lease_ms=LEASE_MS)
        try:
            wait_until(lambda: attempt(owner, s1.attempt_id)["status"] == "starting", what="s starting")
            wait_until(lambda: (rundir / "s.pid").exists() and (rundir / "s.pid").read_text().strip(), what="s pid")
            children.append(int((rundir / "s.pid").read_text()))
            wait_until(lambda: owner.execute(
                "SELECT 1 FROM pg_stat_activity WHERE application_name = 'qlpg-worker:w-s'"
                " AND wait_event_type = 'Lock'").fetchone(), what="worker waiting in attempt_running")
            kill9(ps)
            terminate_backends(owner, "w-s")
        finally:
            if ps.poll() is None:
                ps.kill()
            locker.rollback()
            locker.close()
        # r: running a sleeping task; kill -9 the worker (the task's process lives on: unknown state)
        r1 = admit_step(rt, run_id, "r")
        pr = spawn_worker(qlpg_db, "w-r", state, lease_ms=LEASE_MS)
        try:
            wait_until(lambda: attempt(owner, r1.attempt_id)["status"] == "running", what="r running")
            wait_until(lambda: (rundir / "r.pid").exists() and (rundir / "r.pid").read_text().strip(), what="r pid")
            children.append(int((rundir / "r.pid").read_text()))
            kill9(pr)
        finally:
            if pr.poll() is None:
                pr.kill()
        assert pid_alive(children[-1])  # kill -9 of a worker does not end its task: hence "unknown"
        # z succeeds normally
        z = lease_one(wk, admit_step(rt, run_id, "z").attempt_id)
        api.attempt_start(wk, z.attempt_id, z.lease_token)
        api.attempt_complete(wk, z.attempt_id, z.lease_token, "succeeded", 0)
        assert attempt(owner, s1.attempt_id)["status"] == "starting"
        assert attempt(owner, r1.attempt_id)["status"] == "running"
        assert steps(owner, run_id) == {"s": "ready", "r": "running", "z": "succeeded", "s-next": "pending", "r-next": "pending"}

        wait_db_time_past(owner, max(attempt(owner, x)["lease_expires_at_ms"] for x in (s1.attempt_id, r1.attempt_id)))
        loop = Runtime(qlpg_db.conninfo_as(RUNTIME), claimer_id="rt-test")
        try:
            # unknown evidence: retry with growing backoff, then manual after 5 tries; nothing else moves
            runs_before = footprint(owner)
            for n in range(1, 6):
                stats = loop.run_once()
                for x in (s1.attempt_id, r1.attempt_id):
                    rc = control(owner, x)
                    assert rc["failure_count"] == n and rc["last_evidence"] is None
                    if n < 5:
                        assert (rc["status"], rc["resolution"]) == ("retry", "awaiting_evidence")
                        assert rc["next_claim_at_ms"] - rc["updated_at_ms"] == min(60000, 1000 * 2 ** n)
                    else:
                        assert (rc["status"], rc["resolution"]) == ("manual", "needs_operator")
                assert (stats.recovery_retry, stats.recovery_manual) == ((2, 0) if n < 5 else (0, 2))
                assert loop.run_once().recovery_retry == 0  # backoff: not claimable yet
                # let the backoff pass (database time stands still for nobody: move the fence instead)
                owner.execute("UPDATE ql3.run_recovery_controls SET next_claim_at_ms = next_claim_at_ms - 120000"
                              " WHERE run_id = %s", (run_id,))
            assert loop.run_once().busy() is False  # manual controls are not claimable
            after = footprint(owner)
            assert after == runs_before  # no event, mutation, attempt or lease changed
            assert api.run_inspect(adm, run_id)["attempts"][0]["recovery"]["status"] == "manual"

            # trusted evidence: the worker of s restarts under the same id; an operator vouches for r
            res = qlpg(qlpg_db, WORKER, "worker", "--reset-session", "--once", "--worker-id", "w-s",
                       "--lease-ms", str(LEASE_MS), "--state-dir", str(state))
            assert res.returncode == 0 and "declared 1 previous lease(s) dead" in res.stdout, res.stdout + res.stderr
            res = qlpg(qlpg_db, ADMIN, "recover", "--attempt", r1.attempt_id, "--evidence", "not_running",
                       "--actor", "oncall")
            assert res.returncode == 0 and "not_running" in res.stdout, res.stdout + res.stderr
            for x in (s1.attempt_id, r1.attempt_id):
                assert control(owner, x)["status"] == "available"
            stats = loop.run_once()
            assert stats.recovered == 2 and stats.admitted == 0
        finally:
            loop.close()

        sa, ra = attempt(owner, s1.attempt_id), attempt(owner, r1.attempt_id)
        assert (sa["status"], ra["status"]) == ("lost", "lost")
        assert steps(owner, run_id) == {"s": "failed", "r": "failed", "z": "succeeded",
                                        "s-next": "skipped", "r-next": "skipped"}
        s_step, r_step = step(owner, run_id, "s"), step(owner, run_id, "r")
        assert mutations(owner, s_step["id"])[-1] == ("ready", "failed") and s_step["attempt_count"] == 0
        assert mutations(owner, r_step["id"])[-3:] == [("ready", "running"), ("running", "lost"), ("lost", "failed")]
        assert r_step["attempt_count"] == 1
        types = [e["type"] for e in events(owner, run_id) if e["step_run_id"] == r_step["id"]]
        assert types[-3:] == ["workflow.task_attempt_lost", "workflow.step_run_lost", "workflow.step_run_failed"]
        (ls,) = events(owner, run_id, "workflow.task_attempt_lost", s1.attempt_id)
        (lr,) = events(owner, run_id, "workflow.task_attempt_lost", r1.attempt_id)
        assert ls["payload"]["before_start"] is False and ls["payload"]["evidence_source"] == "worker_restart:w-s"
        assert lr["payload"]["evidence_source"] == "operator:oncall"
        r = run_row(owner, run_id)
        assert r["status"] == "failed" and r["cancel_requested_at_ms"] is None
        # no silent retry past the start barrier: no new epoch, no new attempt
        assert candidates(rt, run_id) == []
        assert owner.execute("SELECT count(*) AS n FROM ql3.run_attempts WHERE run_id = %s", (run_id,)).fetchone()["n"] == 3
        # the dead workers' tokens are fenced out
        before = footprint(owner)
        with pytest.raises(errors.LeaseInvalid):
            api.attempt_complete(wk, r1.attempt_id, "0" * 64, "succeeded", 0)
        assert footprint(owner) == before
        check_audit_invariants(ql3_owner, run_id)
    finally:
        for pid in children:
            kill_group_quietly(pid)


def test_recover_cli_is_admin_only_and_validated(qlpg_db, owner, as_role, pkg):
    run_id = start_run(as_role, pkg, "prestart")
    a = admit_step(as_role(RUNTIME), run_id, "a")
    res = qlpg(qlpg_db, RUNTIME, "recover", "--attempt", a.attempt_id, "--evidence", "not_running")
    assert res.returncode == 2 and "permission denied for function recovery_evidence_record" in res.stderr, res.stderr
    res = qlpg(qlpg_db, ADMIN, "recover", "--attempt", "wta:nope", "--evidence", "not_running")
    assert res.returncode == 1 and "QL101" in res.stderr, res.stderr
    with pytest.raises(errors.InvalidInput):
        api.recovery_evidence_record(as_role(ADMIN), a.attempt_id, "probably", "me")
    with pytest.raises((errors.NotInRole, psycopg.errors.InsufficientPrivilege)):
        api.worker_session_reset(as_role(ADMIN), "w-x")
    assert control(owner, a.attempt_id) is None


def test_worker_session_reset_speaks_only_for_its_own_login(qlpg_db, owner, as_role, ql3_owner, pkg):
    """A restarting worker declares dead only the leases its own login acquired under that worker id."""
    from qlpg import roles

    other_login = "qlpg_t_worker_ingress_b"
    with owner_conn(qlpg_db) as su:
        for _ in range(5):  # cluster-wide; another test process may create it concurrently
            try:
                roles.create_login(su, other_login, WORKER)
                break
            except (psycopg.errors.DuplicateObject, psycopg.errors.UniqueViolation):
                continue
    run_id = start_run(as_role, pkg, "prestart")
    rt = as_role(RUNTIME)
    theirs = admit_step(rt, run_id, "a")
    with psycopg.connect(psycopg.conninfo.make_conninfo(qlpg_db.conninfo_as(WORKER), user=other_login),
                         autocommit=True, row_factory=psycopg.rows.dict_row) as other:
        (lease,) = api.lease_acquire(other, "w-shared-id", "local_process", 1, 60000)
    assert lease.attempt_id == theirs.attempt_id
    mine = admit_step(rt, run_id, "b")
    wk = as_role(WORKER)
    mine_lease = lease_one(wk, mine.attempt_id, "w-shared-id", lease_ms=60000)
    before = attempt(owner, theirs.attempt_id)
    rows = api.worker_session_reset(wk, "w-shared-id")
    assert [r["attempt_id"] for r in rows] == [mine_lease.attempt_id]
    assert attempt(owner, theirs.attempt_id) == before and control(owner, theirs.attempt_id) is None
    rc = control(owner, mine.attempt_id)
    assert (rc["status"], rc["last_evidence"], rc["evidence_source"]) == ("available", "not_running",
                                                                         "worker_restart:w-shared-id")
    assert attempt(owner, mine.attempt_id)["lease_expires_at_ms"] < attempt(owner, theirs.attempt_id)["lease_expires_at_ms"]
    assert api.worker_session_reset(wk, "w-other-id") == []
    # the declaration takes effect on the next recovery pass: a new epoch for b, a untouched
    loop = Runtime(qlpg_db.conninfo_as(RUNTIME))
    try:
        assert loop.run_once().recovered == 1
    finally:
        loop.close()
    assert attempt(owner, mine.attempt_id)["status"] == "lost"
    assert attempt(owner, theirs.attempt_id)["status"] == "claimed"
    check_audit_invariants(ql3_owner, run_id)


def test_a_holder_that_heartbeats_again_beats_recovery(qlpg_db, owner, as_role, ql3_owner, pkg):
    """Expiry only makes an attempt eligible: a holder heard from again before the resolution keeps its
    attempt (no_action), closes a parked retry control (holder_returned), and is told QL401 once a
    resolution with trusted evidence has ended its lease."""
    run_id = start_run(as_role, pkg, "prestart")
    rt, wk, adm = as_role(RUNTIME), as_role(WORKER), as_role(ADMIN)
    leases = {}
    for key in ("a", "b"):
        leases[key] = lease_one(wk, admit_step(rt, run_id, key).attempt_id, "w-slow", lease_ms=LEASE_MS)
        api.attempt_start(wk, leases[key].attempt_id, leases[key].lease_token)
        api.attempt_running(wk, leases[key].attempt_id, leases[key].lease_token)
    a, b = leases["a"], leases["b"]
    wait_db_time_past(owner, max(attempt(owner, x.attempt_id)["lease_expires_at_ms"] for x in (a, b)))

    # an operator (wrongly) vouches that a's process is gone
    api.recovery_evidence_record(adm, a.attempt_id, "not_running", "hasty")
    claims = {c["attempt_id"]: c for c in api.recovery_claim(rt, "rt-hb", 8, 30000)}
    assert set(claims) == {a.attempt_id, b.attempt_id}
    # a's holder heartbeats between claim and resolution: the lease lives again, nothing is recovered
    ctl = api.lease_control(wk, a.attempt_id, a.lease_token, 30000)
    assert ctl["decision"] == "continue"
    before = footprint(owner)
    res = api.recovery_resolve(rt, a.attempt_id, claims[a.attempt_id]["claim_token"])
    assert (res["status"], res["resolution"], res["attempt_status"]) == ("resolved", "no_action", "running")
    assert footprint(owner) == before
    rc = control(owner, a.attempt_id)  # the live holder contradicted the evidence: it is dropped
    assert (rc["last_evidence"], rc["evidence_source"], rc["failure_count"]) == (None, None, 0)
    # b gets no evidence: parked in retry; then its holder comes back: the control closes
    res = api.recovery_resolve(rt, b.attempt_id, claims[b.attempt_id]["claim_token"])
    assert (res["status"], res["resolution"]) == ("retry", "awaiting_evidence")
    assert api.lease_control(wk, b.attempt_id, b.lease_token, 30000)["decision"] == "continue"
    rc = control(owner, b.attempt_id)
    assert (rc["status"], rc["resolution"], rc["failure_count"]) == ("resolved", "holder_returned", 0)
    assert footprint(owner) == before
    assert api.attempt_complete(wk, b.attempt_id, b.lease_token, "succeeded", 0)["outcome"] == "succeeded"

    # a expires again: the dropped evidence does not resurface (awaiting evidence); then trusted
    # evidence arrives and recovery ends it: the holder is fenced out
    owner.execute("UPDATE ql3.run_attempts SET lease_expires_at_ms = lease_expires_at_ms - 60000 WHERE id = %s",
                  (a.attempt_id,))  # stands for 60 s of silence
    (c,) = api.recovery_claim(rt, "rt-hb", 8, 30000)
    assert api.recovery_resolve(rt, a.attempt_id, c["claim_token"])["resolution"] == "awaiting_evidence"
    api.recovery_evidence_record(adm, a.attempt_id, "not_running", "oncall")
    (c,) = api.recovery_claim(rt, "rt-hb", 8, 30000)
    assert api.recovery_resolve(rt, a.attempt_id, c["claim_token"])["resolution"] == "lost_after_start"
    before = footprint(owner)
    with pytest.raises(errors.LeaseInvalid):
        api.lease_control(wk, a.attempt_id, a.lease_token, 30000)
    with pytest.raises(errors.LeaseInvalid):
        api.attempt_complete(wk, a.attempt_id, a.lease_token, "succeeded", 0)
    assert footprint(owner) == before
    assert steps(owner, run_id) == {"a": "failed", "b": "succeeded", "c": "ready", "d": "skipped"}
    check_audit_invariants(ql3_owner, run_id)
