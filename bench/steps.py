#!/usr/bin/env python3
"""Step cycle throughput: admit -> lease -> start -> running -> complete (+ frontier), in steps/s,
with 1, 4 and 8 workers on single-step and 32-wide fan-out Workflows; unbatched and batched;
beside pgbench's one-row INSERT on the same server in the same run. Results go to
docs/benchmarks.md "## Step cycle" and, under /work/shared/peers/run.sh (``PEER_EXTRA``), as JSON
lines into ``$PEER_RESULTS``.

What one step costs (every call a real ``ql3`` function through :mod:`qlpg.api`, each its own
short transaction at the shell's default isolation, SERIALIZABLE):

* unbatched: the runtime (one :class:`qlpg.runtime.Runtime` process, ``batch=False``) pages
  candidates (1 call per 64) and admits each epoch with ``task_attempt_admit``; each worker
  process loops ``lease_acquire_start`` (1 attempt: lease + start barrier) -> ``attempt_running``
  -> ``attempt_complete`` (which advances the frontier and aggregates the Run): 4 commits per step.
* batched: the runtime admits whole candidate pages with ``task_attempt_admit_page`` (<= 64 per
  transaction); each worker leases and starts up to 32 attempts per ``lease_acquire_start`` and
  reports them with ``attempt_running_batch`` and ``attempt_complete_batch``.

Jobs are no-ops, as in the peer comparison: workers make the calls but spawn no process (a real
``qlpg worker`` adds the fork/exec of the task and its log files per step). Workflows: ``single``
(1 step per Run) and ``fan32`` (root -> 32 parallel steps: 33 per Run; completing the root makes 32
steps ready in the same transaction). The Runs are admitted before the clock starts (like the
peers' pre-enqueued jobs); the clock runs from "go" until a poller (every 20 ms) sees every Run
terminal. Commits per step = the database's ``xact_commit`` delta over that window / steps (it
includes idle polling and the poller itself); "calls/step" counts only the productive calls (each
one transaction), "idle polls/step" the empty ``lease_acquire_start``/candidate reads (idle
workers back off from 1 to 50 ms).

Usage: ``python bench/steps.py [--steps 2000] [--workers 1,4,8] [--seconds-pgbench 10]
[--modes unbatched,batched] [--shapes single,fan32] [--profile] [--no-write] [--dsn CONNINFO]``.
Under run.sh: ``PEER_EXTRA='cd /work/main && .venv/bin/python bench/steps.py --no-write'``.
"""

from __future__ import annotations

import argparse
import json
import os
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
def child_worker(conninfo: str, worker_id: str, mode: str, batch: int) -> None:
    conn = db.connect(conninfo, application_name=f"bench-{worker_id}")
    api.readiness(conn)  # warm the connection
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("READY", flush=True)
    sys.stdin.readline()
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
    print(json.dumps({"steps": steps, "calls": calls, "polls": polls}), flush=True)


def child_runtime(conninfo: str, mode: str) -> None:
    from qlpg.runtime import PassStats, Runtime

    rt = Runtime(conninfo, batch=(mode == "batched"), recovery=False)
    api.readiness(rt._connection())
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("READY", flush=True)
    sys.stdin.readline()
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
    print(json.dumps({"admitted": total.admitted, "calls": calls, "polls": polls}), flush=True)


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


