"""Helpers of the deadline, cancel and recovery proofs (issue 5): tiny packages written into
``tmp_path``, step-level admission and leasing through the real SQL API, audit snapshots, and
``qlpg`` subprocesses logged in as a service login (``qlpg_db.conninfo_as(role)``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psycopg
import pytest
from psycopg.rows import dict_row

from qlpg import api, install

from helpers import ROOT

WORKER = "ql3_worker_ingress"
RUNTIME = "ql3_runtime"
ADMIN = "ql3_admin"


def write_package(root: Path, name: str, tasks: dict, workflows: dict) -> Path:
    """Write ``root/name/qinglong-package.yaml`` (JSON is valid YAML) and return the directory."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    doc = {"package": name, "version": "1.0.0", "publisher": "qlpg-tests", "tasks": tasks,
           "workflows": {k: {"steps": v} for k, v in workflows.items()}}
    (d / "qinglong-package.yaml").write_text(json.dumps(doc, indent=1))
    return d


def task(*argv: str, timeout_ms: int = 20000) -> dict:
    return {"command": list(argv), "timeout_ms": timeout_ms}


def start_run(as_role, pkg_dir: Path, workflow: str, run_id: str | None = None, install_first: bool = True) -> str:
    """Install (idempotent) and admit one Run; returns its id."""
    if install_first:
        install.install_package(as_role("ql3_package_manager"), pkg_dir)
    name = json.loads((pkg_dir / "qinglong-package.yaml").read_text())["package"]
    return install.start_workflow(as_role("ql3_package_executor"), "default", name, workflow, run_id).run_id


def candidates(rt, run_id: str | None = None) -> list[dict]:
    out, after = [], None
    while True:
        page = api.task_attempt_candidates(rt, after, 64)
        out += [c for c in page if run_id is None or c["run_id"] == run_id]
        if len(page) < 64:
            return out
        after = (page[-1]["run_id"], page[-1]["step_run_id"])


def admit_step(rt, run_id: str, step_key: str) -> api.AttemptReceipt:
    """Admit the current ready epoch of one step (it must be a candidate)."""
    (c,) = [c for c in candidates(rt, run_id) if c["step_key"] == step_key]
    snap = api.task_attempt_snapshot(rt, c["run_id"], c["step_run_id"], c["step_run_version"])
    return api.task_attempt_admit(rt, c["run_id"], c["step_run_id"], c["step_run_version"],
                                  c["step_run_digest"], snap["execution_revision"])


def lease_one(wk, attempt_id: str, worker_id: str = "w-test", lease_ms: int = 30000) -> api.Lease:
    """Lease exactly ``attempt_id`` (it must be the only claimed, unleased attempt)."""
    (lease,) = api.lease_acquire(wk, worker_id, "local_process", 1, lease_ms)
    assert lease.attempt_id == attempt_id, (lease.attempt_id, attempt_id)
    return lease


def step(owner, run_id: str, step_key: str) -> dict:
    return owner.execute("SELECT * FROM ql3.step_runs WHERE run_id = %s AND step_key = %s",
                         (run_id, step_key)).fetchone()


def steps(owner, run_id: str) -> dict[str, str]:
    return {r["step_key"]: r["status"] for r in
            owner.execute("SELECT step_key, status FROM ql3.step_runs WHERE run_id = %s", (run_id,))}


def run_row(owner, run_id: str) -> dict:
    return owner.execute("SELECT * FROM ql3.runs WHERE id = %s", (run_id,)).fetchone()


def attempt(owner, attempt_id: str) -> dict:
    return owner.execute("SELECT * FROM ql3.run_attempts WHERE id = %s", (attempt_id,)).fetchone()


def control(owner, attempt_id: str) -> dict | None:
    return owner.execute("SELECT * FROM ql3.run_recovery_controls WHERE attempt_id = %s", (attempt_id,)).fetchone()


def events(owner, run_id: str, type_: str | None = None, attempt_id: str | None = None) -> list[dict]:
    return owner.execute(
        "SELECT * FROM ql3.run_events WHERE run_id = %s AND (%s::text IS NULL OR type = %s)"
        " AND (%s::text IS NULL OR attempt_id = %s) ORDER BY sequence",
        (run_id, type_, type_, attempt_id, attempt_id)).fetchall()


