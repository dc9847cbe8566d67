"""The ``qlpg`` command line.

Every command reads libpq conventions: ``--dsn``, else ``DATABASE_URL``, else the ``PG*``
environment variables and libpq defaults. Role-bound commands (``package install``,
``workflow start``, ``runtime``, ``worker``, ``cancel``, ``status``, ``recover``) expect a login
that is a member of the right ``ql3_*`` group role (``qlpg roles create-login``).

Exit status: 0 success; 1 the job ran and ended otherwise (a failed Run, a failing check);
2 usage, configuration or connection errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from pathlib import Path

from rich.console import Console

from . import __version__, api, db, errors

console = Console()


def _conninfo(args) -> str:
    return db.resolve_conninfo(getattr(args, "dsn", None))


def _connect(args):
    return db.connect(_conninfo(args), pooler=True if getattr(args, "pooler", False) else None)


# ------------------------------------------------------------------ commands
def cmd_migrate(args) -> int:
    from . import migrate

    res = migrate.migrate(_conninfo(args), force_functions=args.force_functions)
    console.print(f"applied migrations: {', '.join(res.applied) or 'none'}; functions "
                  f"{'deployed' if res.functions_deployed else 'unchanged'} ({res.function_files} files, "
                  f"digest {res.functions_digest[:16]}…)")
    return 0


def cmd_roles_create(args) -> int:
    import os

    from . import roles

    pw = os.environ.get(args.password_env) if args.password_env else None
    if args.password_env and pw is None:
        console.print(f"[red]environment variable {args.password_env} is not set[/]")
        return 2
    with _connect(args) as conn:
        out = roles.create_login(conn, args.name, args.role, password=pw)
    console.print(f"login {args.name}: {out} (member of {args.role} only)")
    return 0


def cmd_roles_drop(args) -> int:
    from . import roles

    with _connect(args) as conn:
        out = roles.drop_login(conn, args.name)
    console.print(f"login {args.name}: {out}")
    return 0


def cmd_package_install(args) -> int:
    from . import install

    with _connect(args) as conn:
        r = install.install_package(conn, args.directory, args.project)
    console.print(f"{r.manifest.package} {r.manifest.version}: generation {r.generation} ({r.outcome}); "
                  f"revision {r.revision_digest[:16]}…; publication {r.publication_id}")
    return 0


def cmd_workflow_start(args) -> int:
    from . import install

    with _connect(args) as conn:
        # A lost COMMIT answer is resolved by inspecting the durable receipt on a new connection.
        rec = install.start_workflow(conn, args.project, args.package, args.workflow, args.run_id,
                                     reconnect=lambda: _connect(args))
    if args.json:
        print(json.dumps({"run_id": rec.run_id, "plan_digest": rec.plan_digest, "receipt": rec.receipt,
                          "receipt_digest": rec.receipt_digest, "replayed": rec.replayed}, indent=2))
    else:
        console.print(f"run {rec.run_id} admitted{' (replayed)' if rec.replayed else ''}; plan {rec.plan_digest}")
    return 0


def _partition(text: str) -> tuple[int, int]:
    """``K/N`` -> (K, N) with 0 <= K < N (argparse type of ``qlpg runtime --partition``)."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N, got {text!r}") from None
    if not (n >= 1 and 0 <= k < n):
        raise argparse.ArgumentTypeError(f"need 0 <= K < N, got {text!r}")
    return (k, n)


def cmd_runtime(args) -> int:
    from .runtime import Runtime
    from .worker import install_sigterm

    if args.batch and args.partition:
        print("qlpg runtime: error: --partition applies to per-candidate admission, not --batch", file=sys.stderr)
        return 2
    rt = Runtime(_conninfo(args), recovery=not args.no_recovery, batch=args.batch, partition=args.partition)
    if args.once:
        s = rt.run_once()
        console.print(f"admitted {s.admitted}, replayed {s.replayed}, skipped {s.skipped}, refused {s.failed}, "
                      f"cancels converged {s.cancels_converged}, recovered {s.recovered}, "
                      f"awaiting evidence {s.recovery_retry}, needs operator {s.recovery_manual}", soft_wrap=True)
        return 0
    install_sigterm(rt.stop_event)
    rt.run_forever(idle_sleep_s=args.idle_ms / 1000)
    return 0