def measure(db_ci: str, logins: dict[str, str], mode: str, workers: int, steps_total: int, batch: int) -> dict:
    su = psycopg.connect(db_ci, autocommit=True)
    rt = spawn(["--child", "runtime", common.with_user(db_ci, logins["ql3_runtime"]), mode])
    ws = [spawn(["--child", "worker", common.with_user(db_ci, logins["ql3_worker_ingress"]), f"bw{i}", mode, str(batch)])
          for i in range(workers)]
    su.execute("SELECT pg_stat_clear_snapshot()")
    c0 = xact_commit(su)
    t0 = time.perf_counter()
    for p in [rt, *ws]:
        p.stdin.write("go\n")
        p.stdin.flush()
    deadline = t0 + 600
    try:
        while True:
            if not su.execute("SELECT EXISTS (SELECT 1 FROM ql3.runs WHERE status = 'running')").fetchone()[0]:
                break
            if time.perf_counter() > deadline:
                raise TimeoutError("steps did not finish in 600 s")
            dead = [p for p in (rt, *ws) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a benchmark process exited early (rc {dead[0].returncode})")
            time.sleep(0.02)
    except BaseException:
        for p in (rt, *ws):
            p.kill()
        raise
    elapsed = time.perf_counter() - t0
    outs = []
    for p in [rt, *ws]:
        p.send_signal(signal.SIGTERM)
    for p in [rt, *ws]:
        out, _ = p.communicate(timeout=30)
        outs.append(json.loads(out.strip().splitlines()[-1]))
    time.sleep(0.6)  # let the backends' statistics arrive
    su.execute("SELECT pg_stat_clear_snapshot()")
    commits = xact_commit(su) - c0
    done = su.execute("SELECT count(*) FROM ql3.run_attempts WHERE status = 'succeeded'").fetchone()[0]
    bad = su.execute("SELECT count(*) FROM ql3.runs WHERE status <> 'succeeded'").fetchone()[0]
    su.close()
    assert done == steps_total and bad == 0, (done, steps_total, bad)
    calls = sum(o["calls"] for o in outs)
    polls = sum(o["polls"] for o in outs)
    return {"steps_per_s": steps_total / elapsed, "elapsed_s": elapsed, "commits_per_step": commits / steps_total,
            "calls_per_step": calls / steps_total, "polls_per_step": polls / steps_total}


def clone(admin_ci: str, template: str, name: str) -> str:
    with psycopg.connect(admin_ci, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return psycopg.conninfo.make_conninfo(admin_ci, dbname=name)


def drop(admin_ci: str, name: str) -> None:
    with psycopg.connect(admin_ci, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def prepare_template(db_ci: str, logins: dict[str, str], shape: str, steps: int) -> int:
    """Install the package and admit the Runs of ``shape``; returns the number of steps."""
    with tempfile.TemporaryDirectory() as d:
        pkg = write_package(Path(d))
        with db.connect(common.with_user(db_ci, logins["ql3_package_manager"])) as pm:
            install.install_package(pm, pkg)
        runs = max(1, steps // SHAPES[shape])
        with db.connect(common.with_user(db_ci, logins["ql3_package_executor"])) as pe:
            plan, _ = install.prepare_plan(pe, "default", "stepbench", shape)
            for _ in range(runs):
                install.start_workflow(pe, "default", "stepbench", shape)
    with psycopg.connect(db_ci, autocommit=True) as c:
        c.execute("VACUUM ANALYZE")
        c.execute("CHECKPOINT")
    return runs * SHAPES[shape]


def profile(db_ci: str, logins: dict[str, str], n: int) -> dict:
    """One connection per role, serial cycles (unbatched): client latency per call and the server's
    own time per function (track_functions = all for this database)."""
    su = psycopg.connect(db_ci, autocommit=True)
    dbname = su.info.dbname
    su.execute(f'ALTER DATABASE "{dbname}" SET track_functions = \'all\'')
    su.execute("SELECT pg_stat_reset()")
    from qlpg.runtime import PassStats, Runtime

    rt = Runtime(common.with_user(db_ci, logins["ql3_runtime"]), recovery=False)
    wk = db.connect(common.with_user(db_ci, logins["ql3_worker_ingress"]))
    lat: dict[str, list[float]] = {k: [] for k in ("admit", "lease_acquire_start", "attempt_running", "attempt_complete")}
    done = 0
    t_all = time.perf_counter()
    while done < n:
        t = time.perf_counter()
        stats = PassStats()
        rt.admit_page(None, stats)
        if stats.admitted:
            lat["admit"].append((time.perf_counter() - t) / stats.admitted)
        while True:
            t = time.perf_counter()
            ls = api.lease_acquire_start(wk, "prof", "local_process", 1, LEASE_MS)
            if not ls:
                break
            lat["lease_acquire_start"].append(time.perf_counter() - t)
            (l,) = ls
            t = time.perf_counter()
            api.attempt_running(wk, l.attempt_id, l.lease_token)
            lat["attempt_running"].append(time.perf_counter() - t)
            t = time.perf_counter()
            api.attempt_complete(wk, l.attempt_id, l.lease_token, "succeeded", 0)
            lat["attempt_complete"].append(time.perf_counter() - t)
            done += 1
        if not stats.admitted and not ls:
            break
    elapsed = time.perf_counter() - t_all
    rt.close()
    wk.close()
    time.sleep(0.8)
    su.execute("SELECT pg_stat_clear_snapshot()")
    funcs = su.execute("SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions"
                       " WHERE schemaname = 'ql3' ORDER BY self_time DESC").fetchall()
    su.execute(f'ALTER DATABASE "{dbname}" RESET track_functions')
    su.close()
    return {"steps": done, "steps_per_s": done / elapsed,
            "client_ms": {k: 1000 * statistics.median(v) for k, v in lat.items() if v},
            "functions": [(f, c, t / done, s / done) for f, c, t, s in funcs]}


def render(info: dict, cmd: str, pg: dict[int, float], rows: list[dict], prof: dict | None, secs: float) -> str:
    s = info["settings"]
    out = [f"Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (`{cmd}`), {secs:.0f} s in all; single runs, "
           "read each figure as ±20 % (other work shared the box: load average "
           f"{info['load_avg'][0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; pgbench runs last, "
           "after the qlpg cells, so a box that got quieter meanwhile favours it).", "",
           f"Machine: {info['cpus']} cores, {info['mem_gib']} GiB; PostgreSQL {info['server_version']}: "
           + ", ".join(f"{k}={v}" for k, v in s.items()) + f". Python {info['python']}, psycopg {info['psycopg']}, "
           "unix socket; the server, the runtime process, the worker processes and the poller share the cores.", "",
           "| workflow | path | workers | steps | steps/s | commits/step | calls/step | idle polls/step | pgbench INSERT tps (same clients) | ratio |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = pg.get(r["workers"])
        ptxt = f"{p:,.0f}" if p else "-"
        ratio = f"{r['steps_per_s'] / p:.2f}" if p else "-"
        out.append(f"| {r['shape']} | {r['mode']} | {r['workers']} | {r['steps']} | {r['steps_per_s']:,.0f} | "
                   f"{r['commits_per_step']:.2f} | {r['calls_per_step']:.2f} | {r['polls_per_step']:.2f} | {ptxt} | {ratio} |")
    out += ["", "Same run beside the peer queues (`/work/shared/peers/run.sh`, rows into `$PEER_RESULTS` and its "
            "table): `PEER_EXTRA='cd /work/main && .venv/bin/python bench/steps.py --no-write' bash "
            "/work/shared/peers/run.sh` (a quick check: `PEER_ONLY=pgbench PEER_N=5000 PEER_PGBENCH_T=5 PEER_RUNS=1 "
            "PEER_OUT=/tmp/peer-out` and `--steps 300 --workers 1,8` in `PEER_EXTRA`).", "",
            "Reading it:", "",
            "* **Commits per step.** The productive calls are 4.0 per step unbatched (admission, lease+start, "
            "running, completion: 4 commits) and 3 per batch of up to 64 admissions / 32 leases when batched; the "
            "measured `xact_commit` delta also counts idle polls (workers waiting for the runtime's admissions, "
            "the fan-out waiting for its root) and the poller.",
            "* **Where the time goes.** The work is server CPU inside the authority, not round trips or fsync "
            "(the profile below: a few ms of PL/pgSQL per step against ~0.1 ms for a pgbench INSERT). A single-step "
            "Run writes about 35 rows per step: 7 RunEvents and 7 versions of its Run row (one per event: admitted, "
            "starting, attempt running, step running, attempt and step terminal, Run terminal), the ledger row and "
            "the RunAttempt (plus 4 updates of it), the lease (insert + end), the completion receipt, 3 StepRun "
            "versions and their 2 mutations, each with its index and foreign-key maintenance; every call also runs "
            "its role check, advisory locks, lease fence (SHA-256 of the token) and receipt digest. With the server, "
            "the runtime, the workers and the poller on the same 2 cores, that bounds the step cycle at a few hundred "
            "steps/s; more workers only add contention.",
            "* **Targets.** At most 4 commits per step: met by the productive calls (4.0 unbatched, < 0.2 batched). "
            "Unbatched ≥ 0.25× pgbench's INSERT tps (≈ 3.7k steps/s at 8 clients): **missed by more than an order "
            "of magnitude**; the batched path is far below graphile-worker's 18,452 jobs/s batched drain (a no-op "
            "job there is one row in and out). Closing the gap needs fewer writes per step, not fewer round trips: "
            "one Run row update per transaction instead of one per event (reserve a block of event sequences), no "
            "foreign-key checks on the append-only child tables (their parents are immutable or locked already), "
            "the canonical JSON/SHA-256 helpers in C, fewer audit rows per step (e.g. one event for attempt+StepRun "
            "transitions: a change of the DESIGN §4 audit contract), and cores that the clients do not share."]
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
    ap.add_argument("--modes", default="unbatched,batched")
    ap.add_argument("--shapes", default="single,fan32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seconds-pgbench", type=int, default=int(os.environ.get("PEER_PGBENCH_T", "10")))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--output", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--dsn")
    a = ap.parse_args()
    if a.child:
        if a.child[0] == "worker":
            child_worker(a.child[1], a.child[2], a.child[3], int(a.child[4]))
        else:
            child_runtime(a.child[1], a.child[2])
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
            steps = prepare_template(tmpl_ci, logins, shape, a.steps)
            tmpl = psycopg.conninfo.conninfo_to_dict(tmpl_ci)["dbname"]
            common.log(f"template {tmpl}: {steps} {shape} steps")
            if a.profile and shape == "single" and prof is None:
                name = f"{tmpl}_prof"
                prof = profile(clone(admin_pg, tmpl, name), logins, min(steps, 500))
                drop(admin_pg, name)
                common.log(f"profile: {prof['steps_per_s']:.0f} steps/s serial; client ms {prof['client_ms']}")
            for mode in a.modes.split(","):
                for w in workers:
                    name = f"{tmpl}_{mode[0]}{w}"
                    ci = clone(admin_pg, tmpl, name)
                    try:
                        r = measure(ci, logins, mode, w, steps, a.batch)
                    finally:
                        drop(admin_pg, name)
                    r.update(shape=shape, mode=mode, workers=w, steps=steps)
                    rows.append(r)
                    common.log(f"{shape} {mode} w={w}: {r['steps_per_s']:.0f} steps/s, "
                               f"{r['commits_per_step']:.2f} commits/step, {r['calls_per_step']:.2f} calls/step")
                    common.peer_emit(system="qlpg (this project)", version="0.1.0", driver="psycopg 3 (qlpg.api)",
                                     measurement=f"step cycle admit->lease->start->running->complete, {mode}, "
                                                 f"{'1-step' if shape == 'single' else '33-step fan-out'} Workflows",
                                     concurrency=f"{w} worker procs + 1 runtime", runs=[r["steps_per_s"]], n=steps,
                                     notes=f"{r['commits_per_step']:.2f} commits/step (xact_commit delta), no-op steps")
    pg = common.pgbench_insert(workers, a.seconds_pgbench, conninfo=admin) if a.seconds_pgbench > 0 else {}
    for c, tps in pg.items():
        common.log(f"pgbench insert c={c}: {tps:.0f} tps")
    cmd = "python bench/steps.py " + " ".join(sys.argv[1:])
    text = render(info, cmd.strip(), pg, rows, prof, time.perf_counter() - t_start)
    print(text)
    if not a.no_write:
        common.emit_markdown_section(a.output, "Step cycle", text)


if __name__ == "__main__":
    main()
