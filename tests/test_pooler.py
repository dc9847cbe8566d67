"""qlpg behind PgBouncer in ``pool_mode = transaction`` (issue 7 §2).

Each test starts its own throwaway PgBouncer (:class:`qlpg.cluster_pgbouncer.TempPgBouncer`) in
front of the server the suite uses (``PGHOST``/``PGPORT``), so these run in every stage of CI; they
skip when the ``pgbouncer`` binary is missing (``apt-get install -y pgbouncer``; ``.ci/run`` does).
The rest of the suite's end-to-end and concurrency tests run through a pooler as a whole in CI's
pooler stage (``scripts/pg-cluster pgbouncer -- pytest ...``, see tests/conftest.py).

* PgBouncer refuses the ``options`` startup parameter: qlpg never sends one (``qlpg migrate`` sets
  its role per transaction), so ``qlpg migrate --pooler`` through PgBouncer deploys exactly what a
  direct migrate deploys;
* a ``transactional: false`` migration needs a session ``SET ROLE``: refused in pooler mode,
  applied as ``ql3_migration`` on a direct connection;
* the main job end to end through a pool of 2 server connections per login shared by 6 workers, the
  runtime and the CLI: nothing relies on a client keeping its server connection.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import psycopg
import pytest
from psycopg.rows import dict_row

from helpers import EXAMPLES, ROOT, check_audit_invariants
from ops_helpers import catalog_shape, scratch_database, shape_differences, snapshot_sql
from qlpg import db as qdb
from qlpg import migrate, security
from qlpg.cluster import ClusterError
from qlpg.verify import verify_digests

PGHOST = os.environ.get("PGHOST", "/var/run/postgresql")
PGPORT = int(os.environ.get("PGPORT", "5432"))


def _bouncer(**kw):
    from qlpg.cluster_pgbouncer import TempPgBouncer, find_pgbouncer

    try:
        find_pgbouncer()
    except ClusterError as exc:
        pytest.skip(str(exc))
    return TempPgBouncer(PGHOST, PGPORT, **kw).start()


@pytest.fixture(scope="module")
def pgbouncer():
    b = _bouncer()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def small_pool():
    """Two server connections per (database, login): six workers must share them."""
    b = _bouncer(pool_size=2, max_db_connections=12)
    yield b
    b.stop()


def via(bouncer, conninfo: str) -> str:
    """``conninfo`` re-pointed at ``bouncer`` (same database, user, password)."""
    return psycopg.conninfo.make_conninfo(conninfo, host=bouncer.host, port=str(bouncer.port))


def qlpg_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "pyshell"))
    env.pop("QLPG_POOLER", None)  # the --pooler flag must be enough
    return subprocess.run([sys.executable, "-m", "qlpg", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def test_pgbouncer_refuses_startup_options(pgbouncer, qlpg_db):
    """Why qlpg sends no ``options``: PgBouncer rejects the connection outright."""
    with pytest.raises(psycopg.OperationalError, match="unsupported startup parameter"):
        psycopg.connect(via(pgbouncer, qlpg_db.conninfo), options="-c role=ql3_migration").close()
    with psycopg.connect(via(pgbouncer, qlpg_db.conninfo_as("ql3_runtime"))) as c:  # logins pass through
        assert c.execute("SELECT session_user").fetchone()[0] == qlpg_db.logins["ql3_runtime"]


def test_pooler_mode_never_prepares(monkeypatch, pgbouncer, qlpg_db):
    monkeypatch.delenv("QLPG_POOLER", raising=False)
    with qdb.connect(qlpg_db.conninfo) as c:
        assert c.prepare_threshold == 5
    with qdb.connect(via(pgbouncer, qlpg_db.conninfo), pooler=True) as c:
        assert c.prepare_threshold is None
        for _ in range(10):  # past psycopg's default threshold: would fail if it prepared
            assert c.execute("SELECT %s::int AS n", (1,)).fetchone()["n"] == 1
    monkeypatch.setenv("QLPG_POOLER", "transaction")
    with qdb.connect(via(pgbouncer, qlpg_db.conninfo)) as c:
        assert c.prepare_threshold is None


def test_migrate_through_pgbouncer_equals_direct(pgbouncer, qlpg_db, tmp_path, monkeypatch):
    snapshot_sql(tmp_path, monkeypatch)  # both migrations deploy the same files
    with scratch_database(qlpg_db.conninfo, f"{qlpg_db.dbname}_pgb") as pooled, \
            scratch_database(qlpg_db.conninfo, f"{qlpg_db.dbname}_dir") as direct:
        for expect in ("applied migrations: 0001", "applied migrations: none; functions unchanged"):
            p = qlpg_cli("migrate", "--pooler", "--dsn", via(pgbouncer, pooled))
            assert p.returncode == 0, p.stdout + p.stderr
            assert expect in " ".join(p.stdout.split()), p.stdout
        migrate.migrate(direct)
        with psycopg.connect(pooled, autocommit=True) as got, psycopg.connect(direct, autocommit=True) as want:
            assert shape_differences(catalog_shape(got), catalog_shape(want)) == []
            assert security.privilege_matrix(got) == security.privilege_matrix(want)
            assert got.execute("SELECT count(*) FROM pg_class WHERE relnamespace = 'ql3'::regnamespace"
                               " AND relowner <> 'ql3_migration'::regrole").fetchone()[0] == 0


def _sql_copy_with(tmp_path, name: str, text: str):
    src = migrate.sql_dir()
    dst = tmp_path / "sql"
    shutil.copytree(src, dst)
    (dst / "migrations" / name).write_text(text)
    return dst


NON_TRANSACTIONAL = """\
-- transactional: false
-- test-only: a migration that cannot run inside a transaction block
CREATE TABLE IF NOT EXISTS ql3.nt_probe (id integer PRIMARY KEY, note text);
CREATE INDEX CONCURRENTLY IF NOT EXISTS nt_probe_note_idx ON ql3.nt_probe (note);
"""


def test_non_transactional_migration_needs_a_direct_connection(monkeypatch, qlpg_db, tmp_path):
    monkeypatch.setenv("QLPG_SQL_DIR", str(_sql_copy_with(tmp_path, "9999_nt_probe.sql", NON_TRANSACTIONAL)))
    with scratch_database(qlpg_db.conninfo, f"{qlpg_db.dbname}_nt") as direct:
        with pytest.raises(migrate.MigrationError, match="not through a transaction pooler"):
            migrate.migrate(direct, pooler=True)
        res = migrate.migrate(direct, pooler=False)
        assert "9999_nt_probe" in res.applied
        with psycopg.connect(direct, autocommit=True) as c:
            assert c.execute("SELECT relowner::regrole::text FROM pg_class WHERE oid = 'ql3.nt_probe'::regclass"
                             ).fetchone()[0] == "ql3_migration"
            assert c.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = 'ql3.nt_probe_note_idx'::regclass"
                             ).fetchone()[0]


@pytest.mark.slow
def test_main_job_through_a_small_pool(small_pool, qlpg_db, tmp_path):
    """`qlpg run --pooler` entirely through PgBouncer: migrate, throwaway logins, install, start, the
    runtime and 6 workers sharing 2 server connections per login; then `qlpg status --pooler`."""
    expected = json.loads((EXAMPLES / "fanout" / "expected.json").read_text())
    p = qlpg_cli("run", str(EXAMPLES / "fanout"), "--workers", "6", "--pooler", "--state-dir", str(tmp_path),
                 "--dsn", via(small_pool, qlpg_db.conninfo))
    assert p.returncode == 1, p.stdout + p.stderr  # fanout ends failed by design
    assert f"ended {expected['run']}" in p.stdout, p.stdout
    with psycopg.connect(qlpg_db.conninfo, autocommit=True, row_factory=dict_row) as owner:
        run = owner.execute("SELECT id, status FROM ql3.runs").fetchone()
        steps = {r["step_key"]: r["status"] for r in owner.execute("SELECT step_key, status FROM ql3.step_runs")}
        assert (run["status"], steps) == (expected["run"], expected["steps"])
        check_audit_invariants(owner)
        assert verify_digests(owner) == []
    st = qlpg_cli("status", run["id"], "--json", "--pooler", "--dsn", via(small_pool, qlpg_db.conninfo_as("ql3_admin")))
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["run"]["status"] == expected["run"]


def test_temp_pgbouncer_lifecycle(qlpg_db):
    """Start, serve, stop: the process is gone and its directory removed; a busy port is refused."""
    b = _bouncer(pool_size=1)
    base, pid = b.base, b.pid
    assert b.pool_mode == "transaction" and "PgBouncer" in b.version
    env = b.env()
    assert env["QLPG_POOLER"] == "transaction" and env["QLPG_TEST_CLIENT_PORT"] == str(b.port)
    with psycopg.connect(b.dsn(qlpg_db.dbname)) as c:
        assert c.execute("SELECT current_database()").fetchone()[0] == qlpg_db.dbname
    from qlpg.cluster_pgbouncer import TempPgBouncer

    with pytest.raises(ClusterError, match="did not start"):
        TempPgBouncer(PGHOST, PGPORT, port=b.port).start()
    b.stop()
    b.stop()  # idempotent
    assert not os.path.exists(base)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"


def test_pg_cluster_pgbouncer_cli():
    """`scripts/pg-cluster pgbouncer -- CMD`: CMD sees the pooler variables; its exit code passes through."""
    try:
        from qlpg.cluster_pgbouncer import find_pgbouncer

        find_pgbouncer()
    except ClusterError as exc:
        pytest.skip(str(exc))
    script = ROOT / "scripts" / "pg-cluster"
    probe = ('test "$QLPG_POOLER" = transaction && test -n "$QLPG_TEST_CLIENT_PORT" '
             '&& test "$QLPG_TEST_CLIENT_PORT" = "$QLPG_PGBOUNCER_PORT" && exit 7')
    p = subprocess.run([str(script), "pgbouncer", "--", "sh", "-c", probe], capture_output=True, text=True, timeout=60)
    assert p.returncode == 7, p.stderr
    assert "transaction pooling" in p.stderr
