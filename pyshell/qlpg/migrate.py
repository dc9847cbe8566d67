"""`qlpg migrate`: bootstrap roles and schema, yoyo migrations, then every function file.

Order (DESIGN §2):

1. ``sql/bootstrap.sql`` with the deploying login: the six NOLOGIN group roles (needs CREATEROLE
   when one is missing) and schema ``ql3`` owned by ``ql3_migration``.
2. yoyo's migrations from ``sql/migrations`` through the psycopg 3 backend; every transaction
   yoyo opens starts with ``SET LOCAL ROLE ql3_migration`` and ``SET LOCAL search_path = ql3``
   (statements yoyo runs outside a transaction are wrapped in one), so everything is created and
   owned by ``ql3_migration`` and yoyo keeps its bookkeeping tables in ``ql3``; yoyo serialises
   concurrent deployers with its lock table.
3. Inside yoyo's lock, every ``sql/functions/*.sql`` file in one transaction (sorted by name),
   skipped when the same set of files (sha256 of names and bytes) is already deployed, so a
   second run changes nothing.

No session state: no startup options, no session ``SET``, no prepared statements, no session
advisory locks. ``qlpg migrate`` therefore also works through a transaction pooler (PgBouncer
``pool_mode=transaction``, which rejects the ``options`` startup parameter). The one exception is
a yoyo migration marked ``-- transactional: false`` (e.g. ``CREATE INDEX CONCURRENTLY``): it runs
with a session-level ``SET ROLE`` and needs a direct connection; in pooler mode
(``$QLPG_POOLER``/``--pooler``) such a migration is refused. See docs/operations.md.

Raises :class:`MigrationError` with an actionable message when the login lacks a privilege.
"""

from __future__ import annotations

import hashlib
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from yoyo import read_migrations
from yoyo.backends.core.postgresql import PostgresqlPsycopgBackend
from yoyo.connections import parse_uri

from . import db, errors
from .paths import sql_dir

GROUP_ROLES = (
    "ql3_migration",
    "ql3_admin",
    "ql3_package_manager",
    "ql3_package_executor",
    "ql3_runtime",
    "ql3_worker_ingress",
)
OWNER = "ql3_migration"
# Transaction-scoped: behind a transaction pooler a session-level SET would leak into (or be lost
# to) whichever server connection the pooler hands out next.
_AS_OWNER = ("SET LOCAL ROLE ql3_migration", "SET LOCAL search_path = ql3")
_TX_CONTROL = re.compile(r"^\s*(BEGIN|START\s+TRANSACTION|COMMIT|END|ROLLBACK|ABORT|SAVEPOINT|RELEASE)\b", re.I)


class MigrationError(errors.QlpgError):
    """A deployment step failed (missing privilege, lock timeout, bad SQL file)."""


@dataclass(frozen=True)
class MigrateResult:
    """What ``migrate`` did: yoyo ids applied, whether functions were (re)deployed."""

    applied: tuple[str, ...]
    functions_deployed: bool
    functions_digest: str
    function_files: int

    @property
    def changed(self) -> bool:
        return bool(self.applied) or self.functions_deployed


def _as_owner(execute) -> None:
    """Run the two ``SET LOCAL`` statements with ``execute``; a login outside ql3_migration gets a
    :class:`MigrationError` saying so."""
    try:
        for stmt in _AS_OWNER:
            execute(stmt)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MigrationError(
            f"cannot SET ROLE {OWNER} ({str(exc).strip()}): the deploying login must be a member of "
            f"{OWNER} (bootstrap grants it when the login has CREATEROLE; otherwise a DBA runs "
            f"GRANT {OWNER} TO <login>)") from exc


class _Backend(PostgresqlPsycopgBackend):
    """yoyo's psycopg 3 backend on a libpq conninfo, acting as ``ql3_migration`` per transaction.

    ``begin()`` follows yoyo's ``BEGIN`` with ``SET LOCAL ROLE``/``search_path``; ``execute()`` wraps a
    statement yoyo issues outside a transaction in one, so no statement runs as the login itself
    and nothing depends on session state. ``disable_transactions()`` (non-transactional
    migrations) falls back to a session-level ``SET ROLE`` and is refused in pooler mode.
    """

    _session_role = False

    def __init__(self, conninfo: str, pooler: bool | None = None):
        self._qlpg_conninfo = conninfo
        self._qlpg_pooler = pooler
        super().__init__(parse_uri("postgresql+psycopg://qlpg/"), "_yoyo_migration")

    def connect(self, dburi):  # noqa: D401 - yoyo hook
        self.schema = None
        # never prepare: yoyo repeats its bookkeeping queries, and a pooler hands each transaction
        # another server connection
        return psycopg.connect(db.with_params(self._qlpg_conninfo, application_name="qlpg-migrate"),
                               autocommit=True, prepare_threshold=None)

    def copy(self):
        return self.__class__(self._qlpg_conninfo, self._qlpg_pooler)

    def begin(self):
        super().begin()
        _as_owner(lambda stmt: super(_Backend, self).execute(stmt))

    def execute(self, sql, params=None):
        if self._in_transaction or self._session_role or _TX_CONTROL.match(sql):
            return super().execute(sql, params)
        with self.transaction():
            return super().execute(sql, params)

    @contextmanager
    def disable_transactions(self):
        if db.pooler_mode(self._qlpg_pooler):
            raise MigrationError(
                "a migration marked 'transactional: false' needs a session-level SET ROLE: run "
                "qlpg migrate directly against the server, not through a transaction pooler")
        with super().disable_transactions():
            super().execute(f"SET ROLE {OWNER}")
            super().execute("SET search_path = ql3")
            self._session_role = True
            try:
                yield
            finally:
                self._session_role = False
                super().execute("RESET ROLE")
                super().execute("RESET search_path")


