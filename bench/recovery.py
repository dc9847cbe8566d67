#!/usr/bin/env python3
"""Recovery throughput: resolve N expired dispatch leases with 1 and 4 recovery loops, beside
pgbench TPC-B on the same server in the same run; results go to docs/benchmarks.md "## Recovery".

What is measured (ADR-0227 §6): N claimed attempts whose workers leased them and died before the
start barrier (the mass-failure case: a worker fleet vanishes holding leases). Each recovery loop
is a :class:`qlpg.runtime.Runtime` (``recover`` only) logged in as a ``ql3_runtime`` login: it
claims pages of 64 controls (``ql3.recovery_claim``) and resolves each one in its own short
SERIALIZABLE transaction (``ql3.recovery_resolve``: Run/attempt/recovery locks, admission receipt
and StepRun digest re-check, attempt lost, lease released, StepRun ready -> ready, one event per
change). The clock runs from the first claim until every lease is resolved; items/s = N / time.

Setup (not timed): a scratch database is migrated; a package with one 125-step workflow is
installed and N/125 Runs are admitted; every ready epoch is admitted as an attempt (as the
superuser, in pages of 64 per statement, for speed) and the database is kept as a template. For
each loop count a fresh copy is made from that template; the worker login leases all N attempts
with lease_ms = 1000 (64 per call) and the script waits until database time is past the last
expiry. pgbench: ``pgbench -i -s 10`` in its own scratch database, then ``-c C -j min(C, 2) -T T -n``.

Usage: ``python bench/recovery.py [--items 10000] [--loops 1,4] [--pgbench-seconds 10]
[--dsn SUPERUSER_CONNINFO] [--output docs/benchmarks.md]``. The superuser connection defaults to
libpq's environment (PGHOST/PGPORT/PGUSER). Scratch databases and logins are removed at exit.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pyshell"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg  # noqa: E402
from psycopg.rows import dict_row  # noqa: E402

from qlpg import api, install  # noqa: E402
from qlpg.runtime import PassStats, Runtime  # noqa: E402

STEPS_PER_RUN = 125          # <= 128 steps per workflow (DESIGN §6)
ADMIT_THREADS = 2           # template setup only
ROLES = ("ql3_package_manager", "ql3_package_executor", "ql3_runtime", "ql3_worker_ingress")


def log(msg: str) -> None:
    print(f"[recovery-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ shared helpers (bench/common.py)
import common  # noqa: E402  (bench/common.py: pgbench, scratch databases, logins, the docs section)


def _conninfo(base: str, **kw) -> str:
    return psycopg.conninfo.make_conninfo(base, **kw)


@contextmanager
def database_copy(base: str, template_ci: str):
    """A fresh copy (CREATE DATABASE ... TEMPLATE) of the database of ``template_ci``; dropped on exit."""
    tmpl = psycopg.conninfo.conninfo_to_dict(template_ci)["dbname"]
    name = f"{tmpl}_c{os.getpid() % 1000}_{int(time.time() * 1000) % 100000}"
    admin = _conninfo(base, dbname="postgres")
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}" TEMPLATE "{tmpl}"')
    try:
        yield _conninfo(template_ci, dbname=name)
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class CallTimer:
    """Wraps an ``api`` function to record each call's wall time (ms), thread-safely."""

    def __init__(self, fn):
        self.fn, self.ms, self.lock = fn, [], threading.Lock()
        functools.update_wrapper(self, fn)

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            with self.lock:
                self.ms.append((time.perf_counter() - t) * 1000)

    def pct(self, q: float) -> float:
        xs = sorted(self.ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# ------------------------------------------------------------------ setup
def write_package(root: Path) -> Path:
    d = root / "recovery-bench"
    d.mkdir(parents=True, exist_ok=True)
    doc = {"package": "recovery-bench", "version": "1.0.0", "publisher": "qlpg-bench",
           "tasks": {"noop": {"command": ["true"], "timeout_ms": 60000}},
           "workflows": {"wide": {"steps": {f"s{i:03d}": {"task": "noop"} for i in range(STEPS_PER_RUN)}}}}
    (d / "qinglong-package.yaml").write_text(json.dumps(doc, indent=1))
    return d


def build_template(ci: str, logins: dict[str, str], runs: int, tmp: Path) -> None:
    t0 = time.monotonic()
    pkg = write_package(tmp)
    with psycopg.connect(_conninfo(ci, user=logins["ql3_package_manager"]), autocommit=True, row_factory=dict_row) as pm:
        install.install_package(pm, pkg)
    with psycopg.connect(_conninfo(ci, user=logins["ql3_package_executor"]), autocommit=True, row_factory=dict_row) as pe:
        for i in range(runs):
            install.start_workflow(pe, "default", "recovery-bench", "wide", f"bench-{i:04d}")
    log(f"template: {runs} runs admitted in {time.monotonic() - t0:.1f}s")
    t1 = time.monotonic()
    admitted = 0
    if hasattr(api, "task_attempt_admit_page"):  # batched admission: one transaction per page of 64
        # ADMIT_THREADS connections, each over its own slice of Runs (keyset cursor from the slice start)
        with psycopg.connect(ci, autocommit=True) as su:
            firsts = [f"bench-{i:04d}" for i in range(0, runs, -(-runs // ADMIT_THREADS))]
            starts = [None] + [tuple(su.execute(
                "SELECT run_id, max(id) FROM ql3.step_runs WHERE run_id = (SELECT max(id) FROM ql3.runs WHERE id < %s)"
                " GROUP BY run_id", (f,)).fetchone()) for f in firsts[1:]]
        ends = firsts[1:] + [None]
        counts = [0] * len(starts)

        def admit_slice(k: int) -> None:
            with psycopg.connect(_conninfo(ci, user=logins["ql3_runtime"]), autocommit=True, row_factory=dict_row) as rt:
                after = starts[k]
                while True:
                    page = api.task_attempt_admit_page(rt, after, 64)
                    counts[k] += sum(r["outcome"] == "admitted" for r in page)
                    if len(page) < 64 or (ends[k] is not None and page[-1]["run_id"] >= ends[k]):
                        return
                    after = (page[-1]["run_id"], page[-1]["step_run_id"])

        ts = [threading.Thread(target=admit_slice, args=(k,)) for k in range(len(starts))]
        [t.start() for t in ts]
        [t.join() for t in ts]
        admitted += sum(counts)
    with psycopg.connect(ci, autocommit=True) as su:
        while True:  # one by one (also whatever a page skipped), 64 per statement
            n = su.execute(
                "SELECT count(*) FROM (SELECT ql3.task_attempt_admit(c.run_id, c.step_run_id, c.step_run_version,"
                " c.step_run_digest, ql3.task_attempt_snapshot(c.run_id, c.step_run_id, c.step_run_version)"
                " -> 'execution_revision') FROM ql3.task_attempt_candidates(NULL, NULL, 64) c) x").fetchone()[0]
            admitted += n
            if n == 0:
                break
        su.execute("VACUUM ANALYZE")
    log(f"template: {admitted} attempts admitted in {time.monotonic() - t1:.1f}s")


def lease_everything(ci: str, logins: dict[str, str]) -> int:
    """The worker login leases every claimed attempt (lease_ms 1000) and is never heard of again."""
    n = 0
    with psycopg.connect(_conninfo(ci, user=logins["ql3_worker_ingress"]), autocommit=True, row_factory=dict_row) as wk:
        while True:
            got = api.lease_acquire(wk, "bench-dead-worker", "local_process", 64, 1000)
            n += len(got)
            if not got:
                return n


def wait_all_expired(ci: str) -> None:
    with psycopg.connect(ci, autocommit=True) as su:
        while True:
            left = su.execute("SELECT max(lease_expires_at_ms) - (extract(epoch FROM clock_timestamp()) * 1000)::bigint"
                              " FROM ql3.run_attempts WHERE lease_active").fetchone()[0]
            if left is None or left < 0:
                return
            time.sleep(left / 1000 + 0.01)


def recover_all(ci: str, logins: dict[str, str], loops: int, expected: int) -> dict:
    rt_ci = _conninfo(ci, user=logins["ql3_runtime"])
    runtimes = [Runtime(rt_ci, page_size=64, claimer_id=f"bench-loop-{i}", claim_ms=60000) for i in range(loops)]
    for r in runtimes:  # open and warm the connections before the clock starts
        api.readiness(r._connection())
    totals = [PassStats() for _ in runtimes]
    errors: list[BaseException] = []
    timers = {"claim": CallTimer(api.recovery_claim), "resolve": CallTimer(api.recovery_resolve)}
    saved = (api.recovery_claim, api.recovery_resolve)
    api.recovery_claim, api.recovery_resolve = timers["claim"], timers["resolve"]
    go = threading.Barrier(loops + 1)

    def loop(rt: Runtime, total: PassStats) -> None:
        try:
            go.wait()
            idle = 0
            while idle < 2:
                s = PassStats()
                rt.recover(s)
                n = s.recovered + s.recovery_retry + s.recovery_manual + s.recovery_no_action + s.recovery_stale
                for f in ("recovered", "recovery_retry", "recovery_manual", "recovery_no_action", "recovery_stale"):
                    setattr(total, f, getattr(total, f) + getattr(s, f))
                idle = idle + 1 if n == 0 else 0
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(r, t)) for r, t in zip(runtimes, totals)]
    [t.start() for t in threads]
    go.wait()
    t0 = time.monotonic()
    [t.join() for t in threads]
    elapsed = time.monotonic() - t0
    api.recovery_claim, api.recovery_resolve = saved
    for r in runtimes:
        r.close()
    if errors:
        raise errors[0]
    with psycopg.connect(ci, autocommit=True, row_factory=dict_row) as su:
        chk = su.execute(
            "SELECT (SELECT count(*) FROM ql3.run_recovery_controls WHERE status = 'resolved'"
            "          AND resolution = 'lost_before_start') AS resolved,"
            "       (SELECT count(*) FROM ql3.run_attempts WHERE status = 'lost') AS lost,"
            "       (SELECT count(*) FROM ql3.run_attempts WHERE lease_active) AS still_leased,"
            "       (SELECT count(*) FROM ql3.step_runs WHERE status = 'ready' AND NOT epoch_admitted) AS new_epochs").fetchone()
    if not (chk["resolved"] == chk["lost"] == chk["new_epochs"] == expected and chk["still_leased"] == 0):
        raise SystemExit(f"recovery with {loops} loop(s) did not converge: {chk} (expected {expected})")
    return {"loops": loops, "items": expected, "seconds": elapsed, "per_s": expected / elapsed,
            "stale": sum(t.recovery_stale for t in totals),
            "resolve_p50": timers["resolve"].pct(0.5), "resolve_p99": timers["resolve"].pct(0.99),
            "claim_p50": timers["claim"].pct(0.5), "claims": len(timers["claim"].ms)}


# ------------------------------------------------------------------ main
def render(results: list[dict], tpcb: dict[int, float], ins: dict[int, float], info: dict, args, wall: float,
           setup_s: float) -> str:
    st = info["settings"]
    load = " / ".join(f"{x:.1f}" for x in info["load_avg"]) if info.get("load_avg") else "?"
    lines = [
        f"Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (`python bench/recovery.py --items "
        f"{args.items} --loops {','.join(map(str, args.loops))} --pgbench-seconds {args.pgbench_seconds}`), "
        f"{wall:.0f} s in all, of which {setup_s:.0f} s untimed setup. Single runs: read each figure as ±20 %.",
        "",
        f"Machine: {info['cpus']} cores, {info['mem_gib']} GiB RAM, Linux {info['kernel']}; the database server "
        f"and all client processes share the cores (load average {load} at the start: other work was running "
        f"on the box). PostgreSQL {info['server_version']}: "
        + ", ".join(f"{k}={st[k]}" for k in ("shared_buffers", "synchronous_commit", "fsync", "wal_sync_method",
                                             "max_connections") if k in st)
        + f". Clients: Python {info['python']}, psycopg {info['psycopg']}, over the unix socket; recovery loops "
        "are threads of one process, one connection each, as a `ql3_runtime` login.",
        "",
        "| measurement | 1 | 4 | what one item costs |",
        "|---|---:|---:|---|",
    ]
    by = {r["loops"]: r for r in results}

    def cell(n: int) -> str:
        r = by.get(n)
        if not r:
            return "–"
        return (f"**{r['per_s']:,.0f} items/s**<br>{r['items']:,} in {r['seconds']:.1f} s<br>"
                f"resolve p50 {r['resolve_p50']:.1f} / p99 {r['resolve_p99']:.1f} ms")

    lines.append(f"| resolve {args.items:,} expired leases, N recovery loops | {cell(1)} | {cell(4)} | "
                 "one `recovery_resolve` transaction (SERIALIZABLE, one commit) per item, plus one "
                 "`recovery_claim` (READ COMMITTED) per 64 |")
    def tps(d: dict, n: int) -> str:
        return f"{d[n]:,.0f}" if n in d else "–"

    lines.append(f"| pgbench TPC-B, N clients (tps) | {tps(tpcb, 1)} | {tps(tpcb, 4)} | "
                 f"`-s 10 -T {args.pgbench_seconds} -n -j min(N,2)`: 5 statements + 1 commit |")
    if ins:
        lines.append(f"| pgbench 1-row INSERT, N clients (tps) | {tps(ins, 1)} | {tps(ins, 4)} | "
                     "autocommit `-f insert.sql`: the commit-rate ceiling |")
    lines += [
        "",
        "How it measures: every item is a `claimed` attempt whose worker leased it (`lease_ms` 1000) and "
        "vanished before the start barrier, the mass-failure case (a worker fleet dies holding its leases). "
        "A recovery loop is `qlpg.runtime.Runtime.recover`: `ql3.recovery_claim` records controls for expired "
        "leases and claims up to 64 (`FOR UPDATE SKIP LOCKED`, so loops take disjoint pages), then one "
        "`ql3.recovery_resolve` per item: Run → attempt → recovery advisory locks; claim token, admission "
        "receipt and StepRun digest re-checked; attempt `lost`, lease released, StepRun `ready → ready` with "
        "a new version and digest (a new epoch, admissible again), one attempt event, one StepRun event and "
        "one mutation. The clock runs from a common start until every loop finds nothing left; afterwards "
        "the script checks that exactly N controls are resolved `lost_before_start`, N attempts are `lost`, "
        "N new epochs are admissible and no lease is live. p50/p99 are client-side per-call latencies.",
        "",
        f"Setup (not timed): {args.items // STEPS_PER_RUN} Runs of a {STEPS_PER_RUN}-step workflow are admitted "
        "and every ready epoch is admitted as an attempt in a migrated template database; each loop count "
        "gets a fresh copy of it, in which a worker login leases all N attempts (64 per call) and abandons "
        "them, and the script waits until database time is past the last expiry. pgbench runs in its own "
        "scratch database in the same invocation, before the recovery phases.",
        "",
        "Reading it:",
        "",
        "* Each resolution is one durable commit, like one pgbench INSERT, plus the authority's work: three "
        "advisory locks, the admission-receipt and StepRun-digest re-check (RFC 8785 canonical JSON and "
        "SHA-256 in plpgsql), four row updates, two event inserts with a Run version bump each, one mutation "
        "insert, and the SERIALIZABLE round trips of the Python shell (BEGIN, the call, COMMIT). TPC-B is "
        "the yardstick of a small OLTP transaction with one commit on the same box at the same time.",
        "* Several loops help mostly by sharing commit flushes (group commit); with 2 cores the loops, the "
        "server and everything else on the box compete for the same CPU. Two loops resolving attempts of the "
        "same Run serialize on its advisory lock; under SERIALIZABLE the second then retries "
        "(40001, jittered backoff), which is included in the figures.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=10000)
    p.add_argument("--loops", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--pgbench-seconds", type=int, default=10)
    p.add_argument("--pgbench-clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--insert", action="store_true", help="also run the pgbench 1-row INSERT ceiling")
    p.add_argument("--dsn", default=None, help="superuser/deployer conninfo (default: $DATABASE_URL, libpq env)")
    p.add_argument("--output", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = p.parse_args(argv)
    if args.items % STEPS_PER_RUN:
        p.error(f"--items must be a multiple of {STEPS_PER_RUN}")
    wall0 = time.monotonic()
    base = common.server_conninfo(args.dsn)
    info = common.server_info(base)
    tpcb = common.pgbench_tpcb(args.pgbench_clients, args.pgbench_seconds, conninfo=base)
    ins = {} if not args.insert else common.pgbench_insert(args.pgbench_clients, args.pgbench_seconds, conninfo=base)
    results: list[dict] = []
    setup_s = 0.0
    with ExitStack() as stack:
        logins = {r: stack.enter_context(common.temp_login(r, "qlpg_bench_rec", conninfo=base)) for r in ROLES}
        s0 = time.monotonic()
        tmpl = stack.enter_context(common.scratch_database("qlpg_bench_rec", conninfo=base))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        build_template(tmpl, logins, args.items // STEPS_PER_RUN, tmp)
        setup_s += time.monotonic() - s0
        for loops in args.loops:
            s1 = time.monotonic()
            with database_copy(base, tmpl) as ci:
                n = lease_everything(ci, logins)
                if n != args.items:
                    raise SystemExit(f"leased {n} attempts, expected {args.items}")
                wait_all_expired(ci)
                with psycopg.connect(ci, autocommit=True) as su:
                    su.execute("CHECKPOINT")
                setup_s += time.monotonic() - s1
                res = recover_all(ci, logins, loops, args.items)
                results.append(res)
                common.log(f"{loops} recovery loop(s): {res['items']} resolved in {res['seconds']:.1f}s = "
                           f"{res['per_s']:.0f}/s (resolve p50 {res['resolve_p50']:.1f} ms, p99 "
                           f"{res['resolve_p99']:.1f} ms, {res['stale']} stale claims)")
    text = render(results, tpcb, ins, info, args, time.monotonic() - wall0, setup_s)
    if args.no_write:
        print(text)
    else:
        common.emit_markdown_section(Path(args.output), "Recovery", text)
        common.log(f"wrote the Recovery section of {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