def cmd_worker(args) -> int:
    from .worker import Worker, default_worker_id, install_sigterm

    w = Worker(_conninfo(args), args.worker_id or default_worker_id(), Path(args.state_dir).resolve(),
               lease_ms=args.lease_ms, executor_type=args.executor_type, combined_start=args.combined_start)
    if args.reset_session:
        # The previous session may have run --concurrency threads under <id>.N: reset them all.
        ids = [w.worker_id] + [f"{w.worker_id}.{i}" for i in range(1, max(1, args.concurrency))]
        n = sum(len(w._call(api.worker_session_reset, wid)) for wid in ids)
        console.print(f"worker {w.worker_id}: declared {n} previous lease(s) dead (not_running)")
    if args.once:
        w.run_once()
        return 0
    install_sigterm(w.stop_event)
    threads = []
    for i in range(max(1, args.concurrency)):
        wi = w if i == 0 else Worker(w.conninfo, f"{w.worker_id}.{i}", w.state_dir, lease_ms=w.lease_ms,
                                     executor_type=w.executor_type, stop_event=w.stop_event,
                                     combined_start=w.combined_start)
        t = threading.Thread(target=wi.run_forever, daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return 0


def cmd_run(args) -> int:
    from .mainjob import run_main_job

    if args.temp_cluster:
        from .cluster import TempCluster

        with TempCluster() as cl:
            import os

            # tasks (pg_dump, pg_restore, psql) use the client programs of the cluster's own
            # release, whatever else is first on PATH: a newer pg_dump writes archives an older
            # server cannot restore (e.g. PostgreSQL 17+'s SET transaction_timeout)
            os.environ["PATH"] = cl.bindir + os.pathsep + os.environ.get("PATH", "")
            console.print(f"[bold]temp cluster[/]: PostgreSQL {cl.version} on port {cl.port} (removed at exit)")
            return run_main_job(cl.conninfo, args.directory, workflow=args.workflow, workers=args.workers,
                                project_id=args.project, state_dir=Path(args.state_dir), console=console)
    return run_main_job(_conninfo(args), args.directory, workflow=args.workflow, workers=args.workers,
                        project_id=args.project, state_dir=Path(args.state_dir), console=console)


def _all_events(conn, run_id: str) -> list[dict]:
    """Every event of a Run, paged by sequence (1000 per call)."""
    out: list[dict] = []
    while True:
        page = api.run_events_page(conn, run_id, out[-1]["sequence"] if out else None, 1000)
        out += page
        if len(page) < 1000:
            return out


def cmd_status(args) -> int:
    """A Run's states, attempts (with recovery controls) and, with --events, its audit trail."""
    with _connect(args) as conn:
        view = api.run_inspect(conn, args.run_id)
        if args.events:
            view["events"] = _all_events(conn, args.run_id)
    if args.json:
        print(json.dumps(view, indent=2, sort_keys=True))
        return 0
    from rich.table import Table

    r = view["run"]
    cancel = (f", cancel requested ({r['cancel_reason']} by {r['cancel_actor']})"
              if r["cancel_requested_at_ms"] is not None else "")
    console.print(f"run {r['id']} [bold]{r['status']}[/] (workflow {r['workflow']}, version {r['version']}, "
                  f"events {r['event_sequence']}, attempts {r['last_attempt']}{cancel})")
    t = Table(title="steps")
    for c in ("step", "status", "version", "attempts", "current attempt"):
        t.add_column(c)
    for s in view["steps"]:
        t.add_row(s["step_key"], s["status"], str(s["version"]), str(s["attempt_count"]), s["current_attempt_id"] or "")
    console.print(t)
    if view["attempts"]:
        t = Table(title="attempts")
        for c in ("#", "attempt id", "step", "status", "worker", "exit", "stop", "recovery"):
            t.add_column(c)
        for a in view["attempts"]:
            rc = a.get("recovery") or {}
            rec = (f"{rc['status']}/{rc['resolution'] or '-'} tries {rc['failure_count']}"
                   f"{' evidence ' + rc['last_evidence'] if rc.get('last_evidence') else ''}") if rc else ""
            t.add_row(str(a["attempt"]), a["attempt_id"], a["step_key"], a["status"], a["worker_id"] or "",
                      "" if a.get("exit_code") is None else str(a["exit_code"]), a.get("stop_reason") or "", rec)
        console.print(t)
        manual = [a["attempt_id"] for a in view["attempts"] if (a.get("recovery") or {}).get("status") == "manual"]
        for aid in manual:
            console.print(f"[yellow]attempt {aid} needs an operator[/]: its worker vanished after the start "
                          f"barrier; once it is known not to run: qlpg recover --attempt {aid} --evidence not_running",
                          soft_wrap=True)
    if view.get("events"):
        for e in view["events"]:
            console.print(f"{e['sequence']:>5} {e['at_ms']} {e['type']} {e['step_run_id'] or ''} {e['attempt_id'] or ''}",
                          soft_wrap=True, markup=False)
    return 0


def cmd_cancel(args) -> int:
    with _connect(args) as conn:
        r = api.run_cancel_request(conn, args.run_id, args.reason, args.actor)
    when = f" at {r['cancel_requested_at_ms']} ms" if r["cancel_requested_at_ms"] is not None else ""
    console.print(f"run {args.run_id}: cancel {r['outcome']}{when} (run {r['run_status']}); "
                  "`qlpg runtime` converges it", soft_wrap=True)
    return 0


def cmd_recover(args) -> int:
    with _connect(args) as conn:
        r = api.recovery_evidence_record(conn, args.attempt, args.evidence, args.actor)
    console.print(f"attempt {r['attempt_id']}: evidence {r['last_evidence']} recorded; control {r['status']} "
                  "(`qlpg runtime` resolves it once the lease has expired)", soft_wrap=True)
    return 0


def cmd_doctor(args) -> int:
    from . import doctor

    rows = doctor.run_checks(_conninfo(args))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            mark = "[green]ok[/]" if r["ok"] else "[red]FAIL[/]"
            console.print(f"{mark} {r['check']}: {r['detail']}")
    return 0 if all(r["ok"] for r in rows) else 1


def cmd_security_report(args) -> int:
    from . import security

    with _connect(args) as conn:
        m = security.privilege_matrix(conn)
    print(security.render_json(m) if args.json else security.render_markdown(m), end="")
    return 0


def cmd_api_docs(args) -> int:
    from . import doctor

    with _connect(args) as conn:
        text = doctor.api_markdown(conn)
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text, end="")
    return 0