def functions_digest(files: list[Path]) -> str:
    """sha256 over the sorted function files' names and bytes (hex)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _bootstrap(conninfo: str, pooler: bool | None = None) -> None:
    text = (sql_dir() / "bootstrap.sql").read_text()
    with db.connect(conninfo, application_name="qlpg-migrate", pooler=pooler) as conn:
        row = conn.execute(
            "SELECT rolsuper, rolcreaterole, current_user AS who,"
            " (SELECT count(*) FROM pg_roles WHERE rolname = ANY(%s)) AS present"
            " FROM pg_roles WHERE rolname = current_user",
            (list(GROUP_ROLES),),
        ).fetchone()
        if row["present"] < len(GROUP_ROLES) and not (row["rolsuper"] or row["rolcreaterole"]):
            raise MigrationError(
                f"login {row['who']!r} lacks CREATEROLE: qlpg migrate must create the missing "
                f"group roles {', '.join(GROUP_ROLES)}. Run it once as a role with CREATEROLE "
                "(or SUPERUSER), or have a DBA create those NOLOGIN roles and grant "
                f"ql3_migration to {row['who']}."
            )
        enc = conn.execute("SELECT current_setting('server_encoding') AS e").fetchone()["e"]
        if enc != "UTF8":
            raise MigrationError(f"database encoding is {enc}; qlpg requires UTF8 (canonical JSON digests)")
        try:
            with conn.transaction():
                conn.execute(text)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise MigrationError(
                f"bootstrap failed for login {row['who']!r}: {exc}. It needs CREATEROLE to create "
                "roles and CREATE on the database to create schema ql3."
            ) from exc


def migrate(conninfo: str = "", *, force_functions: bool = False, lock_timeout_s: int = 60,
            pooler: bool | None = None) -> MigrateResult:
    """Deploy qlpg into the database ``conninfo`` points at; idempotent.

    ``pooler`` (default ``$QLPG_POOLER``): the connection goes through a transaction pooler.
    Returns :class:`MigrateResult`. Raises :class:`MigrationError` (privileges, yoyo lock
    timeout) or :class:`qlpg.errors.ConnectError`.
    """
    _bootstrap(conninfo, pooler)
    root = sql_dir()
    files = sorted((root / "functions").glob("*.sql"))
    digest = functions_digest(files)
    try:
        backend = _Backend(conninfo, pooler)
    except psycopg.OperationalError as exc:
        raise MigrationError(f"cannot connect for the migrations ({str(exc).strip()})") from exc
    backend.init_database()
    migrations = read_migrations(str(root / "migrations"))
    deployed = False
    try:
        with backend.lock(timeout=lock_timeout_s):
            pending = backend.to_apply(migrations)
            applied = tuple(m.id for m in pending)
            if pending:
                backend.apply_migrations(pending)
            with db.connect(conninfo, application_name="qlpg-migrate", pooler=pooler) as conn:
                with conn.transaction():
                    _as_owner(conn.execute)
                    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('ql3-migrate:functions', 0))")
                    have = conn.execute(
                        "SELECT 1 FROM ql3.function_deployments WHERE digest = %s", (digest,)
                    ).fetchone()
                    if force_functions or have is None or pending:
                        conn.execute("SET LOCAL check_function_bodies = off")
                        for f in files:
                            try:
                                conn.execute(f.read_text())
                            except psycopg.Error as exc:
                                raise MigrationError(f"{f}: {exc}") from exc
                        conn.execute(
                            "INSERT INTO ql3.function_deployments (digest, file_count, applied_at_ms)"
                            " VALUES (%s, %s, %s) ON CONFLICT (digest) DO UPDATE"
                            " SET applied_at_ms = EXCLUDED.applied_at_ms",
                            (digest, len(files), int(time.time() * 1000)),
                        )
                        deployed = True
    finally:
        backend.connection.close()
    return MigrateResult(applied, deployed, digest, len(files))
