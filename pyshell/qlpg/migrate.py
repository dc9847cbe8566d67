"""`qlpg migrate`: bootstrap roles and schema, yoyo migrations, then every function file.

Order (DESIGN §2):

1. ``sql/bootstrap.sql`` with the deploying login: the six NOLOGIN group roles (needs CREATEROLE
   when one is missing) and schema ``ql3`` owned by ``ql3_migration``.
2. yoyo's migrations from ``sql/migrations`` through the psycopg 3 backend, on a connection that
   runs as ``ql3_migration`` (startup option ``role``) with ``search_path=ql3``; yoyo keeps its
   bookkeeping tables in ``ql3`` and serialises concurrent deployers with its lock table.
3. Inside yoyo's lock, every ``sql/functions/*.sql`` file in one transaction (sorted by name),
   skipped when the same set of files (sha256 of names and bytes) is already deployed, so a
   second run changes nothing.

Raises :class:`MigrationError` with an actionable message when the login lacks a privilege.
"""

from __future__ import annotations

import hashlib
import time
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
MIGRATION_OPTIONS = "-c role=ql3_migration -c search_path=ql3"


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


class _Backend(PostgresqlPsycopgBackend):
    """yoyo's psycopg 3 backend, connecting with a libpq conninfo instead of a URI."""

    def __init__(self, conninfo: str):
        self._qlpg_conninfo = conninfo
        super().__init__(parse_uri("postgresql+psycopg://qlpg/"), "_yoyo_migration")

    def connect(self, dburi):  # noqa: D401 - yoyo hook
        self.schema = None
        conn = psycopg.connect(
            db.with_params(self._qlpg_conninfo, options=MIGRATION_OPTIONS,
                           application_name="qlpg-migrate"),
            autocommit=True,
        )
        return conn

    def copy(self):
        return self.__class__(self._qlpg_conninfo)


def functions_digest(files: list[Path]) -> str:
    """sha256 over the sorted function files' names and bytes (hex)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _bootstrap(conninfo: str) -> None:
    text = (sql_dir() / "bootstrap.sql").read_text()
    with db.connect(conninfo, application_name="qlpg-migrate") as conn:
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


def migrate(conninfo: str = "", *, force_functions: bool = False, lock_timeout_s: int = 60) -> MigrateResult:
    """Deploy qlpg into the database ``conninfo`` points at; idempotent.

    Returns :class:`MigrateResult`. Raises :class:`MigrationError` (privileges, yoyo lock
    timeout) or :class:`qlpg.errors.ConnectError`.
    """
    _bootstrap(conninfo)
    root = sql_dir()
    files = sorted((root / "functions").glob("*.sql"))
    digest = functions_digest(files)
    try:
        backend = _Backend(conninfo)
    except psycopg.OperationalError as exc:
        raise MigrationError(
            f"cannot connect as ql3_migration ({exc}); the deploying login must be a member of "
            "ql3_migration (bootstrap grants it when it has CREATEROLE)"
        ) from exc
    backend.init_database()
    migrations = read_migrations(str(root / "migrations"))
    deployed = False
    try:
        with backend.lock(timeout=lock_timeout_s):
            pending = backend.to_apply(migrations)
            applied = tuple(m.id for m in pending)
            if pending:
                backend.apply_migrations(pending)
            with psycopg.connect(
                db.with_params(conninfo, options=MIGRATION_OPTIONS, application_name="qlpg-migrate"),
                autocommit=True,
            ) as conn:
                with conn.transaction():
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