def mutations(owner, step_run_id: str) -> list[tuple[str | None, str]]:
    return [(m["from_status"], m["to_status"]) for m in owner.execute(
        "SELECT from_status, to_status FROM ql3.step_run_mutations WHERE step_run_id = %s ORDER BY version",
        (step_run_id,))]


def footprint(owner) -> dict:
    """Everything a rejected or replayed call must leave unchanged."""
    q = {
        "events": "SELECT count(*) FROM ql3.run_events",
        "mutations": "SELECT count(*) FROM ql3.step_run_mutations",
        "attempts": "SELECT count(*) FROM ql3.run_attempts",
        "completions": "SELECT count(*) FROM ql3.run_attempt_completions",
        "admissions": "SELECT count(*) FROM ql3.task_attempt_admissions",
        "leases": "SELECT count(*) FROM ql3.run_dispatch_leases",
        "runs": "SELECT string_agg(id || ':' || status || ':' || version, ',' ORDER BY id) FROM ql3.runs",
        "steps": "SELECT string_agg(id || ':' || status || ':' || version, ',' ORDER BY id) FROM ql3.step_runs",
        "attempt_rows": "SELECT string_agg(id || ':' || status || ':' || lease_active::text, ',' ORDER BY id)"
                        " FROM ql3.run_attempts",
    }
    return {k: list(owner.execute(v).fetchone().values())[0] for k, v in q.items()}


def owner_conn(qlpg_db) -> psycopg.Connection:
    return psycopg.connect(qlpg_db.conninfo, autocommit=True, row_factory=dict_row)


def wait_until(pred: Callable[[], object], timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_db_time_past(owner, at_ms: int) -> None:
    """Sleep until database time (the authority's clock) is past ``at_ms``."""
    while True:
        now = owner.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS n").fetchone()["n"]
        if now > at_ms:
            return
        time.sleep(max(0.01, (at_ms - now + 5) / 1000))


# ------------------------------------------------------------------ qlpg subprocesses
def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT / "pyshell"))


def qlpg(qlpg_db, role: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m qlpg ARGS --dsn <login of role>`` to completion."""
    return subprocess.run([sys.executable, "-m", "qlpg", *args, "--dsn", qlpg_db.conninfo_as(role)],
                          capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)


def spawn_worker(qlpg_db, worker_id: str, state_dir: Path, *extra: str, lease_ms: int = 1000) -> subprocess.Popen:
    """Start ``qlpg worker --once`` as the worker login (its own process group, so the test can
    ``kill -9`` it without touching pytest)."""
    log = open(state_dir / f"{worker_id}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "qlpg", "worker", "--once", "--worker-id", worker_id,
                             "--lease-ms", str(lease_ms), "--state-dir", str(state_dir), *extra,
                             "--dsn", qlpg_db.conninfo_as(WORKER)],
                            stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT, start_new_session=True)


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL


def require_direct_sessions() -> None:
    """Skip under a transaction pooler (QLPG_TEST_CLIENT_HOST/PORT): these proofs observe a killed
    worker's own server backend (lock wait in pg_stat_activity) and end it, which only a direct
    connection gives (see tests/conftest.py)."""
    host, port = os.environ.get("QLPG_TEST_CLIENT_HOST"), os.environ.get("QLPG_TEST_CLIENT_PORT")
    direct = (host or os.environ.get("PGHOST", "/var/run/postgresql"), str(port or os.environ.get("PGPORT", "5432")))
    if direct != (os.environ.get("PGHOST", "/var/run/postgresql"), os.environ.get("PGPORT", "5432")):
        pytest.skip("session-bound: watches and terminates a killed worker's own server backend")


def terminate_backends(owner, worker_id: str) -> int:
    """A killed worker's server session: what TCP keepalive would end eventually, ended now."""
    rows = owner.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                         (f"qlpg-worker:{worker_id}"[:63],)).fetchall()
    wait_until(lambda: not owner.execute("SELECT 1 FROM pg_stat_activity WHERE application_name = %s",
                                         (f"qlpg-worker:{worker_id}"[:63],)).fetchone(),
               what="worker backend gone")
    return len(rows)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_group_quietly(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture
def owner(qlpg_db):
    """Autocommit dict-row superuser connection to the test database (closed after the test)."""
    c = owner_conn(qlpg_db)
    yield c
    c.close()
