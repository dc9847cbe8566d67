"""Shared helpers of the qlpg benchmarks (``bench/*.py``).

Import from a script in ``bench/`` with ``import common`` (the script's directory is on
``sys.path``). The API is deliberately small:

``server_conninfo(dsn=None) -> str``
    The superuser/deployer connection string the benchmarks start from: ``dsn``, else
    ``$DATABASE_URL``, else the ``PEER_PG*`` variables of ``/work/shared/peers/run.sh`` when set,
    else ``""`` (libpq's ``PG*`` environment and defaults). It needs CREATEDB and CREATEROLE.
``pgbench_tpcb(clients, seconds, *, conninfo="", scale=10) -> {clients: tps}``
    ``pgbench -i -s <scale>`` once in its own scratch database, then for each client count
    ``pgbench -c C -j min(C, 2) -T <seconds> -n`` (TPC-B, a ``CHECKPOINT`` before each); returns
    tps "without initial connection time". The scratch database is dropped afterwards.
``pgbench_insert(clients, seconds, *, conninfo="") -> {clients: tps}``
    The commit-rate ceiling: ``INSERT INTO ins_bench (payload) VALUES ('{}')`` in autocommit
    (``ins_bench(id bigserial pk, created_at timestamptz default now(), payload jsonb)``), same
    flags, own scratch database -- the same script as the peer comparison.
``scratch_database(prefix, *, conninfo="", migrate=True)``
    Context manager yielding the conninfo of a fresh database ``<prefix>_<pid>_<random>``,
    migrated with ``qlpg migrate`` unless ``migrate=False``; dropped (``WITH (FORCE)``) on exit.
``temp_login(role, prefix, *, conninfo="")``
    Context manager yielding the name of a throwaway login that is a member of exactly ``role``
    (a ``ql3_*`` group role; on a cluster without the group roles a throwaway database is migrated
    first, which creates them); dropped on exit. Connect with ``with_user(db_conninfo, name)``.
``server_info(conninfo="") -> dict``
    Machine and server facts for a results header: cpus, memory, kernel, server version and the
    settings that matter (shared_buffers, synchronous_commit, fsync, wal_sync_method, max_connections).
``emit_markdown_section(path, title, text)``
    Replace the ``## title`` section of ``path`` (e.g. docs/benchmarks.md) in place -- up to the next
    ``## `` heading -- or append it; every other section is left byte for byte.
``peer_emit(**row)``
    When ``$PEER_RESULTS`` is set (``PEER_EXTRA`` of /work/shared/peers/run.sh), append one JSON
    line ``{"system","version","driver","measurement","concurrency","runs":[ops/s...],"n","notes"}``
    plus ``jobs_per_s`` = median of ``runs``, as the peers' ``common.emit`` does; always print it
    prefixed ``RESULT ``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psycopg

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "pyshell") not in sys.path:
    sys.path.insert(0, str(ROOT / "pyshell"))

__all__ = ["server_conninfo", "pgbench_tpcb", "pgbench_insert", "scratch_database", "temp_login",
           "with_user", "server_info", "emit_markdown_section", "peer_emit", "log"]

_TPS = re.compile(r"tps = ([\d.]+) \(without initial connection time\)")
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,30}$")
INSERT_SQL = "INSERT INTO ins_bench (payload) VALUES ('{}');\n"


def log(msg: str) -> None:
    """Progress line on stderr (stdout stays for results)."""
    import time

    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def server_conninfo(dsn: str | None = None) -> str:
    """See the module docstring."""
    if dsn:
        return dsn
    if os.environ.get("DATABASE_URL"):
        return os.environ["DATABASE_URL"]
    peer = {k: os.environ.get(f"PEER_PG{k.upper()}") for k in ("host", "port", "user")}
    if any(peer.values()):
        return psycopg.conninfo.make_conninfo("", **{k: v for k, v in peer.items() if v})
    return ""


def _with(conninfo: str, **kw) -> str:
    return psycopg.conninfo.make_conninfo(conninfo, **kw)


def with_user(conninfo: str, user: str) -> str:
    """``conninfo`` with ``user`` replaced (the password, if any, is dropped)."""
    d = psycopg.conninfo.conninfo_to_dict(conninfo) if conninfo else {}
    d.pop("password", None)
    d["user"] = user
    return psycopg.conninfo.make_conninfo("", **d)


@contextmanager
def scratch_database(prefix: str, *, conninfo: str = "", migrate: bool = True) -> Iterator[str]:
    """See the module docstring."""
    if not _NAME.match(prefix):
        raise ValueError(f"prefix {prefix!r} must match {_NAME.pattern}")
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
    admin = _with(conninfo, dbname="postgres")
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    target = _with(conninfo, dbname=name)
    try:
        if migrate:
            from qlpg import migrate as qmigrate

            qmigrate.migrate(target)
        yield target
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def temp_login(role: str, prefix: str, *, conninfo: str = "") -> Iterator[str]:
    """See the module docstring."""
    from qlpg import roles

    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
    admin = _with(conninfo, dbname="postgres")
    from psycopg.rows import dict_row

    with psycopg.connect(admin, autocommit=True, row_factory=dict_row) as c:
        missing = c.execute("SELECT NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %s) AS m", (role,)).fetchone()["m"]
    if missing:  # a cluster qlpg never ran on: the group roles come from qlpg migrate's bootstrap
        with scratch_database("qlpg_bench_roles", conninfo=conninfo):
            pass
    with psycopg.connect(admin, autocommit=True, row_factory=dict_row) as c:
        roles.create_login(c, name, role)
    try:
        yield name
    finally:
        with psycopg.connect(admin, autocommit=True, row_factory=dict_row) as c:
            roles.drop_login(c, name)


def _pgbench(conninfo: str, *args: str) -> str:
    return subprocess.run(["pgbench", *args, conninfo], capture_output=True, text=True, check=True).stdout


def _pgbench_runs(conninfo: str, clients: list[int], seconds: int, extra: list[str], before: list[str]) -> dict[int, float]:
    out: dict[int, float] = {}
    for c in clients:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            for stmt in before:
                conn.execute(stmt)
            conn.execute("CHECKPOINT")
        text = _pgbench(conninfo, "-c", str(c), "-j", str(min(c, 2)), "-T", str(seconds), "-n", *extra)
        out[c] = float(_TPS.search(text).group(1))
        log(f"pgbench {' '.join(extra) or 'tpcb'} c={c}: {out[c]:.0f} tps")
    return out


def pgbench_tpcb(clients: list[int], seconds: int, *, conninfo: str = "", scale: int = 10) -> dict[int, float]:
    """See the module docstring."""
    with scratch_database("qlpg_bench_pgbench", conninfo=conninfo, migrate=False) as db:
        _pgbench(db, "-i", "-s", str(scale), "-q")
        return _pgbench_runs(db, clients, seconds, [], [])


def pgbench_insert(clients: list[int], seconds: int, *, conninfo: str = "") -> dict[int, float]:
    """See the module docstring."""
    with scratch_database("qlpg_bench_pginsert", conninfo=conninfo, migrate=False) as db:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("CREATE TABLE ins_bench (id bigserial PRIMARY KEY, "
                         "created_at timestamptz NOT NULL DEFAULT now(), payload jsonb)")
        with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
            f.write(INSERT_SQL)
        try:
            return _pgbench_runs(db, clients, seconds, ["-f", f.name], ["TRUNCATE ins_bench"])
        finally:
            os.unlink(f.name)


def server_info(conninfo: str = "") -> dict:
    """See the module docstring."""
    mem_kib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    with psycopg.connect(_with(conninfo, dbname="postgres")) as c:
        version = c.execute("SHOW server_version").fetchone()[0]
        settings = dict(c.execute(
            "SELECT name, setting || COALESCE(unit, '') FROM pg_settings WHERE name = ANY(%s) ORDER BY name",
            (["shared_buffers", "synchronous_commit", "fsync", "wal_sync_method", "max_connections",
              "default_transaction_isolation"],)).fetchall())
    if "shared_buffers" in settings:  # 16384 x 8kB -> 128MB
        m = re.fullmatch(r"(\d+)8kB", settings["shared_buffers"])
        if m:
            settings["shared_buffers"] = f"{int(m.group(1)) * 8 // 1024}MB"
    return {"cpus": os.cpu_count(), "mem_gib": round(mem_kib / 1024 / 1024, 1) if mem_kib else None,
            "kernel": platform.release(), "python": platform.python_version(), "psycopg": psycopg.__version__,
            "server_version": version, "settings": settings,
            "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def emit_markdown_section(path, title: str, text: str) -> None:
    """See the module docstring."""
    path = Path(path)
    head = f"## {title}"
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == head), None)
    body = head + "\n\n" + text.strip("\n") + "\n"
    if start is None:
        new = old.rstrip("\n") + "\n\n" + body
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        rest = "".join(lines[end:])
        new = "".join(lines[:start]) + body + ("\n" + rest if rest else "")
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, path)


def peer_emit(**row) -> dict:
    """See the module docstring."""
    runs = [float(r) for r in row.get("runs") or []]
    if runs:
        row["jobs_per_s"] = round(statistics.median(runs), 1)
        row["runs"] = [round(r, 1) for r in runs]
    line = json.dumps(row)
    print("RESULT " + line, flush=True)
    dest = os.environ.get("PEER_RESULTS")
    if dest:
        with open(dest, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return row
