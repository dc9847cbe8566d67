"""`qlpg run DIR`: the main job, end to end, every call under its own role.

1. ``qlpg migrate`` with the deploying login (the ``--dsn`` / ``DATABASE_URL`` / ``PG*`` login).
2. Throwaway login users ``qlpg_demo_<pid>_<role>``, one per role, each a member of exactly one
   ``ql3_*`` group role with a random password; they are dropped when the job ends (the job says so).
3. Install the package as ``ql3_package_manager``; start the Workflow as ``ql3_package_executor``.
4. Drive ``qlpg runtime`` (``ql3_runtime``) and N worker threads (``ql3_worker_ingress``) in this
   process until the Run is terminal, with live progress (steps done / total, running now).
5. Print the per-step table (state, attempt, exit code, duration, log path).

Tasks connect to PostgreSQL (pg-backup does) with the deploying login's host/port/user: the job
exports ``PGHOST``/``PGPORT``/``PGUSER``/``PGDATABASE`` for task processes that list them in
``env_names``. Exit status: 0 iff the Run succeeded, 1 if it ended otherwise.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import api, db, install, migrate, roles
from .manifest import load_package
from .runtime import Runtime
from .worker import AttemptOutcome, Worker

DEMO_ROLES = ("ql3_admin", "ql3_package_manager", "ql3_package_executor", "ql3_runtime", "ql3_worker_ingress")
TERMINAL = {"succeeded", "failed", "skipped", "cancelled", "timed_out"}


class DemoLogins:
    """Throwaway logins, one per role; ``conninfo(role)`` connects as it; dropped by ``drop()``."""

    def __init__(self, admin_conninfo: str):
        self.admin_conninfo = admin_conninfo
        self.prefix = f"qlpg_demo_{os.getpid()}_"
        self.passwords: dict[str, str] = {}

    def name(self, role: str) -> str:
        return self.prefix + role.removeprefix("ql3_")

    def create(self) -> None:
        with db.connect(self.admin_conninfo) as conn:
            for role in DEMO_ROLES:
                pw = secrets.token_urlsafe(18)
                roles.create_login(conn, self.name(role), role, password=pw)
                self.passwords[role] = pw

    def conninfo(self, role: str) -> str:
        return db.with_params(self.admin_conninfo, user=self.name(role), password=self.passwords[role])

    def drop(self) -> None:
        try:
            with db.connect(self.admin_conninfo) as conn:
                for role in DEMO_ROLES:
                    roles.drop_login(conn, self.name(role))
        except Exception:  # pragma: no cover - best effort at exit
            pass


def export_task_pg_env(admin_conninfo: str) -> None:
    """Export PGHOST/PGPORT/PGUSER/PGDATABASE of the deploying login for task processes."""
    with db.connect(admin_conninfo) as conn:
        info = conn.info
        os.environ["PGHOST"] = info.host
        os.environ["PGPORT"] = str(info.port)
        os.environ["PGUSER"] = info.user
        os.environ["PGDATABASE"] = info.dbname


def run_main_job(admin_conninfo: str, package_dir: str, *, workflow: str | None = None, workers: int = 2,
                 project_id: str = "default", state_dir: Path = Path(".qlpg"), console: Console | None = None,
                 lease_ms: int = 30000) -> int:
    """Run the main job; returns the exit status (0 succeeded, 1 otherwise)."""
    console = console or Console()
    manifest = load_package(package_dir)
    if workflow is None:
        if len(manifest.workflows) != 1:
            raise SystemExit(f"qlpg run: {package_dir} has workflows {', '.join(manifest.workflows)}; choose one with --workflow")
        workflow = next(iter(manifest.workflows))
    elif workflow not in manifest.workflows:
        raise SystemExit(f"qlpg run: workflow {workflow!r} not in {package_dir} ({', '.join(manifest.workflows)})")

    res = migrate.migrate(admin_conninfo)
    console.print(f"[bold]migrate[/]: {len(res.applied)} migration(s) applied, functions "
                  f"{'deployed' if res.functions_deployed else 'up to date'} ({res.function_files} files)")
    logins = DemoLogins(admin_conninfo)
    logins.create()
    console.print(f"[bold]logins[/]: created throwaway login users {logins.prefix}* (one per ql3 role) for this run; "
                  "they are dropped when it ends")
    export_task_pg_env(admin_conninfo)
    state_dir = Path(state_dir).resolve()
    try:
        with db.connect(logins.conninfo("ql3_package_manager")) as pm:
            inst = install.install_package(pm, package_dir, project_id)
        console.print(f"[bold]install[/]: {manifest.package} {manifest.version} generation {inst.generation} "
                      f"({inst.outcome}), publication {inst.publication_id}")
        with db.connect(logins.conninfo("ql3_package_executor")) as pe:
            rec = install.start_workflow(pe, project_id, manifest.package, workflow)
        run_id = rec.run_id
        console.print(f"[bold]start[/]: workflow {workflow} admitted as run {run_id} "
                      f"(plan {rec.plan_digest[:16]}…, {len(rec.receipt['step_runs'])} steps)")
        return _drive(logins, run_id, workers, state_dir, console, lease_ms)
    finally:
        logins.drop()


def _drive(logins: DemoLogins, run_id: str, workers: int, state_dir: Path, console: Console, lease_ms: int) -> int:
    done = threading.Event()
    outcomes: dict[str, AttemptOutcome] = {}
    lock = threading.Lock()

    def record(o: AttemptOutcome) -> None:
        with lock:
            outcomes[o.attempt_id] = o

    rt = Runtime(logins.conninfo("ql3_runtime"))
    threads = [threading.Thread(target=rt.run_forever, kwargs={"idle_sleep_s": 0.1, "until": done.is_set},
                                name="qlpg-runtime", daemon=True)]
    ws = []
    for i in range(workers):
        w = Worker(logins.conninfo("ql3_worker_ingress"), f"qlpg-run-{os.getpid()}-{i}", state_dir,
                   lease_ms=lease_ms, on_outcome=record)
        ws.append(w)
        threads.append(threading.Thread(target=w.run_forever, kwargs={"idle_sleep_s": 0.1, "until": done.is_set},
                                        name=f"qlpg-worker-{i}", daemon=True))
    for t in threads:
        t.start()
    view = None
    try:
        with db.connect(logins.conninfo("ql3_admin")) as adm, Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
            TextColumn("{task.fields[running]}"), TimeElapsedColumn(), console=console, transient=False,
        ) as progress:
            task = None
            while True:
                view = api.run_inspect(adm, run_id)
                steps = view["steps"]
                finished = sum(1 for s in steps if s["status"] in TERMINAL)
                running = [s["step_key"] for s in steps if s["status"] == "running"]
                label = "running: " + ", ".join(running[:4]) + ("…" if len(running) > 4 else "") if running else ""
                if task is None:
                    task = progress.add_task(run_id, total=len(steps), running=label)
                progress.update(task, completed=finished, running=label)
                if view["run"]["status"] != "running":
                    break
                time.sleep(0.25)
    finally:
        done.set()
        for w in ws:
            w.stop_event.set()
        rt.stop_event.set()
        for t in threads:
            t.join(timeout=30)
        for w in ws:
            w.close()
        rt.close()
    _print_table(console, view, outcomes)
    status = view["run"]["status"]
    console.print(f"run {run_id} ended [bold]{status}[/]")
    return 0 if status == "succeeded" else 1


def _print_table(console: Console, view: dict, outcomes: dict[str, AttemptOutcome]) -> None:
    by_step: dict[str, dict] = {}
    for a in view["attempts"]:
        by_step[a["step_key"]] = a  # last attempt per step (ordered by attempt number)
    table = Table(title=f"run {view['run']['id']}: {view['run']['status']}")
    for col in ("step", "state", "attempt", "exit code", "duration", "log"):
        table.add_column(col)
    for s in view["steps"]:
        a = by_step.get(s["step_key"])
        o = outcomes.get(a["attempt_id"]) if a else None
        detail = (a or {}).get("detail") or {}
        exit_code = o.exit_code if o else detail.get("exit_code") if detail else None
        if a and a.get("exit_code") is not None:
            exit_code = a["exit_code"]
        dur = ""
        if a and a.get("started_at_ms") and a.get("ended_at_ms"):
            dur = f"{(a['ended_at_ms'] - a['started_at_ms']) / 1000:.2f}s"
        logp = o.stdout_path.rsplit("/", 1)[0] if o else (detail.get("stdout_path", "").rsplit("/", 1)[0] if detail else "")
        style = {"succeeded": "green", "failed": "red", "skipped": "yellow", "timed_out": "red",
                 "cancelled": "magenta"}.get(s["status"], "")
        table.add_row(s["step_key"], f"[{style}]{s['status']}[/]" if style else s["status"],
                      str(a["attempt"]) if a else "-", "" if exit_code is None else str(exit_code), dur, logp)
    console.print(table)
