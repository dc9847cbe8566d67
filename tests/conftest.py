"""Test fixtures: a real PostgreSQL server, a migrated template database, a fresh copy per test.

Procrastinate-style setup with pytest-postgresql in ``noproc`` mode against the running server
(``PGHOST``/``PGPORT``/``PGUSER``/``PGPASSWORD``; default the local socket as ``postgres``):
the session migrates one template database with ``qlpg migrate``; every test gets a fresh database
cloned from it. Roles are cluster-wide: the login users each test connects as (one per ``ql3_*``
group role) are created idempotently and never assumed absent.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psycopg
import pytest
from psycopg.rows import dict_row
from pytest_postgresql import factories

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pyshell"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qlpg import migrate, roles  # noqa: E402

PGHOST = os.environ.get("PGHOST", "/var/run/postgresql")
PGPORT = int(os.environ.get("PGPORT", "5432"))
PGUSER = os.environ.get("PGUSER", "postgres")
PGPASSWORD = os.environ.get("PGPASSWORD")
# Service connections (``as_role``, ``TestDB.conninfo_as``, ``TestDB.connect(role)``) go to
# QLPG_TEST_CLIENT_HOST/PORT when set: a PgBouncer in pool_mode=transaction started by
# ``scripts/pg-cluster pgbouncer -- pytest ...`` (which also sets QLPG_POOLER=transaction, so qlpg
# never prepares statements). Database creation (pytest-postgresql's janitor), the template
# migration, the test logins and the superuser connections (``TestDB.conninfo``, ``ql3_owner``)
# stay on PGHOST/PGPORT, the server itself.
CLIENT_HOST = os.environ.get("QLPG_TEST_CLIENT_HOST") or PGHOST
CLIENT_PORT = int(os.environ.get("QLPG_TEST_CLIENT_PORT") or PGPORT)
VIA_POOLER = (CLIENT_HOST, CLIENT_PORT) != (PGHOST, PGPORT)

if VIA_POOLER:
    # The backend pid of a pooled connection is PgBouncer's invented cancel key, not a server
    # backend: a test that watches or terminates "its" backend (lock-waiter observation through
    # pg_stat_activity, pg_terminate_backend to lose a COMMIT response) is session-bound by nature.
    # Reading it skips the test with that reason instead of waiting forever or killing a stranger.
    _backend_pid = psycopg.ConnectionInfo.backend_pid

    def _pooled_backend_pid(self):
        if self.port == CLIENT_PORT and self.host == CLIENT_HOST:
            pytest.skip("session-bound: observes its own server backend (backend_pid), which a transaction "
                        "pooler does not give a client")
        return _backend_pid.fget(self)

    psycopg.ConnectionInfo.backend_pid = property(_pooled_backend_pid)
ROLE_PREFIX = "qlpg_t_"
SERVICE_ROLES = roles.SERVICE_ROLES


def server_conninfo(dbname: str = "postgres", **kw) -> str:
    params = {"host": PGHOST, "port": PGPORT, "user": PGUSER, "dbname": dbname}
    if PGPASSWORD:
        params["password"] = PGPASSWORD
    params.update(kw)
    return psycopg.conninfo.make_conninfo("", **params)


def client_conninfo(dbname: str = "postgres", **kw) -> str:
    """Like :func:`server_conninfo`, but through the pooler when QLPG_TEST_CLIENT_HOST/PORT are set."""
    return server_conninfo(dbname, **{"host": CLIENT_HOST, "port": CLIENT_PORT, **kw})


def pytest_report_header(config):
    if VIA_POOLER:
        return (f"qlpg: service connections via {CLIENT_HOST}:{CLIENT_PORT} "
                f"(QLPG_POOLER={os.environ.get('QLPG_POOLER', '')}); admin via {PGHOST}:{PGPORT}")
    return f"qlpg: server {PGHOST}:{PGPORT}"


def _load_template(host, port, user, dbname, password=None, **_kw):
    migrate.migrate(server_conninfo(dbname))


# One database name per pytest process, so several suites (developers, helpers, CI on another
# server version) can run against the same cluster at once.
TEST_DBNAME = f"qlpg_test_{os.getpid()}"
postgresql_noproc = factories.postgresql_noproc(
    host=PGHOST, port=PGPORT, user=PGUSER, password=PGPASSWORD, dbname=TEST_DBNAME, load=[_load_template]
)
postgresql = factories.postgresql("postgresql_noproc")


def login_name(role: str) -> str:
    return ROLE_PREFIX + role.removeprefix("ql3_")


@pytest.fixture(scope="session")
def test_logins(postgresql_noproc) -> dict[str, str]:
    """One login per ql3 group role (cluster-wide, created idempotently): role -> login name."""
    out = {}
    with psycopg.connect(server_conninfo(), autocommit=True, row_factory=dict_row) as conn:
        for role in roles.GROUP_ROLES:
            name = login_name(role)
            for _ in range(5):  # another test process may create the same cluster-wide login concurrently
                try:
                    roles.create_login(conn, name, role)
                    break
                except (psycopg.errors.DuplicateObject, psycopg.errors.UniqueViolation):
                    continue
            out[role] = name
        conn.execute(f"DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE_PREFIX}nobody')"
                     f" THEN CREATE ROLE {ROLE_PREFIX}nobody LOGIN; END IF;"
                     f" EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$")
        out["nobody"] = ROLE_PREFIX + "nobody"
    return out


@dataclass
class TestDB:
    """A fresh migrated database for one test."""

    dbname: str
    conninfo: str  # superuser
    logins: dict

    def conninfo_as(self, role: str) -> str:
        """Conninfo connecting as the test login of ``role`` (``ql3_runtime`` …, or ``nobody``).

        Through the pooler when the run has one (QLPG_TEST_CLIENT_HOST/PORT)."""
        return client_conninfo(self.dbname, user=self.logins[role])

    @property
    def client_conninfo(self) -> str:
        """Superuser conninfo through the pooler when the run has one, else equal to ``conninfo``."""
        return client_conninfo(self.dbname)

    def connect(self, role: str | None = None, **kw) -> psycopg.Connection:
        """Autocommit dict-row connection as superuser (role None) or as the login of ``role``."""
        from qlpg import db as qdb

        ci = self.conninfo if role is None else self.conninfo_as(role)
        return qdb.connect(ci, **kw)


@pytest.fixture
def qlpg_db(postgresql, test_logins) -> TestDB:
    """A fresh database cloned from the migrated template (dropped after the test)."""
    info = postgresql.info
    return TestDB(info.dbname, server_conninfo(info.dbname), test_logins)


@pytest.fixture
def ql3_owner(qlpg_db):
    """Autocommit superuser connection to the test database (every migration and function applied)."""
    conn = psycopg.connect(qlpg_db.conninfo, autocommit=True)
    yield conn
    conn.close()


@pytest.fixture
def as_role(qlpg_db) -> Callable[[str], psycopg.Connection]:
    """Factory: ``as_role("ql3_runtime")`` → connection as that role's test login (closed after the test)."""
    opened: list[psycopg.Connection] = []

    def make(role: str, **kw) -> psycopg.Connection:
        c = qlpg_db.connect(role, **kw)
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.close()
