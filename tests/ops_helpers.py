"""Helpers for the operations tests (upgrade path, dump/restore, pooler): a small package whose
gated step blocks until the test releases it, scratch databases, catalog shape comparisons and
row counts.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.rows import dict_row, tuple_row

TERMINAL_RUN = {"succeeded", "failed", "timed_out", "cancelled"}


def write_gate_package(root: Path, gate: Path, name: str = "opsdemo") -> Path:
    """Write package ``name`` into ``root/name``: workflow ``quick`` (one ``echo`` step) and workflow
    ``gated`` (step ``wait`` blocks until the file ``gate`` exists, then ``after`` runs).

    Only argv commands and POSIX ``sh``; both workflows succeed once the gate is opened.
    """
    pkg = root / name
    pkg.mkdir(parents=True, exist_ok=True)
    wait = f"i=0; while [ ! -e '{gate}' ]; do i=$((i+1)); [ $i -gt 1800 ] && exit 9; sleep 0.1; done; echo released"
    (pkg / "qinglong-package.yaml").write_text(textwrap.dedent(f"""\
        package: {name}
        version: 1.0.0
        publisher: qlpg-tests
        tasks:
          hello:
            command: ["sh", "-c", "echo hello"]
            timeout_ms: 60000
          wait:
            command: ["sh", "-c", {wait!r}]
            timeout_ms: 300000
        workflows:
          quick:
            steps:
              hello: {{task: hello}}
          gated:
            steps:
              wait:  {{task: wait}}
              after: {{task: hello, needs: [wait]}}
        """))
    return pkg


def snapshot_sql(tmp_path: Path, monkeypatch) -> Path:
    """Copy the SQL being deployed (``qlpg.paths.sql_dir()``) and point ``QLPG_SQL_DIR`` at the copy,
    so every migrate of one test deploys the same files even while the work tree changes."""
    from qlpg.paths import sql_dir

    dst = tmp_path / "sql-snapshot"
    shutil.copytree(sql_dir(), dst)
    monkeypatch.setenv("QLPG_SQL_DIR", str(dst))
    return dst


@contextlib.contextmanager
def scratch_database(admin_conninfo: str, name: str):
    """Create database ``name`` (dropping a leftover first) and drop it afterwards (WITH FORCE)."""
    def drop(conn):
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    with psycopg.connect(admin_conninfo, autocommit=True) as conn:
        drop(conn)
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8'").format(sql.Identifier(name)))
    try:
        yield psycopg.conninfo.make_conninfo(admin_conninfo, dbname=name)
    finally:
        with psycopg.connect(admin_conninfo, autocommit=True) as conn:
            drop(conn)


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition", interval_s: float = 0.1):
    """Poll ``predicate()`` until it returns a truthy value (returned); AssertionError on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def run_status(conn: psycopg.Connection, run_id: str) -> str:
    with conn.cursor(row_factory=tuple_row) as cur:
        return cur.execute("SELECT status FROM ql3.runs WHERE id = %s", (run_id,)).fetchone()[0]


def drive_to_end(runtime, worker, owner: psycopg.Connection, run_ids, timeout_s: float = 120.0) -> None:
    """Alternate ``runtime.run_once()`` and ``worker.run_once()`` until every run is terminal."""
    deadline = time.monotonic() + timeout_s
    while any(run_status(owner, r) not in TERMINAL_RUN for r in run_ids):
        assert time.monotonic() < deadline, f"runs not terminal after {timeout_s}s: " + ", ".join(
            f"{r}={run_status(owner, r)}" for r in run_ids)
        runtime.run_once()
        if not worker.run_once():
            time.sleep(0.05)


# --------------------------------------------------------------------------- catalog shape

_SHAPE_QUERIES = {
    "columns": """SELECT c.relname || '.' || a.attname AS k,
                         pg_catalog.format_type(a.atttypid, a.atttypmod)
                         || CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END
                         || COALESCE(' DEFAULT ' || pg_catalog.pg_get_expr(d.adbin, d.adrelid), '') AS v
                    FROM pg_catalog.pg_attribute a
                    JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
                    LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                   WHERE c.relnamespace = 'ql3'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm')
                     AND a.attnum > 0 AND NOT a.attisdropped""",
    "constraints": """SELECT c.conrelid::regclass::text || ' ' || c.conname AS k, pg_catalog.pg_get_constraintdef(c.oid) AS v
                        FROM pg_catalog.pg_constraint c WHERE c.connamespace = 'ql3'::regnamespace""",
    "indexes": """SELECT indexname AS k, indexdef AS v FROM pg_catalog.pg_indexes WHERE schemaname = 'ql3'""",
    "triggers": """SELECT t.tgrelid::regclass::text || ' ' || t.tgname AS k, pg_catalog.pg_get_triggerdef(t.oid) AS v
                     FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
                    WHERE c.relnamespace = 'ql3'::regnamespace AND NOT t.tgisinternal""",
    "functions": """SELECT p.oid::regprocedure::text AS k,
                           pg_catalog.md5(p.prosrc) || ' ' || pg_catalog.pg_get_function_result(p.oid)
                           || ' secdef=' || p.prosecdef || ' ' || COALESCE(p.proconfig::text, '') AS v
                      FROM pg_catalog.pg_proc p WHERE p.pronamespace = 'ql3'::regnamespace""",
}


def catalog_shape(conn: psycopg.Connection) -> dict[str, dict[str, str]]:
    """Tables/columns, constraints, indexes, triggers and functions of schema ``ql3`` (no OIDs)."""
    out: dict[str, dict[str, str]] = {}
    with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute("SET LOCAL search_path = pg_catalog")  # names print schema-qualified
        for kind, q in _SHAPE_QUERIES.items():
            out[kind] = {r["k"]: r["v"] for r in cur.execute(q)}
    return out


def shape_differences(have: dict, want: dict) -> list[str]:
    """Human-readable differences between two :func:`catalog_shape` results (``have`` vs ``want``)."""
    out = []
    for kind in want:
        h, w = have.get(kind, {}), want[kind]
        out += [f"{kind}: missing {k} ({w[k]})" for k in sorted(w.keys() - h.keys())]
        out += [f"{kind}: unexpected {k} ({h[k]})" for k in sorted(h.keys() - w.keys())]
        out += [f"{kind}: {k}: {h[k]!r} != {w[k]!r}" for k in sorted(h.keys() & w.keys()) if h[k] != w[k]]
    return out


def table_counts(conn: psycopg.Connection) -> dict[str, int]:
    """Row count of every table of schema ``ql3``."""
    names = [r[0] for r in conn.cursor(row_factory=tuple_row).execute(
        "SELECT relname FROM pg_catalog.pg_class WHERE relnamespace = 'ql3'::regnamespace AND relkind IN ('r', 'p')"
        " ORDER BY relname")]
    with conn.cursor(row_factory=tuple_row) as cur:
        return {n: cur.execute(sql.SQL("SELECT count(*) FROM ql3.{}").format(sql.Identifier(n))).fetchone()[0]
                for n in names}


def pg_tool(name: str) -> str | None:
    """Path of PostgreSQL client program ``name`` on PATH."""
    return shutil.which(name)


def tool_major(path: str) -> int:
    """Major version of a PostgreSQL program (``pg_dump (PostgreSQL) 18.4`` -> 18)."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    return int(out.strip().rsplit(" ", 1)[-1].split(".")[0])
