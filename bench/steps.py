#!/usr/bin/env python3
"""Step cycle throughput: admit -> lease -> start -> running -> complete (+ frontier), in steps/s,
with 1, 4 and 8 workers on single-step and 32-wide fan-out Workflows; unbatched, batched, and the
client stack's floor; beside pgbench's one-row INSERT on the same server in the same run. Results
go to docs/benchmarks.md "## Step cycle" and, under /work/shared/peers/run.sh (``PEER_EXTRA``), as
JSON lines into ``$PEER_RESULTS``.

What one step costs (every call a real ``ql3`` function through :mod:`qlpg.api`, each its own
short transaction at the step calls' default isolation, READ COMMITTED -- docs/design-notes.md):

* unbatched: ``max(1, workers // 2)`` runtime processes (:class:`qlpg.runtime.Runtime`,
  ``partition=(k, n)``, docs/operations.md "Scaling admission"; ``--runtimes N`` to pin) page
  candidates (1 call per 64) and admit each epoch with ``task_attempt_admit``; each worker process
  loops ``lease_acquire_start`` (1 attempt: lease + start barrier) -> ``attempt_running`` ->
  ``attempt_complete`` (which advances the frontier and aggregates the Run): 4 commits per step.
* batched: one runtime admits whole candidate pages with ``task_attempt_admit_page`` (<= 64 per
  transaction); each worker leases and starts up to 32 attempts per ``lease_acquire_start`` and
  reports them with ``attempt_running_batch`` and ``attempt_complete_batch``.
* floor: the same worker processes and client path (:func:`qlpg.db.call`), four one-row INSERT
  commits per "step" and no ``ql3`` call: the ceiling of any 4-commit step through psycopg here.

Jobs are no-ops, as in the peer comparison: workers make the calls but spawn no process (a real
``qlpg worker`` adds the fork/exec of the task and its log files per step). Workflows: ``single``
(1 step per Run) and ``fan32`` (root -> 32 parallel steps: 33 per Run; completing the root makes 32
steps ready in the same transaction). Each template first runs ``--warm`` steps serially, then
``VACUUM ANALYZE`` (statistics of empty tables would make the cached plans sequential scans:
docs/operations.md "Planner statistics"); the measured Runs are admitted before the clock starts
(like the peers' pre-enqueued jobs); the clock runs from "go" until a poller (every 20 ms) sees
every Run terminal. Commits per step = the database's ``xact_commit`` delta over that window /
steps (it includes idle polling and the poller itself); "calls/step" counts only the productive
calls (each one transaction), "idle polls/step" the empty ``lease_acquire_start``/candidate reads
(idle workers back off from 1 to 50 ms); CPU ms/step = the client processes' own CPU time and
their backends' (``/proc/<pid>/stat``, same machine only) over the steps.

Usage: ``python bench/steps.py [--steps 2000] [--workers 1,4,8] [--seconds-pgbench 10]
[--modes unbatched,batched,floor] [--shapes single,fan32] [--warm 264] [--runtimes auto|N]
[--profile] [--no-write] [--dsn CONNINFO]``.
Under run.sh: ``PEER_EXTRA='cd /work/main && .venv/bin/python bench/steps.py --no-write'``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "pyshell"))
sys.path.insert(0, str(HERE))

import psycopg  # noqa: E402

import common  # noqa: E402
from qlpg import api, db, install  # noqa: E402

ROLES = {"ql3_package_manager": "pm", "ql3_package_executor": "pe", "ql3_runtime": "rt", "ql3_worker_ingress": "wk"}
SHAPES = {"single": 1, "fan32": 33}
LEASE_MS = 60000


# ------------------------------------------------------------------ children (one process each)
_CPU0 = [0.0, 0.0]
_BACKENDS: list[int] = []


def _backend_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a server backend on this machine (0.0 when not readable, or
    when that pid here is not a postgres process: a server on another host or in another PID namespace)."""
    try:
        if Path(f"/proc/{pid}/comm").read_text().strip() != "postgres":
            return 0.0
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _cpu_s() -> dict:
    """CPU seconds since READY: this client process's and its backends' (same machine only)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"client": r.ru_utime + r.ru_stime - _CPU0[0],
            "server": sum(_backend_cpu(p) for p in _BACKENDS) - _CPU0[1]}


def _ready(*conns) -> None:
    _BACKENDS[:] = [c.info.backend_pid for c in conns]
    print("READY", flush=True)
    sys.stdin.readline()
    cpu = _cpu_s()
    _CPU0[:] = [cpu["client"], cpu["server"]]


def child_worker(conninfo: str, worker_id: str, mode: str, batch: int) -> None:
    conn = db.connect(conninfo, application_name=f"bench-{worker_id}")
    api.readiness(conn)  # warm the connection
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    _ready(conn)
    steps = calls = polls = 0
    idle = 0.001
    while not stop:
        ls = api.lease_acquire_start(conn, worker_id, "local_process", batch if mode == "batched" else 1, LEASE_MS)
        if not ls:
            polls += 1
            time.sleep(idle)
            idle = min(idle * 2, 0.05)
            continue
        idle = 0.001
        calls += 1
        for l in ls:
            if l.status != "starting":  # the Run lock was busy at lease time: cross the barrier now
                api.attempt_start(conn, l.attempt_id, l.lease_token)
                calls += 1
        if mode == "batched":
            api.attempt_running_batch(conn, [(l.attempt_id, l.lease_token) for l in ls])
            api.attempt_complete_batch(conn, [(l.attempt_id, l.lease_token, "succeeded", 0, None) for l in ls])
            calls += 2
        else:
            for l in ls:
                api.attempt_running(conn, l.attempt_id, l.lease_token)
                api.attempt_complete(conn, l.attempt_id, l.lease_token, "succeeded", 0)
                calls += 2
        steps += len(ls)
    print(json.dumps({"steps": steps, "calls": calls, "polls": polls, "cpu_s": _cpu_s()}), flush=True)


def child_floor(conninfo: str, worker_id: str, steps: int) -> None:
    """The floor: the cheapest possible 4-commit "step" through the same client stack -- four
    :func:`qlpg.db.call` transactions, each one one-row INSERT (pgbench's insert.sql), no ql3 call."""
    conn = db.connect(conninfo, application_name=f"bench-floor-{worker_id}")
    rc = psycopg.IsolationLevel.READ_COMMITTED  # as the step calls (QLPG_STEP_ISOLATION's default)
    db.call(conn, "SELECT 1", isolation=rc)
    _ready(conn)
    t0 = time.perf_counter()
    for _ in range(steps):
        for _ in range(4):
            db.call(conn, "INSERT INTO public.step_floor (payload) VALUES ('{}')", isolation=rc)
    elapsed = time.perf_counter() - t0
    print(json.dumps({"steps": steps, "calls": 4 * steps, "polls": 0, "elapsed_s": elapsed, "cpu_s": _cpu_s()}),
          flush=True)


def child_runtime(conninfo: str, mode: str, partition: str = "0/1") -> None:
    from qlpg.runtime import PassStats, Runtime

    k, n = (int(x) for x in partition.split("/"))
    rt = Runtime(conninfo, batch=(mode == "batched"), recovery=False, partition=None if n == 1 else (k, n))
    api.readiness(rt._connection())
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    _ready(rt._connection())
    total = PassStats()
    calls = polls = 0
    idle = 0.001
    while not stop:
        stats, after = PassStats(), None
        while True:
            before = stats.admitted + stats.replayed + stats.skipped
            after = rt.admit_page(after, stats)
            n = stats.admitted + stats.replayed + stats.skipped - before
            if n:  # a page read + one admission call per candidate (one call per page when batched)
                calls += 1 + (0 if mode == "batched" else n)
            else:
                polls += 1
            if after is None:
                break
        total.admitted += stats.admitted
        if stats.admitted:
            idle = 0.001
        else:
            time.sleep(idle)
            idle = min(idle * 2, 0.05)
    print(json.dumps({"admitted": total.admitted, "calls": calls, "polls": polls, "cpu_s": _cpu_s()}), flush=True)


# ------------------------------------------------------------------ orchestration
def spawn(args: list[str]) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "READY":
        p.kill()
        raise RuntimeError(f"child {args} did not start: {line!r}")
    return p


def write_package(d: Path) -> Path:
    fan = {f"f{i:02d}": {"task": "noop", "needs": ["root"]} for i in range(32)}
    doc = {"package": "stepbench", "version": "1.0.0", "publisher": "bench",
           "tasks": {"noop": {"command": ["true"], "timeout_ms": 600000}},
           "workflows": {"single": {"steps": {"s": {"task": "noop"}}},
                         "fan32": {"steps": {"root": {"task": "noop"}, **fan}}}}
    (d / "qinglong-package.yaml").write_text(json.dumps(doc))
    return d


def xact_commit(conn) -> int:
    return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()[0]


def measure(db_ci: str, logins: dict[str, str], mode: str, workers: int, steps_total: int, batch: int,
            warm: int = 0, runtimes: int = 1) -> dict:
    """One cell: ``steps_total`` steps of the Runs admitted in the template, ``warm`` steps of which
    were already run (the template's warm-up) and are not counted."""
    if mode == "floor":
        return measure_floor(db_ci, logins, workers, steps_total)
    su = psycopg.connect(db_ci, autocommit=True)
    nrt = runtimes if mode == "unbatched" else 1
    rts = [spawn(["--child", "runtime", common.with_user(db_ci, logins["ql3_runtime"]), mode, f"{k}/{nrt}"])
           for k in range(nrt)]
    ws = [spawn(["--child", "worker", common.with_user(db_ci, logins["ql3_worker_ingress"]), f"bw{i}", mode, str(batch)])
          for i in range(workers)]
    su.execute("SELECT pg_stat_clear_snapshot()")
    c0 = xact_commit(su)
    t0 = time.perf_counter()
    for p in [*rts, *ws]:
        p.stdin.write("go\n")
        p.stdin.flush()
    deadline = t0 + 600
    try:
        while True:
            if not su.execute("SELECT EXISTS (SELECT 1 FROM ql3.runs WHERE status = 'running')").fetchone()[0]:
                break
            if time.perf_counter() > deadline:
                raise TimeoutError("steps did not finish in 600 s")
            dead = [p for p in (*rts, *ws) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a benchmark process exited early (rc {dead[0].returncode})")
            time.sleep(0.02)
    except BaseException:
        for p in (*rts, *ws):
            p.kill()
        raise
    elapsed = time.perf_counter() - t0
    outs = []
    for p in [*rts, *ws]:
        p.send_signal(signal.SIGTERM)
    for p in [*rts, *ws]:
        out, _ = p.communicate(timeout=30)
        outs.append(json.loads(out.strip().splitlines()[-1]))
    time.sleep(0.6)  # let the backends' statistics arrive
    su.execute("SELECT pg_stat_clear_snapshot()")
    commits = xact_commit(su) - c0
    done = su.execute("SELECT count(*) FROM ql3.run_attempts WHERE status = 'succeeded'").fetchone()[0]
    bad = su.execute("SELECT count(*) FROM ql3.runs WHERE status <> 'succeeded'").fetchone()[0]
    su.close()
    assert done == steps_total + warm and bad == 0, (done, steps_total, warm, bad)
    calls = sum(o["calls"] for o in outs)
    polls = sum(o["polls"] for o in outs)
    client_cpu = sum(o["cpu_s"]["client"] for o in outs)
    server_cpu = sum(o["cpu_s"]["server"] for o in outs)
    return {"steps_per_s": steps_total / elapsed, "elapsed_s": elapsed, "commits_per_step": commits / steps_total,
            "calls_per_step": calls / steps_total, "polls_per_step": polls / steps_total,
            "client_cpu_ms": 1000 * client_cpu / steps_total, "server_cpu_ms": 1000 * server_cpu / steps_total}


def measure_floor(db_ci: str, logins: dict[str, str], workers: int, steps_total: int) -> dict:
    """The same worker processes and client path, but each step is four one-row INSERT commits
    (``mode == "floor"``, READ COMMITTED like the step calls): what 4 commits per step cost before
    qlpg does any work. steps/s is the sum of the workers' own rates."""
    su = psycopg.connect(db_ci, autocommit=True)
    su.execute("CREATE TABLE IF NOT EXISTS public.step_floor (id bigserial PRIMARY KEY,"
               " created_at timestamptz NOT NULL DEFAULT now(), payload jsonb)")
    su.execute("GRANT INSERT ON public.step_floor TO PUBLIC")
    su.execute("GRANT USAGE ON SEQUENCE public.step_floor_id_seq TO PUBLIC")
    per = [steps_total // workers + (1 if i < steps_total % workers else 0) for i in range(workers)]
    ws = [spawn(["--child", "floor", common.with_user(db_ci, logins["ql3_worker_ingress"]), f"fw{i}", str(n)])
          for i, n in enumerate(per)]
    su.execute("SELECT pg_stat_clear_snapshot()")
    c0 = xact_commit(su)
    t0 = time.perf_counter()
    for p in ws:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in ws]
    elapsed = time.perf_counter() - t0
    # the sum of the workers' own rates (each timed from "go" to its last commit): a worker that
    # finishes early does not stretch the others' clock, and process exit is not counted -- an
    # estimate that leans high, so the floor is not understated
    rate = sum(o["steps"] / o["elapsed_s"] for o in outs)
    time.sleep(0.6)
    su.execute("SELECT pg_stat_clear_snapshot()")
    commits = xact_commit(su) - c0
    rows = su.execute("SELECT count(*) FROM public.step_floor").fetchone()[0]
    su.close()
    assert rows == 4 * steps_total, (rows, steps_total)
    return {"steps_per_s": rate, "elapsed_s": elapsed, "commits_per_step": commits / steps_total,
            "calls_per_step": sum(o["calls"] for o in outs) / steps_total, "polls_per_step": 0.0,
            "client_cpu_ms": 1000 * sum(o["cpu_s"]["client"] for o in outs) / steps_total,
            "server_cpu_ms": 1000 * sum(o["cpu_s"]["server"] for o in outs) / steps_total}


def clone(admin_ci: str, template: str, name: str) -> str:
    with psycopg.connect(admin_ci, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return psycopg.conninfo.make_conninfo(admin_ci, dbname=name)


def drop(admin_ci: str, name: str) -> None:
    with psycopg.connect(admin_ci, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def prepare_template(db_ci: str, logins: dict[str, str], shape: str, steps: int, warm: int = 0) -> tuple[int, int]:
    """Install the package, run ``warm`` steps' worth of Runs of ``shape`` through a serial cycle
    (so that every table the cycle touches holds rows when ANALYZE runs: statistics of empty tables
    make the cached generic plans of the step functions sequential scans, and a burst of steps then
    costs quadratic time -- docs/operations.md "Planner statistics"), then admit the measured Runs
    and VACUUM ANALYZE. Returns (measured steps, warm-up steps)."""
    per_run = SHAPES[shape]
    with tempfile.TemporaryDirectory() as d:
        pkg = write_package(Path(d))
        with db.connect(common.with_user(db_ci, logins["ql3_package_manager"])) as pm:
            install.install_package(pm, pkg)
        runs = max(1, steps // per_run)
        warm_runs = -(-warm // per_run) if warm > 0 else 0
        with db.connect(common.with_user(db_ci, logins["ql3_package_executor"])) as pe:
            install.prepare_plan(pe, "default", "stepbench", shape)
            for _ in range(warm_runs):
                install.start_workflow(pe, "default", "stepbench", shape)
            if warm_runs:
                done = serial_cycle(db_ci, logins, warm_runs * per_run)
                assert done == warm_runs * per_run, (done, warm_runs * per_run)
            for _ in range(runs):
                install.start_workflow(pe, "default", "stepbench", shape)
    with psycopg.connect(db_ci, autocommit=True) as c:
        c.execute("VACUUM ANALYZE")
        c.execute("CHECKPOINT")
    return runs * per_run, warm_runs * per_run


def serial_cycle(db_ci: str, logins: dict[str, str], n: int, lat: dict[str, list[float]] | None = None) -> int:
    """Run up to ``n`` steps serially (one runtime, one worker connection, unbatched); when ``lat``
    is given, append each call's client latency (s) to it. Returns the number of steps run."""
    from qlpg.runtime import PassStats, Runtime

    lat = lat if lat is not None else {}
    rt = Runtime(common.with_user(db_ci, logins["ql3_runtime"]), recovery=False)
    wk = db.connect(common.with_user(db_ci, logins["ql3_worker_ingress"]))
    done = 0
    try:
        while done < n:
            t = time.perf_counter()
            stats = PassStats()
            rt.admit_page(None, stats)
            if stats.admitted:
                lat.setdefault("admit", []).append((time.perf_counter() - t) / stats.admitted)
            ls = None
            while done < n:
                t = time.perf_counter()
                ls = api.lease_acquire_start(wk, "prof", "local_process", 1, LEASE_MS)
                if not ls:
                    break
                lat.setdefault("lease_acquire_start", []).append(time.perf_counter() - t)
                (l,) = ls
                t = time.perf_counter()
                api.attempt_running(wk, l.attempt_id, l.lease_token)
                lat.setdefault("attempt_running", []).append(time.perf_counter() - t)
                t = time.perf_counter()
                api.attempt_complete(wk, l.attempt_id, l.lease_token, "succeeded", 0)
                lat.setdefault("attempt_complete", []).append(time.perf_counter() - t)
                done += 1
            if not stats.admitted and not ls:
                break
    finally:
        rt.close()
        wk.close()
    return done


def profile(db_ci: str, logins: dict[str, str], n: int) -> dict:
    """One connection per role, serial cycles (unbatched): client latency per call and the server's
    own time per function (track_functions = all for this database)."""
    su = psycopg.connect(db_ci, autocommit=True)
    dbname = su.info.dbname
    su.execute(f'ALTER DATABASE "{dbname}" SET track_functions = \'all\'')
    su.execute("SELECT pg_stat_reset()")
    lat: dict[str, list[float]] = {k: [] for k in ("admit", "lease_acquire_start", "attempt_running", "attempt_complete")}
    t_all = time.perf_counter()
    done = serial_cycle(db_ci, logins, n, lat)
    elapsed = time.perf_counter() - t_all
    time.sleep(0.8)
    su.execute("SELECT pg_stat_clear_snapshot()")
    funcs = su.execute("SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions"
                       " WHERE schemaname = 'ql3' ORDER BY self_time DESC").fetchall()
    su.execute(f'ALTER DATABASE "{dbname}" RESET track_functions')
    su.close()
    return {"steps": done, "steps_per_s": done / elapsed,
            "client_ms": {k: 1000 * statistics.median(v) for k, v in lat.items() if v},
            "functions": [(f, c, t / done, s / done) for f, c, t, s in funcs]}


def _cell(rows: list[dict], shape: str, mode: str, workers: int) -> dict | None:
    for r in rows:
        if r["shape"] == shape and r["mode"] == mode and r["workers"] == workers:
            return r
    return None


def render(info: dict, cmd: str, pg: dict[int, float], rows: list[dict], prof: dict | None, secs: float,
           warm: int, runtimes: str) -> str:
    s = info["settings"]
    out = [f"Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (`{cmd}`), {secs:.0f} s in all; single runs, "
           "read each figure as ±20 % (load average "
           f"{info['load_avg'][0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; pgbench runs last, "
           "after the qlpg cells, so a box that got quieter meanwhile favours it).", "",
           f"Machine: {info['cpus']} cores, {info['mem_gib']} GiB; PostgreSQL {info['server_version']}: "
           + ", ".join(f"{k}={v}" for k, v in s.items()) + f". Python {info['python']}, psycopg {info['psycopg']}, "
           "unix socket; the server, the runtime processes, the worker processes and the poller share the cores. "
           f"Each template ran {warm} warm-up steps before `VACUUM ANALYZE` (docs/operations.md \"Planner "
           f"statistics\"); unbatched cells admit with {runtimes} partitioned runtime loop(s) "
           "(docs/operations.md \"Scaling admission\"), batched cells with one `--batch` loop.", "",
           "| workflow | path | workers | steps | steps/s | commits/step | calls/step | idle polls/step "
           "| server CPU ms/step | client CPU ms/step | pgbench INSERT tps (same clients) | ratio |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = pg.get(r["workers"])
        ptxt = f"{p:,.0f}" if p else "-"
        ratio = f"{r['steps_per_s'] / p:.2f}" if p else "-"
        out.append(f"| {r['shape']} | {r['mode']} | {r['workers']} | {r['steps']} | {r['steps_per_s']:,.0f} | "
                   f"{r['commits_per_step']:.2f} | {r['calls_per_step']:.2f} | {r['polls_per_step']:.2f} | "
                   f"{r['server_cpu_ms']:.2f} | {r['client_cpu_ms']:.2f} | {ptxt} | {ratio} |")
    wmax = max((r["workers"] for r in rows), default=0)
    unb, bat, flo = (_cell(rows, "single", "unbatched", wmax), _cell(rows, "single", "batched", wmax),
                     _cell(rows, "-", "floor", wmax))
    pmax = pg.get(wmax)
    out += ["", "Same run beside the peer queues (`/work/shared/peers/run.sh`, rows into `$PEER_RESULTS` and its "
            "table): `PEER_EXTRA='cd /work/main && .venv/bin/python bench/steps.py --no-write' bash "
            "/work/shared/peers/run.sh` (a quick check: `PEER_ONLY=pgbench PEER_N=5000 PEER_PGBENCH_T=5 PEER_RUNS=1 "
            "PEER_OUT=/tmp/peer-out` and `--steps 300 --workers 1,8` in `PEER_EXTRA`).", "",
            "Reading it:", "",
            "* **Commits per step.** The productive calls are 4.0 per step unbatched (admission, lease+start, "
            "running, completion: 4 commits) and 3 per batch of up to 64 admissions / 32 leases when batched; the "
            "measured `xact_commit` delta also counts idle polls (workers waiting for admissions, the fan-out "
            "waiting for its root) and the poller.",
            "* **The floor** (`path = floor`) is the same worker processes and the same client path "
            "(`qlpg.db.call`: `BEGIN ISOLATION LEVEL READ COMMITTED; statement; COMMIT` in one message, one "
            "synchronous connection per process) doing four one-row INSERT commits per \"step\" and nothing "
            "else: what a 4-commit step costs through this client stack on this machine before qlpg does any "
            "work (steps/s = the sum of the workers' own rates, which leans high). The CPU columns are each client process's own CPU time and its backend's "
            "(`/proc/<pid>/stat`), divided by the steps."]
    if unb and flo and pmax:
        out.append(
            f"* **Targets.** At most 4 commits per step: met by the productive calls. Unbatched ≥ 0.25× pgbench's "
            f"INSERT tps at {wmax} clients = {0.25 * pmax:,.0f} steps/s: **not met** — qlpg ran "
            f"{unb['steps_per_s']:,.0f} steps/s ({unb['steps_per_s'] / pmax:.2f}×). The floor itself reaches "
            f"{flo['steps_per_s']:,.0f} steps/s ({flo['steps_per_s'] / pmax:.2f}×): with four commits per step "
            "the target asks each commit to cost what a pgbench INSERT costs from C, and the cheapest 4-commit "
            "step through this client stack (one synchronous psycopg connection per process) does not get "
            f"there on these 2 cores even with no qlpg work at all (its clients use {flo['client_cpu_ms']:.2f} ms "
            f"of CPU per step, its server side {flo['server_cpu_ms']:.2f} ms)."
            + (f" The batched path ran {bat['steps_per_s']:,.0f} steps/s against graphile-worker's batched drain "
               "(18,452 jobs/s in shared/peers/RESULTS.md; the full peer run below measures it in the same run)."
               if bat else ""))
        out.append(
            f"* **Where the time goes.** Server CPU: {unb['server_cpu_ms']:.2f} ms per unbatched step against the "
            f"floor's {flo['server_cpu_ms']:.2f} ms" + (f"; {bat['server_cpu_ms']:.2f} ms batched. " if bat else ". ")
            + "That is PL/pgSQL inside the authority, not round trips or fsync: per single-step Run about 35 "
            "rows are written (7 RunEvents and 7 versions of the Run row, the ledger row, the RunAttempt "
                    "and 4 updates of it, the lease and its end, the completion receipt, 3 StepRun versions and "
                    "2 mutations, with their indexes, CHECK constraints and foreign keys) by ~145 SQL statements "
                    "in ~40 function calls (profile below), plus role checks, advisory locks, the lease fence "
                    "(SHA-256 of the token) and receipt digests. No single statement dominates (a `perf` profile "
                    "of the backends is flat: executor start-up, CHECK-constraint expressions rebuilt per "
                    "statement, index inserts, WAL); halving it needs fewer rows and statements per step "
                    "(one Run-row update per transaction instead of one per event, one event for an attempt "
                    "and StepRun transition — a change of the DESIGN §4 audit contract), not fewer round trips. "
                    f"Clients: {unb['client_cpu_ms']:.2f} ms of Python CPU per step (result parsing, candidate "
                    f"pages, idle polls) against the floor's {flo['client_cpu_ms']:.2f} ms.")
    if prof:
        out += ["", f"Profile (unbatched, one runtime and one worker connection, serial, {prof['steps']} single-step Runs, "
                    f"track_functions = all: {prof['steps_per_s']:.0f} steps/s). Client-side median latency per call: "
                + ", ".join(f"{k} {v:.2f} ms" for k, v in prof["client_ms"].items()) + ". Server time per step (ms):", "",
                "| function | calls/step | total ms/step | self ms/step |", "|---|---:|---:|---:|"]
        for f, c, t, sf in prof["functions"][:14]:
            out.append(f"| {f} | {c / prof['steps']:.1f} | {t:.3f} | {sf:.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs="+")
    ap.add_argument("--steps", type=int, default=int(os.environ.get("QLPG_BENCH_STEPS", "2000")))
    ap.add_argument("--workers", default="1,4,8")
    ap.add_argument("--modes", default="unbatched,batched,floor")
    ap.add_argument("--warm", type=int, default=int(os.environ.get("QLPG_BENCH_WARM", "264")),
                    help="steps run serially in each template before ANALYZE (0: analyze empty tables)")
    ap.add_argument("--shapes", default="single,fan32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runtimes", default="auto",
                    help="partitioned runtime loops in unbatched cells (auto: max(1, workers // 2))")
    ap.add_argument("--seconds-pgbench", type=int, default=int(os.environ.get("PEER_PGBENCH_T", "10")))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--output", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--dsn")
    a = ap.parse_args()
    if a.child:
        if a.child[0] == "worker":
            child_worker(a.child[1], a.child[2], a.child[3], int(a.child[4]))
        elif a.child[0] == "floor":
            child_floor(a.child[1], a.child[2], int(a.child[3]))
        else:
            child_runtime(*a.child[1:])
        return
    t_start = time.perf_counter()
    admin = common.server_conninfo(a.dsn)
    admin_pg = psycopg.conninfo.make_conninfo(admin, dbname="postgres")
    info = common.server_info(admin)
    workers = [int(w) for w in a.workers.split(",")]
    rows: list[dict] = []
    prof = None
    from contextlib import ExitStack

    with ExitStack() as stack:
        logins = {r: stack.enter_context(common.temp_login(r, f"qlpg_bench_st_{s}", conninfo=admin))
                  for r, s in ROLES.items()}
        for shape in a.shapes.split(","):
            tmpl_ci = stack.enter_context(common.scratch_database(f"qlpg_bench_st_{shape}", conninfo=admin))
            steps, warm = prepare_template(tmpl_ci, logins, shape, a.steps, a.warm)
            tmpl = psycopg.conninfo.conninfo_to_dict(tmpl_ci)["dbname"]
            common.log(f"template {tmpl}: {steps} {shape} steps after {warm} warm-up steps")
            if a.profile and shape == "single" and prof is None:
                name = f"{tmpl}_prof"
                prof = profile(clone(admin_pg, tmpl, name), logins, min(steps, 500))
                drop(admin_pg, name)
                common.log(f"profile: {prof['steps_per_s']:.0f} steps/s serial; client ms {prof['client_ms']}")
            for mode in a.modes.split(","):
                if mode == "floor" and shape != a.shapes.split(",")[0]:
                    continue  # the floor does not depend on the Workflow's shape: once per run
                for w in workers:
                    name = f"{tmpl}_{mode[0]}{w}"
                    ci = clone(admin_pg, tmpl, name)
                    try:
                        nrt = max(1, w // 2) if a.runtimes == "auto" else int(a.runtimes)
                        r = measure(ci, logins, mode, w, steps, a.batch, warm, nrt)
                    finally:
                        drop(admin_pg, name)
                    r.update(shape="-" if mode == "floor" else shape, mode=mode, workers=w, steps=steps)
                    rows.append(r)
                    common.log(f"{shape} {mode} w={w}: {r['steps_per_s']:.0f} steps/s, "
                               f"{r['commits_per_step']:.2f} commits/step, {r['calls_per_step']:.2f} calls/step, "
                               f"CPU ms/step server {r['server_cpu_ms']:.2f} client {r['client_cpu_ms']:.2f}")
                    if mode == "floor":
                        common.peer_emit(system="qlpg (this project)", version="0.1.0", driver="psycopg 3 (qlpg.db.call)",
                                         measurement="floor: 4 one-row INSERT commits per step, no ql3 call",
                                         concurrency=f"{w} worker procs", runs=[r["steps_per_s"]], n=steps,
                                         notes="the client stack's ceiling for any 4-commit step on this server")
                        continue
                    common.peer_emit(system="qlpg (this project)", version="0.1.0", driver="psycopg 3 (qlpg.api)",
                                     measurement=f"step cycle admit->lease->start->running->complete, {mode}, "
                                                 f"{'1-step' if shape == 'single' else '33-step fan-out'} Workflows",
                                     concurrency=f"{w} worker procs + "
                                                 + (f"{nrt} partitioned runtimes" if mode == "unbatched" and nrt > 1
                                                    else "1 runtime"),
                                     runs=[r["steps_per_s"]], n=steps,
                                     notes=f"{r['commits_per_step']:.2f} commits/step (xact_commit delta), no-op steps")
    pg = common.pgbench_insert(workers, a.seconds_pgbench, conninfo=admin) if a.seconds_pgbench > 0 else {}
    for c, tps in pg.items():
        common.log(f"pgbench insert c={c}: {tps:.0f} tps")
    cmd = "python bench/steps.py " + " ".join(sys.argv[1:])
    text = render(info, cmd.strip(), pg, rows, prof, time.perf_counter() - t_start, a.warm,
                  a.runtimes if a.runtimes != "auto" else "max(1, workers / 2)")
    print(text)
    if not a.no_write:
        common.emit_markdown_section(a.output, "Step cycle", text)


if __name__ == "__main__":
    main()
