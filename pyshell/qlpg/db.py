"""Connections and short transactions (DESIGN §7).

Connection parameters follow libpq conventions: an explicit ``--dsn`` (URI or ``key=value``),
else ``$DATABASE_URL``, else the ``PG*`` environment variables and libpq's defaults.

Every mutating call runs in one short transaction (``SERIALIZABLE`` by default, ``$QLPG_ISOLATION``
may say ``read committed``) and is retried on SQLSTATE 40001/40P01 a bounded number of times with
jittered backoff. Behind a transaction pooler (PgBouncer ``pool_mode=transaction``) set
``$QLPG_POOLER=transaction`` or pass ``pooler=True``: psycopg then never prepares statements
(``prepare_threshold=None``) and qlpg uses no session state.
"""

from __future__ import annotations

import os
import random
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, TypeVar

import psycopg
from psycopg import sql as _sql  # noqa: F401  (re-exported for callers)
from psycopg.rows import dict_row

from . import errors

T = TypeVar("T")

RETRY_SQLSTATES = {"40001", "40P01"}
DEFAULT_RETRIES = 12


def resolve_conninfo(dsn: str | None = None) -> str:
    """Return the connection string to use: ``dsn``, else ``$DATABASE_URL``, else ``""``.

    An empty string lets libpq take every parameter from ``PG*`` variables and its defaults.
    """
    if dsn:
        return dsn
    return os.environ.get("DATABASE_URL", "")


def with_params(conninfo: str, **params: Any) -> str:
    """Return ``conninfo`` with ``params`` added or replaced (``None`` values are dropped)."""
    clean = {k: v for k, v in params.items() if v is not None}
    return psycopg.conninfo.make_conninfo(conninfo, **clean)


def describe_target(conninfo: str) -> str:
    """Human description of where ``conninfo`` points (host, port, database, user).

    Values come from the conninfo, else ``PG*`` variables, else libpq's defaults.
    """
    try:
        d = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        d = {}
    host = d.get("host") or d.get("hostaddr") or os.environ.get("PGHOST") or "/var/run/postgresql (libpq default socket)"
    port = d.get("port") or os.environ.get("PGPORT") or "5432"
    user = d.get("user") or os.environ.get("PGUSER") or _os_user()
    dbname = d.get("dbname") or os.environ.get("PGDATABASE") or user
    return f"host={host} port={port} dbname={dbname} user={user}"


def _os_user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except Exception:  # pragma: no cover - exotic platforms
        return os.environ.get("USER", "?")


def pooler_mode(pooler: bool | None = None) -> bool:
    """True when qlpg must behave for a transaction pooler (``$QLPG_POOLER`` or ``pooler``)."""
    if pooler is not None:
        return pooler
    return os.environ.get("QLPG_POOLER", "").lower() in {"1", "true", "yes", "transaction"}


def connect(
    conninfo: str = "",
    *,
    autocommit: bool = True,
    pooler: bool | None = None,
    application_name: str = "qlpg",
    connect_timeout: int | None = None,
    **params: Any,
) -> psycopg.Connection:
    """Open a psycopg connection (rows as dicts).

    ``params`` override conninfo keys (``user=``, ``password=``, ``dbname=``, ``options=`` …).
    Raises :class:`qlpg.errors.ConnectError` naming the address tried and how to point qlpg
    elsewhere when no server answers or the login is refused.
    """
    if connect_timeout is None:
        connect_timeout = int(os.environ.get("QLPG_CONNECT_TIMEOUT", "10"))
    kw: dict[str, Any] = {"application_name": application_name, **params}
    d = psycopg.conninfo.conninfo_to_dict(conninfo) if conninfo else {}
    if "connect_timeout" not in d and not os.environ.get("PGCONNECT_TIMEOUT"):
        kw["connect_timeout"] = connect_timeout
    target = with_params(conninfo, **kw)
    extra: dict[str, Any] = {"autocommit": autocommit, "row_factory": dict_row}
    if pooler_mode(pooler):
        extra["prepare_threshold"] = None
    try:
        return psycopg.connect(target, **extra)
    except psycopg.OperationalError as exc:
        raise errors.ConnectError(
            f"cannot connect to PostgreSQL at {describe_target(target)}: "
            f"{str(exc).strip()}\n"
            "Point qlpg at a server with --dsn 'postgresql://user@host:port/dbname', "
            "DATABASE_URL, or the PGHOST/PGPORT/PGUSER/PGDATABASE variables; "
            "or use `qlpg run --temp-cluster` for a private throwaway cluster."
        ) from exc


