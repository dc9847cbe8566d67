"""Support for the Task Attempt / lease / worker proofs (issue 8; no tests in this module).

Tiny packages written into ``tmp_path`` (every task a real argv), Runs admitted through the real
SQL API, and the counters that prove "a refused call writes nothing": the row count of every
runtime table plus every Run's version.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Callable, Iterable, Mapping

import psycopg

from qlpg import api, install

RUNTIME_TABLES = (
    "runs", "step_runs", "step_run_mutations", "run_events", "task_attempt_admissions", "run_attempts",
    "run_dispatch_leases", "run_attempt_completions", "run_recovery_controls",
)


def write_pkg(root: Path, name: str, workflows: Mapping[str, Mapping[str, Iterable[str]]], *,
              command: Iterable[str] = ("true",), timeout_ms: int = 60000, tasks: Mapping[str, dict] | None = None,
              step_task: Mapping[str, str] | None = None) -> Path:
    """``root/name/qinglong-package.yaml``: each workflow maps step key -> needs; every step runs task
    ``step_task.get(step, "t")``; ``tasks`` overrides/adds task specs (default ``t`` runs ``command``)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    all_tasks = {"t": {"command": list(command), "timeout_ms": timeout_ms}}
    all_tasks.update(tasks or {})
    wfs = {wf: {"steps": {k: {"task": (step_task or {}).get(k, "t"), "needs": sorted(n)} for k, n in steps.items()}}
           for wf, steps in workflows.items()}
    doc = {"package": name, "version": "1.0.0", "publisher": "qlpg-tests", "tasks": all_tasks, "workflows": wfs}
    (d / "qinglong-package.yaml").write_text(json.dumps(doc, indent=1))
    return d


def roots(n: int, prefix: str = "s") -> dict[str, list[str]]:
    """``n`` independent steps ``s000``.. (all ready at admission)."""
    return {f"{prefix}{i:03d}": [] for i in range(n)}


def install_pkg(as_role, pkg_dir: Path) -> None:
    install.install_package(as_role("ql3_package_manager"), pkg_dir)


def start(as_role, pkg_dir: Path, workflow: str, n: int = 1) -> list[str]:
    """Admit ``n`` Runs of ``workflow`` (package installed before); returns their ids."""
    name = json.loads((pkg_dir / "qinglong-package.yaml").read_text())["package"]
    pe = as_role("ql3_package_executor")
    return [install.start_workflow(pe, "default", name, workflow).run_id for _ in range(n)]


def candidates(rt, run_id: str | None = None) -> list[dict]:
    out, after = [], None
    while True:
        page = api.task_attempt_candidates(rt, after, 64)
        out += [c for c in page if run_id is None or c["run_id"] == run_id]
        if len(page) < 64:
            return out
        after = (page[-1]["run_id"], page[-1]["step_run_id"])


def admit(rt, c: Mapping) -> api.AttemptReceipt:
    snap = api.task_attempt_snapshot(rt, c["run_id"], c["step_run_id"], c["step_run_version"])
    return api.task_attempt_admit(rt, c["run_id"], c["step_run_id"], c["step_run_version"], c["step_run_digest"],
                                  snap["execution_revision"])


def admit_run(rt, run_id: str) -> list[api.AttemptReceipt]:
    return [admit(rt, c) for c in candidates(rt, run_id)]


def step_id(owner, run_id: str, step_key: str) -> str:
    return owner.execute("SELECT id FROM ql3.step_runs WHERE run_id = %s AND step_key = %s", (run_id, step_key)).fetchone()[0]


def footprint(owner: psycopg.Connection) -> dict:
    """Row counts of every runtime table, every Run's (version, event_sequence, status), every
    StepRun's (status, version) and every attempt's and lease's state: equal before and after a
    refused call means it wrote nothing."""
    q = " UNION ALL ".join(f"SELECT '{t}', count(*) FROM ql3.{t}" for t in RUNTIME_TABLES)
    out = {r[0]: r[1] for r in owner.execute(q).fetchall()}
    out["runs_state"] = sorted(owner.execute("SELECT id, version, event_sequence, status, last_attempt FROM ql3.runs").fetchall())
    out["steps_state"] = sorted(owner.execute("SELECT id, status, version, attempt_count FROM ql3.step_runs").fetchall())
    out["attempts_state"] = sorted(owner.execute(
        "SELECT id, status, lease_active, lease_expires_at_ms, stop_reason FROM ql3.run_attempts").fetchall())
    out["leases_state"] = sorted(owner.execute(
        "SELECT attempt_id, lease_no, status, expires_at_ms FROM ql3.run_dispatch_leases").fetchall())
    return out


def run_threads(n: int, target: Callable[[int, threading.Barrier], object], timeout: float = 120) -> list:
    """Run ``target(i, barrier)`` in ``n`` threads released together; returns results (or exceptions)."""
    barrier = threading.Barrier(n)
    out: list = [None] * n

    def go(i):
        try:
            out[i] = target(i, barrier)
        except BaseException as exc:  # reported by the caller
            out[i] = exc

    ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    return out