# ------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsn", help="libpq connection string or URI (default: $DATABASE_URL, then PG* variables)")
    common.add_argument("--pooler", action="store_true",
                        help="behind a transaction pooler (PgBouncer pool_mode=transaction): never prepare statements")
    common.add_argument("-v", "--verbose", action="store_true")
    p = argparse.ArgumentParser(prog="qlpg", description="PostgreSQL-native execution authority for Qinglong-style automation")
    p.add_argument("--version", action="version", version=f"qlpg {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("migrate", parents=[common], help="create roles and schema, apply migrations and functions")
    s.add_argument("--force-functions", action="store_true", help="re-apply sql/functions even if unchanged")
    s.set_defaults(fn=cmd_migrate)

    r = sub.add_parser("roles", help="login users for services").add_subparsers(dest="roles_cmd", required=True)
    s = r.add_parser("create-login", parents=[common], help="create a login that is a member of exactly one ql3 role")
    s.add_argument("name")
    s.add_argument("--role", required=True)
    s.add_argument("--password-env", help="take the password from this environment variable")
    s.set_defaults(fn=cmd_roles_create)
    s = r.add_parser("drop-login", parents=[common], help="drop a login")
    s.add_argument("name")
    s.set_defaults(fn=cmd_roles_drop)

    pk = sub.add_parser("package", help="packages (ql3_package_manager)").add_subparsers(dest="pkg_cmd", required=True)
    s = pk.add_parser("install", parents=[common], help="install DIR/qinglong-package.yaml")
    s.add_argument("directory")
    s.add_argument("--project", default="default")
    s.set_defaults(fn=cmd_package_install)

    wf = sub.add_parser("workflow", help="workflow runs (ql3_package_executor)").add_subparsers(dest="wf_cmd", required=True)
    s = wf.add_parser("start", parents=[common], help="admit one Workflow run")
    s.add_argument("package")
    s.add_argument("workflow")
    s.add_argument("--project", default="default")
    s.add_argument("--run-id", help="explicit Run id (replaying the same id and plan returns the same receipt)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_workflow_start)

    s = sub.add_parser("runtime", parents=[common], help="the control loop (ql3_runtime)")
    s.add_argument("--once", action="store_true", help="one bounded pass, then exit")
    s.add_argument("--no-recovery", action="store_true")
    s.add_argument("--batch", action="store_true",
                   help="admit whole candidate pages in one transaction (task_attempt_admit_page; docs/api-notes.md)")
    s.add_argument("--partition", type=_partition, metavar="K/N",
                   help="admit only the Runs in share K of N (crc32 of the Run id); run N loops, K = 0..N-1")
    s.add_argument("--idle-ms", type=int, default=500)
    s.set_defaults(fn=cmd_runtime)

    s = sub.add_parser("worker", parents=[common], help="a worker (ql3_worker_ingress)")
    s.add_argument("--worker-id")
    s.add_argument("--once", action="store_true", help="execute at most one attempt, then exit")
    s.add_argument("--concurrency", type=int, default=1, help="attempts run in parallel")
    s.add_argument("--combined-start", action="store_true",
                   help="lease and cross the start barrier in one call (lease_acquire_start; docs/api-notes.md)")
    s.add_argument("--lease-ms", type=int, default=30000)
    s.add_argument("--executor-type", default="local_process", choices=["local_process", "remote_worker"])
    s.add_argument("--state-dir", default=".qlpg", help="run scratch dirs and attempt logs")
    s.add_argument("--reset-session", action="store_true",
                   help="declare that this worker id's previous session holds nothing (after a restart)")
    s.set_defaults(fn=cmd_worker)

    s = sub.add_parser("run", parents=[common], help="the main job: migrate, install, start and drive a workflow")
    s.add_argument("directory")
    s.add_argument("--workflow")
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--project", default="default")
    s.add_argument("--state-dir", default=".qlpg")
    s.add_argument("--temp-cluster", action="store_true",
                   help="start a private throwaway cluster from the local PostgreSQL binaries and remove it at exit")
    s.set_defaults(fn=cmd_run)

    s = sub.add_parser("status", parents=[common], help="a Run's states, attempts and events (ql3_admin)")
    s.add_argument("run_id")
    s.add_argument("--json", action="store_true")
    s.add_argument("--events", action="store_true")
    s.set_defaults(fn=cmd_status)

    s = sub.add_parser("cancel", parents=[common], help="request whole-run cancellation (ql3_admin)")
    s.add_argument("run_id")
    s.add_argument("--reason", default="user", choices=["user", "policy", "shutdown"])
    s.add_argument("--actor", default="cli")
    s.set_defaults(fn=cmd_cancel)

    s = sub.add_parser("recover", parents=[common], help="record operator evidence for a lost attempt (ql3_admin)")
    s.add_argument("--attempt", required=True)
    s.add_argument("--evidence", required=True, choices=["not_running", "unknown"])
    s.add_argument("--actor", default="operator")
    s.set_defaults(fn=cmd_recover)

    s = sub.add_parser("doctor", parents=[common], help="readiness checks; non-zero exit when any fails")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_doctor)

    sec = sub.add_parser("security", help="security review").add_subparsers(dest="sec_cmd", required=True)
    s = sec.add_parser("report", parents=[common], help="role x object privilege matrix from the catalog")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_security_report)

    s = sub.add_parser("api-docs", parents=[common], help="generate docs/api.md from COMMENT ON FUNCTION")
    s.add_argument("--output")
    s.set_defaults(fn=cmd_api_docs)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "pooler", False):
        # every connection of this process (runtime and worker threads, migrate, the main job)
        # reads QLPG_POOLER through db.pooler_mode(): one switch, not a parameter per call path
        import os

        os.environ["QLPG_POOLER"] = "transaction"
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.fn(args)
    except errors.ConnectError as exc:
        print(f"qlpg: error: {exc}", file=sys.stderr)
        return 2
    except errors.QlpgError as exc:
        print(f"qlpg: {type(exc).__name__} ({getattr(exc, 'sqlstate', None) or '-'}): {exc}", file=sys.stderr)
        return 2 if getattr(exc, "sqlstate", None) in (None, "QL001", "QL002", "QL601") else 1
    except Exception as exc:  # noqa: BLE001
        from .manifest import ManifestError

        if isinstance(exc, ManifestError):
            print(f"qlpg: {exc}", file=sys.stderr)
            return 2
        import psycopg

        if isinstance(exc, psycopg.Error):
            print(f"qlpg: database error: {exc}", file=sys.stderr)
            return 2 if getattr(exc, "sqlstate", "") == "42501" else 1
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
