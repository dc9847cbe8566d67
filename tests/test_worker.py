"""`qlpg worker` (ADR-0227 §4-6, issue 8 item 6): heartbeats at most lease/3 apart, the process group
killed at the deadline and on stop_requested, capped per-attempt logs, graceful SIGTERM of a real
`qlpg worker` process, and an attempt that completes although its database sessions were killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qlpg import api
from qlpg.worker import Worker

from helpers import ROOT, check_audit_invariants
from test_attempt_support import admit_run, install_pkg, start, step_id, write_pkg

W = "ql3_worker_ingress"


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(pred, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def one_step(as_role, tmp_path, name, command, timeout_ms=60000, **task):
    spec = {"command": list(command), "timeout_ms": timeout_ms, **task}
    pkg = write_pkg(tmp_path, name, {"one": {"a": []}}, tasks={"t": spec})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "one")
    admit_run(as_role("ql3_runtime"), run_id)
    return run_id


def worker(qlpg_db, tmp_path, worker_id="w-test", lease_ms=30000, **kw) -> Worker:
    return Worker(qlpg_db.conninfo_as(W), worker_id, tmp_path / "state", lease_ms=lease_ms, **kw)


def test_heartbeats_are_at_most_a_third_of_the_lease_apart(qlpg_db, as_role, ql3_owner, tmp_path, monkeypatch):
    run_id = one_step(as_role, tmp_path, "hb", ["sleep", "2.5"])
    beats, real = [], api.lease_control

    def counting(conn, attempt_id, token, extend_ms=30000):
        beats.append(time.monotonic())
        out = real(conn, attempt_id, token, extend_ms)
        assert out["decision"] == "continue"
        return out

    monkeypatch.setattr(api, "lease_control", counting)
    w = worker(qlpg_db, tmp_path, lease_ms=1200)
    t0 = time.monotonic()
    assert w.run_once()
    w.close()
    gaps = [b - a for a, b in zip([t0] + beats, beats + [time.monotonic()])]
    assert len(beats) >= 5, gaps
    assert max(gaps) <= 0.4 + 0.15, gaps   # lease/3 = 0.4 s (+ scheduling slack on a busy box)
    assert min(gaps[1:-1]) >= 0.25, gaps    # and not much more often
    assert ql3_owner.execute("SELECT status FROM ql3.runs WHERE id = %s", (run_id,)).fetchone()[0] == "succeeded"
    check_audit_invariants(ql3_owner)


def test_deadline_kills_the_process_group(qlpg_db, as_role, ql3_owner, tmp_path):
    script = 'sleep 60 & echo $! > "$QLPG_RUN_DIR/child.pid"; wait'
    run_id = one_step(as_role, tmp_path, "dl", ["bash", "-c", script], timeout_ms=1500)
    w = worker(qlpg_db, tmp_path, lease_ms=3000)
    t0 = time.monotonic()
    assert w.run_once()
    w.close()
    assert time.monotonic() - t0 < 1.5 + 2.0 + 5  # deadline + TERM grace + reporting
    child = int(next((tmp_path / "state" / "runs").glob("*/child.pid")).read_text())
    assert not pid_alive(child)  # the background child of the task died with its group
    a = ql3_owner.execute("SELECT a.status, c.detail->>'stop_reason' FROM ql3.run_attempts a"
                          " JOIN ql3.run_attempt_completions c ON c.attempt_id = a.id").fetchone()
    assert a == ("timed_out", "timeout")
    assert ql3_owner.execute("SELECT status FROM ql3.runs WHERE id = %s", (run_id,)).fetchone()[0] == "timed_out"
    check_audit_invariants(ql3_owner)


def test_stop_requested_kills_the_process_group(qlpg_db, as_role, ql3_owner, tmp_path):
    script = 'sleep 60 & echo $! > "$QLPG_RUN_DIR/child.pid"; wait'
    run_id = one_step(as_role, tmp_path, "stop", ["bash", "-c", script])
    w = worker(qlpg_db, tmp_path, lease_ms=1000)
    t = threading.Thread(target=w.run_once)
    t.start()
    sid = step_id(ql3_owner, run_id, "a")
    wait_for(lambda: ql3_owner.execute("SELECT status = 'running' FROM ql3.step_runs WHERE id = %s", (sid,)).fetchone()[0],
             what="step running")
    api.run_cancel_request(as_role("ql3_admin"), run_id, "user", "tester")
    t.join(15)
    assert not t.is_alive()
    w.close()
    child = int(next((tmp_path / "state" / "runs").glob("*/child.pid")).read_text())
    assert not pid_alive(child)
    a = ql3_owner.execute("SELECT a.status, c.detail->>'stop_reason' FROM ql3.run_attempts a"
                          " JOIN ql3.run_attempt_completions c ON c.attempt_id = a.id").fetchone()
    assert a == ("cancelled", "cancel")
    api.run_cancel_converge(as_role("ql3_runtime"), run_id)
    assert ql3_owner.execute("SELECT status FROM ql3.runs WHERE id = %s", (run_id,)).fetchone()[0] == "cancelled"
    check_audit_invariants(ql3_owner)


def test_output_logs_are_capped(qlpg_db, as_role, ql3_owner, tmp_path):
    script = "head -c 200000 /dev/zero | tr '\\0' x; head -c 5000 /dev/zero | tr '\\0' y >&2"
    one_step(as_role, tmp_path, "cap", ["bash", "-c", script], max_output_bytes=1024)
    w = worker(qlpg_db, tmp_path)
    assert w.run_once()
    w.close()
    (out,) = (tmp_path / "state" / "runs").glob("*/logs/a.1/stdout.log")
    assert out.stat().st_size == 1024 and out.read_bytes() == b"x" * 1024
    assert (out.parent / "stderr.log").stat().st_size == 1024
    d = ql3_owner.execute("SELECT a.status, c.detail FROM ql3.run_attempts a"
                          " JOIN ql3.run_attempt_completions c ON c.attempt_id = a.id").fetchone()
    assert d[0] == "succeeded" and d[1]["output_truncated"] is True and d[1]["stdout_path"] == str(out)
    check_audit_invariants(ql3_owner)


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT / "pyshell"))


def test_sigterm_finishes_the_attempt_in_hand_and_leases_nothing_more(qlpg_db, as_role, ql3_owner, tmp_path):
    pkg = write_pkg(tmp_path, "term", {"two": {"a": [], "b": []}},
                    tasks={"slow": {"command": ["sleep", "2"], "timeout_ms": 60000}}, step_task={"a": "slow"})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "two")
    rt = as_role("ql3_runtime")
    from test_attempt_support import admit, candidates
    cands = sorted(candidates(rt), key=lambda c: c["step_run_id"] != step_id(ql3_owner, run_id, "a"))
    for c in cands:  # a first: the worker leases the oldest claimed attempt
        admit(rt, c)
    log = open(tmp_path / "worker.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "qlpg", "worker", "--worker-id", "w-term", "--lease-ms", "3000",
                          "--state-dir", str(tmp_path / "state"), "--dsn", qlpg_db.conninfo_as(W)],
                         stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
    try:
        sa = step_id(ql3_owner, run_id, "a")
        wait_for(lambda: ql3_owner.execute("SELECT status = 'running' FROM ql3.step_runs WHERE id = %s",
                                           (sa,)).fetchone()[0], what="step a running")
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0
    finally:
        if p.poll() is None:
            p.kill()
    steps = dict(ql3_owner.execute("SELECT step_key, status FROM ql3.step_runs WHERE run_id = %s", (run_id,)).fetchall())
    assert steps == {"a": "succeeded", "b": "ready"}  # a finished; b was never leased
    b = ql3_owner.execute("SELECT a.status, a.lease_count FROM ql3.run_attempts a JOIN ql3.step_runs s"
                          " ON s.id = a.step_run_id WHERE s.step_key = 'b'").fetchone()
    assert b == ("claimed", 0)
    check_audit_invariants(ql3_owner)


def test_attempt_completes_although_its_sessions_are_killed(qlpg_db, as_role, ql3_owner, tmp_path):
    """Every backend of the worker is terminated twice while its task runs (a database restart as the
    worker sees it): it reconnects with backoff, keeps heartbeating and reports the completion."""
    run_id = one_step(as_role, tmp_path, "kill", ["sleep", "3"])
    w = worker(qlpg_db, tmp_path, worker_id="w-kill", lease_ms=3000)
    done = []
    t = threading.Thread(target=lambda: done.append(w.run_once()))
    t.start()
    sid = step_id(ql3_owner, run_id, "a")
    wait_for(lambda: ql3_owner.execute("SELECT status = 'running' FROM ql3.step_runs WHERE id = %s", (sid,)).fetchone()[0],
             what="step running")
    killed = 0
    for _ in range(2):
        time.sleep(0.6)
        killed += len(ql3_owner.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                        " WHERE application_name = 'qlpg-worker:w-kill'").fetchall())
    t.join(30)
    w.close()
    assert done == [True] and killed >= 1
    assert ql3_owner.execute("SELECT status FROM ql3.runs WHERE id = %s", (run_id,)).fetchone()[0] == "succeeded"
    assert ql3_owner.execute("SELECT status FROM ql3.run_attempts").fetchone()[0] == "succeeded"
    check_audit_invariants(ql3_owner)


def test_worker_survives_a_real_server_restart(tmp_path):
    """A private cluster (never the shared :5432 one) is restarted with ``pg_ctl restart -m fast``
    while the worker's task runs: the worker reconnects with backoff and the attempt completes."""
    from qlpg import db, install, migrate, roles
    from qlpg.cluster import TempCluster, _run_tool

    try:
        cl = TempCluster().start()
    except Exception as exc:  # pragma: no cover - no PostgreSQL binaries
        pytest.skip(f"no private cluster: {exc}")
    stop: list = []
    try:
        migrate.migrate(cl.conninfo)
        with db.connect(cl.conninfo) as su:
            for role in ("ql3_package_manager", "ql3_package_executor", "ql3_runtime", "ql3_worker_ingress"):
                roles.create_login(su, "t_" + role.removeprefix("ql3_"), role)
        ci = {r: db.with_params(cl.conninfo, user="t_" + r.removeprefix("ql3_"))
              for r in ("ql3_package_manager", "ql3_package_executor", "ql3_runtime", "ql3_worker_ingress")}
        pkg = write_pkg(tmp_path, "restart", {"one": {"a": []}}, command=["sleep", "4"])
        with db.connect(ci["ql3_package_manager"]) as pm:
            install.install_package(pm, pkg)
        with db.connect(ci["ql3_package_executor"]) as pe:
            run_id = install.start_workflow(pe, "default", "restart", "one").run_id
        with db.connect(ci["ql3_runtime"]) as rt:
            admit_run(rt, run_id)
        w = Worker(ci["ql3_worker_ingress"], "w-restart", tmp_path / "state", lease_ms=3000)
        stop.append(w.stop_event)
        done = []
        t = threading.Thread(target=lambda: done.append(w.run_once()))
        t.start()
        with db.connect(cl.conninfo) as su:
            wait_for(lambda: su.execute("SELECT status = 'running' AS r FROM ql3.step_runs").fetchone()["r"], what="running")
        pg_ctl = os.path.join(cl.bindir, "pg_ctl")
        _run_tool([pg_ctl, "-D", str(cl.datadir), "-l", str(cl.logfile), "-w", "-m", "fast",
                   "-o", cl._options(cl.port), "restart"], cl._ids, cwd=str(cl.base), timeout=60)
        t.join(60)
        w.close()
        assert done == [True]
        with db.connect(cl.conninfo) as su:
            assert su.execute("SELECT status FROM ql3.runs").fetchone()["status"] == "succeeded"
            assert su.execute("SELECT status FROM ql3.run_attempts").fetchone()["status"] == "succeeded"
            check_audit_invariants(su)
    finally:
        for ev in stop:
            ev.set()
        cl.stop()