def isolation_level() -> psycopg.IsolationLevel:
    """The isolation level for mutating calls (``$QLPG_ISOLATION``, default SERIALIZABLE)."""
    v = os.environ.get("QLPG_ISOLATION", "serializable").lower().replace("_", " ")
    return {
        "serializable": psycopg.IsolationLevel.SERIALIZABLE,
        "repeatable read": psycopg.IsolationLevel.REPEATABLE_READ,
        "read committed": psycopg.IsolationLevel.READ_COMMITTED,
    }.get(v, psycopg.IsolationLevel.SERIALIZABLE)


@contextmanager
def _isolated(conn: psycopg.Connection, level: psycopg.IsolationLevel | None) -> Iterator[None]:
    saved = conn.isolation_level
    conn.isolation_level = level
    try:
        yield
    finally:
        conn.isolation_level = saved


def run_in_transaction(
    conn: psycopg.Connection,
    fn: Callable[[psycopg.Cursor], T],
    *,
    isolation: psycopg.IsolationLevel | None = None,
    retries: int = DEFAULT_RETRIES,
) -> T:
    """Run ``fn(cursor)`` in one transaction, retrying serialization failures and deadlocks.

    Retries SQLSTATE 40001/40P01 up to ``retries`` times with jittered exponential backoff
    (5 ms .. 400 ms). Any other database error is translated by :func:`qlpg.errors.translate`
    (``QLxxx`` SQLSTATEs become their Python exception). The connection must be in autocommit
    mode; the transaction is explicit.
    """
    level = isolation if isolation is not None else isolation_level()
    attempt = 0
    while True:
        try:
            with _isolated(conn, level):
                with conn.transaction():
                    with conn.cursor() as cur:
                        return fn(cur)
        except psycopg.Error as exc:
            state = getattr(exc, "sqlstate", None)
            if state in RETRY_SQLSTATES and attempt < retries:
                attempt += 1
                delay = min(0.4, 0.005 * (2 ** attempt)) * random.uniform(0.5, 1.0)
                time.sleep(delay)
                continue
            raise errors.translate(exc) from exc


_LEVEL_SQL = {
    psycopg.IsolationLevel.SERIALIZABLE: "SERIALIZABLE",
    psycopg.IsolationLevel.REPEATABLE_READ: "REPEATABLE READ",
    psycopg.IsolationLevel.READ_COMMITTED: "READ COMMITTED",
}


def call(
    conn: psycopg.Connection,
    query: str,
    params: Mapping[str, Any] | tuple | None = None,
    *,
    isolation: psycopg.IsolationLevel | None = None,
    retries: int = DEFAULT_RETRIES,
) -> list[dict[str, Any]]:
    """Execute one statement in its own short transaction and return every row as a dict.

    On an idle autocommit connection outside pooler mode the transaction goes out as one message,
    ``BEGIN ISOLATION LEVEL ...; <statement>; COMMIT`` (parameters bound client-side by psycopg):
    one round trip instead of three, and the server commits (releasing the transaction's locks)
    without waiting for the client to read the answer. Same transaction, isolation and retries; no
    session state is changed. Behind a transaction pooler the three-message form is used.
    """

    def go(cur: psycopg.Cursor) -> list[dict[str, Any]]:
        cur.execute(query, params)
        return list(cur.fetchall()) if cur.description else []

    if not conn.autocommit or pooler_mode() or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return run_in_transaction(conn, go, isolation=isolation, retries=retries)
    level = isolation if isolation is not None else isolation_level()
    text = f"BEGIN ISOLATION LEVEL {_LEVEL_SQL[level]};\n{query};\nCOMMIT"
    attempt = 0
    while True:
        try:
            with psycopg.ClientCursor(conn) as cur:
                try:
                    cur.execute(text, params)
                except BaseException:
                    if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
                        conn.execute("ROLLBACK")
                    raise
                cur.nextset()  # the statement's result (the first one is BEGIN's)
                return list(cur.fetchall()) if cur.description else []
        except psycopg.Error as exc:
            state = getattr(exc, "sqlstate", None)
            if state in RETRY_SQLSTATES and attempt < retries:
                attempt += 1
                time.sleep(min(0.4, 0.005 * (2 ** attempt)) * random.uniform(0.5, 1.0))
                continue
            raise errors.translate(exc) from exc
