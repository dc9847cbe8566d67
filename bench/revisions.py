#!/usr/bin/env python3
"""Task Execution Revisions throughput (ADR-0023): inserts/s and resolves/s with 1, 4 and 8
clients, beside pgbench TPC-B (and pgbench's single-row INSERT ceiling) on the same server in the
same run. Results go to docs/benchmarks.md, section "## Task Execution Revisions".

What is measured. Each client is its own OS process with its own connection, logged in as a
throwaway ``ql3_admin`` login; all clients of a cell start together (barrier) and run for
``--seconds``; rate = all completed calls / elapsed. Per cell four operations, in this order:

* ``insert api``  -- :func:`qlpg.api.task_revision_insert` of a new identity: Python ExecutionSpec
  check and digest, then one SERIALIZABLE transaction ``SELECT * FROM ql3.task_revision_insert(...)``
  (role check, id checks, normalise, canonical JSON, SHA-256, advisory lock, insert), and the
  returned digest compared with Python's;
* ``insert sql``  -- the same SQL call as a plain autocommit statement (READ COMMITTED), no Python checks;
* ``resolve api`` -- :func:`qlpg.api.task_revision_resolve` of a random existing identity:
  READ COMMITTED statement, fail-closed verification in SQL (re-normalise, re-canonicalise,
  recompute the digest) and again in Python, result deeply frozen;
* ``resolve sql`` -- the same SQL call as a plain autocommit statement.

Templates are realistic (4-element argv, working directory, timeout, 3 env names, one resource
bound). The database is a fresh ``qlpg migrate``-d scratch database; pgbench uses its own scratch
database (``pgbench -i -s 10``, then ``-c C -j min(C,2) -T T -n``), see bench/common.py.

Usage::

    .venv/bin/python bench/revisions.py                       # full run (~2.5 min), writes docs/benchmarks.md
    .venv/bin/python bench/revisions.py --seconds 2 --pgbench-seconds 3 --no-docs   # quick look
    PEER_EXTRA='/work/main/.venv/bin/python /work/main/bench/revisions.py' bash /work/shared/peers/run.sh

With ``$PEER_RESULTS`` set (the peers' ``PEER_EXTRA`` hook) every cell is appended there as one
JSON line in the peers' format, pgbench is skipped (the peer run measures it itself; ``--pgbench``
forces it) and docs/benchmarks.md is not touched unless ``--docs`` is given. The connection
(superuser or a login with CREATEDB and CREATEROLE) is ``--dsn``, else ``$DATABASE_URL``, else
``PEER_PG*``, else libpq's ``PG*`` environment. Scratch databases and logins are removed at exit.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402

ROOT = common.ROOT
PROJECT = "bench"
SECTION = "Task Execution Revisions"
OPS = ("insert api", "insert sql", "resolve api", "resolve sql")


def template(n: int) -> dict:
    return {"command": ["bash", "scripts/job.sh", "--shard", str(n)], "working_directory": "scripts",
            "timeout_ms": 600000, "env_names": ["PATH", "HOME", "PGHOST"],
            "resource_policy": {"max_output_bytes": 10485760}}


# ------------------------------------------------------------------ client process
def client_main(conninfo: str, client_no: int, cmd_q, res_q, barrier) -> None:
    """One benchmark client: waits for (op, seconds, tag, ids) commands, runs them after the barrier."""
    import json

    from qlpg import api, db

    conn = db.connect(conninfo, application_name=f"bench-revisions-{client_no}")
    rng = random.Random(client_no)
    ins_sql = "SELECT * FROM ql3.task_revision_insert(%s, %s, %s, 'local_process', %s::jsonb, %s)"
    res_sql = "SELECT * FROM ql3.task_revision_resolve(%s, %s, %s)"
    while True:
        cmd = cmd_q.get()
        if cmd is None:
            break
        op, seconds, tag, ids = cmd
        task_id = f"pkg:bench:{tag}-{client_no}"
        n = 0
        lat: list[float] = []

        def one(i: int) -> None:
            if op == "insert api":
                out = api.task_revision_insert(conn, PROJECT, task_id, f"r{i}", "local_process", template(i),
                                               "ctx:bench")
                assert out["outcome"] == "inserted", out
            elif op == "insert sql":
                out = conn.execute(ins_sql, (PROJECT, task_id, f"r{i}", json.dumps(template(i)), "ctx:bench")).fetchone()
                assert out["outcome"] == "inserted", out
            elif op == "resolve api":
                p, t, r = rng.choice(ids)
                assert api.task_revision_resolve(conn, p, t, r).task_revision == r
            elif op == "resolve sql":
                p, t, r = rng.choice(ids)
                assert conn.execute(res_sql, (p, t, r)).fetchone()["task_revision"] == r
            else:  # pragma: no cover
                raise ValueError(op)

        one(-1) if op.startswith("resolve") else None  # warm the plan cache (not timed)
        barrier.wait()
        t0 = time.perf_counter()
        deadline = t0 + seconds
        now = t0
        while now < deadline:
            one(n)
            n += 1
            t1 = time.perf_counter()
            lat.append(t1 - now)
            now = t1
        res_q.put((client_no, n, now - t0, lat))
    conn.close()


def run_cell(procs, cmd_qs, res_q, barrier_parties, op: str, seconds: float, tag: str, ids) -> dict:
    for q in cmd_qs:
        q.put((op, seconds, tag, ids))
    got = [res_q.get(timeout=seconds + 120) for _ in cmd_qs]
    ops = sum(g[1] for g in got)
    elapsed = max(g[2] for g in got)
    lat = sorted(x for g in got for x in g[3])
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [lat[0] * 1000] * 99
    return {"ops": ops, "elapsed": elapsed, "rate": ops / elapsed,
            "p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000}


def measure(conninfo_admin: str, owner_conninfo: str, clients: list[int], seconds: float) -> dict:
    """{op: {clients: cell}} for every op and client count."""
    import psycopg

    ctx = mp.get_context("spawn")
    results: dict[str, dict[int, dict]] = {op: {} for op in OPS}
    for c in clients:
        cmd_qs = [ctx.Queue() for _ in range(c)]
        res_q = ctx.Queue()
        barrier = ctx.Barrier(c)
        procs = [ctx.Process(target=client_main, args=(conninfo_admin, i, cmd_qs[i], res_q, barrier), daemon=True)
                 for i in range(c)]
        for p in procs:
            p.start()
        try:
            for op in OPS:
                ids = None
                if op.startswith("resolve"):
                    with psycopg.connect(owner_conninfo) as o:
                        ids = [tuple(r) for r in o.execute(
                            "SELECT project_id, task_id, task_revision FROM ql3.task_execution_revisions"
                            " ORDER BY random() LIMIT 20000").fetchall()]
                tag = f"c{c}{op.split()[0][0]}{op.split()[1][0]}"
                cell = run_cell(procs, cmd_qs, res_q, c, op, seconds, tag, ids)
                results[op][c] = cell
                common.log(f"{op:12s} c={c}: {cell['rate']:8.0f} ops/s  p50 {cell['p50_ms']:.2f} ms"
                           f"  p99 {cell['p99_ms']:.2f} ms  ({cell['ops']} calls)")
        finally:
            for q in cmd_qs:
                q.put(None)
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return results


# ------------------------------------------------------------------ report
def fmt(x: float) -> str:
    return f"{x:,.0f}"


def markdown(info: dict, clients: list[int], results: dict, tpcb: dict | None, pgins: dict | None,
             seconds: float, pg_seconds: int, command: str, started: str, total_s: float) -> str:
    s = info["settings"]
    la = info.get("load_avg")
    lines = [
        f"Run of {started} (`{command}`), {total_s:.0f} s in all. Single runs: read each figure as ±20 %.",
        "",
        f"Machine: {info['cpus']} cores, {info['mem_gib']} GiB RAM, Linux {info['kernel']}; the database server and "
        f"all client processes share the cores"
        + (f" (1-minute load average {la[0]:.1f} at the start and {info['load_end'][0]:.1f} at the end: other "
           "developers' test suites were running on the same box, so absolute figures are depressed and noisy; "
           "compare rows of the same run)" if la and info.get("load_end") else "") + ".",
        f"PostgreSQL {info['server_version']}: shared_buffers={s.get('shared_buffers')}, "
        f"synchronous_commit={s.get('synchronous_commit')}, fsync={s.get('fsync')}, "
        f"wal_sync_method={s.get('wal_sync_method')}, max_connections={s.get('max_connections')}. "
        f"Clients: Python {info['python']}, psycopg {info['psycopg']}, one process and one connection each, "
        "over the unix socket, as a `ql3_admin` login.",
        "",
        f"Each revision cell runs {seconds:g} s; p50/p99 are per-call latencies. pgbench runs "
        f"{pg_seconds} s per cell in its own scratch database, between the same runs.",
        "",
        "| operation | what one call does | " + " | ".join(f"{c} client{'s' if c > 1 else ''}" for c in clients) + " |",
        "|---|---|" + "---:|" * len(clients),
    ]
    what = {
        "insert api": "`qlpg.api.task_revision_insert`, new identity: Python check + digest, SERIALIZABLE txn, digest compared",
        "insert sql": "`SELECT * FROM ql3.task_revision_insert(...)`, new identity, autocommit",
        "resolve api": "`qlpg.api.task_revision_resolve`, random existing identity: SQL + Python fail-closed verify, frozen result",
        "resolve sql": "`SELECT * FROM ql3.task_revision_resolve(...)`, autocommit",
    }
    for op in OPS:
        cells = [f"{fmt(results[op][c]['rate'])}/s<br>p50 {results[op][c]['p50_ms']:.1f} / p99 "
                 f"{results[op][c]['p99_ms']:.1f} ms" for c in clients]
        lines.append(f"| {op} | {what[op]} | " + " | ".join(cells) + " |")
    if tpcb:
        lines.append("| pgbench TPC-B | `-s 10 -T %d -n -c C -j min(C,2)`: 5 statements + 1 commit | " % pg_seconds
                     + " | ".join(f"{fmt(tpcb[c])} tps" for c in clients) + " |")
    if pgins:
        lines.append("| pgbench INSERT | 1-row INSERT autocommit (`-f insert.sql`): the commit-rate ceiling | "
                     + " | ".join(f"{fmt(pgins[c])} tps" for c in clients) + " |")
    lines += [
        "",
        "Reading it:",
        "",
        "* An insert is one durable commit, like a pgbench INSERT, plus the server-side work of the "
        "authority: role check, id checks, the ExecutionSpec normalisation, RFC 8785 canonical JSON in "
        "plpgsql, SHA-256, one advisory lock and the primary-key/retention-index insert. Compare `insert sql` "
        "with `pgbench INSERT` to see what that work costs, and with TPC-B for a feel of a small OLTP transaction.",
        "* A resolve writes nothing (no commit flush) but verifies fail closed on every read: the stored "
        "template is re-normalised and re-canonicalised and the digest recomputed (ADR-0023 §3). "
        "`resolve api` adds the Python re-verification and freezing on top.",
        "* The `api` rows include client-side Python (validation, canonical JSON, SHA-256, psycopg) in "
        "processes that compete with the server for the same cores.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", help="superuser/deployer connection (default: $DATABASE_URL, PEER_PG*, PG*)")
    ap.add_argument("--clients", default="1,4,8", help="client counts (default 1,4,8)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per revision cell (default 5)")
    ap.add_argument("--pgbench-seconds", type=int, default=10, help="seconds per pgbench cell (default 10)")
    peer = bool(os.environ.get("PEER_RESULTS"))
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--pgbench", dest="pgbench", action="store_true", default=not peer,
                   help="run pgbench TPC-B and INSERT beside (default unless $PEER_RESULTS is set)")
    g.add_argument("--no-pgbench", dest="pgbench", action="store_false")
    ap.add_argument("--docs", default=None if peer else str(ROOT / "docs" / "benchmarks.md"),
                    help="markdown file whose '## Task Execution Revisions' section is replaced "
                         "(default docs/benchmarks.md; none when $PEER_RESULTS is set)")
    ap.add_argument("--no-docs", action="store_true", help="do not write the markdown section")
    args = ap.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    base = common.server_conninfo(args.dsn)
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    t_start = time.perf_counter()
    info = common.server_info(base)
    common.log(f"PostgreSQL {info['server_version']}, {info['cpus']} cpus, load {info['load_avg']}")

    from qlpg import __version__ as qv  # noqa: F401  (version string for the peer rows)

    with common.scratch_database("qlpg_bench_rev", conninfo=base) as dbci, \
            common.temp_login("ql3_admin", "qlpg_bench_rev", conninfo=base) as login:
        results = measure(common.with_user(dbci, login), dbci, clients, args.seconds)
    tpcb = pgins = None
    if args.pgbench:
        tpcb = common.pgbench_tpcb(clients, args.pgbench_seconds, conninfo=base)
        pgins = common.pgbench_insert(clients, args.pgbench_seconds, conninfo=base)
    total = time.perf_counter() - t_start
    info["load_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None

    import psycopg

    version = getattr(sys.modules.get("qlpg"), "__version__", "0.1.0")
    notes = {
        "insert api": "new identity per call; Python check+digest, SERIALIZABLE txn, digest compared",
        "insert sql": "new identity per call; plain autocommit SELECT ql3.task_revision_insert",
        "resolve api": "random existing identity; SQL + Python fail-closed verification",
        "resolve sql": "random existing identity; plain autocommit SELECT ql3.task_revision_resolve",
    }
    for op in OPS:
        for c in clients:
            cell = results[op][c]
            common.peer_emit(system="qlpg task revisions", version=version, driver=f"psycopg {psycopg.__version__}",
                             measurement=f"task_revision_{op.split()[0]} ({op.split()[1]}), calls/s",
                             concurrency=f"{c} clients (processes)", runs=[cell["rate"]], n=cell["ops"],
                             notes=f"{notes[op]}; p50 {cell['p50_ms']:.2f} ms, p99 {cell['p99_ms']:.2f} ms")
    if args.pgbench and os.environ.get("PEER_RESULTS"):
        for c in clients:
            common.peer_emit(system="pgbench (qlpg run)", version=info["server_version"].split()[0], driver="libpq",
                             measurement=f"TPC-B (-s 10 -T {args.pgbench_seconds} -n), tps",
                             concurrency=f"{c} clients", runs=[tpcb[c]], notes="same run as qlpg task revisions")
    if args.docs and not args.no_docs:
        command = "python bench/revisions.py" + (" " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
                                                 if (argv or sys.argv[1:]) else "")
        text = markdown(info, clients, results, tpcb, pgins, args.seconds, args.pgbench_seconds, command,
                        started, total)
        common.emit_markdown_section(args.docs, SECTION, text)
        common.log(f"wrote '## {SECTION}' in {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
