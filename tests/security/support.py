"""Shared helpers of the security conformance suite (tests/test_security_*.py).

``module_db`` clones one database per test module from the session's migrated template, so the
role × function × table sweeps run against one database instead of one per test. Every call the
sweeps make runs in a transaction that is rolled back, so the database stays as migrated.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg.rows import dict_row
from pytest_postgresql.janitor import DatabaseJanitor

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXPECTED_GRANTS = HERE / "expected_grants.json"
CALL_ARGS = HERE / "call_args.json"

OWNER = "ql3_migration"
GROUP_ROLES = ("ql3_migration", "ql3_admin", "ql3_package_manager", "ql3_package_executor",
               "ql3_runtime", "ql3_worker_ingress")
SERVICE_ROLES = GROUP_ROLES[1:]
ALL_CALLERS = GROUP_ROLES + ("nobody",)
DENIED = {"42501", "QL601"}


def load_expected() -> dict:
    return json.loads(EXPECTED_GRANTS.read_text())


def load_call_args() -> dict[str, list[str]]:
    data = json.loads(CALL_ARGS.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


@dataclass
class ModuleDB:
    """A migrated database shared by one test module (same interface as conftest's TestDB)."""

    dbname: str
    host: str
    port: int
    user: str
    password: str | None
    logins: dict
    _opened: list = field(default_factory=list)

    def conninfo_for(self, user: str) -> str:
        params = {"host": self.host, "port": self.port, "user": user, "dbname": self.dbname}
        if self.password and user == self.user:
            params["password"] = self.password
        return psycopg.conninfo.make_conninfo("", **params)

    @property
    def conninfo(self) -> str:
        return self.conninfo_for(self.user)

    def conninfo_as(self, role: str) -> str:
        return self.conninfo_for(self.logins[role])

    def connect(self, role: str | None = None, *, user: str | None = None) -> psycopg.Connection:
        """Autocommit dict-row connection: superuser (default), a role's test login, or ``user``."""
        ci = self.conninfo_for(user) if user else (self.conninfo if role is None else self.conninfo_as(role))
        conn = psycopg.connect(ci, autocommit=True, row_factory=dict_row)
        self._opened.append(conn)
        return conn

    def close_all(self) -> None:
        for c in self._opened:
            c.close()
        self._opened.clear()


def module_db(noproc, logins, hint: str):
    """Generator for a module-scoped fixture: yields a :class:`ModuleDB` cloned from the template."""
    name = f"qlpg_sec_{hint}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    janitor = DatabaseJanitor(user=noproc.user, host=noproc.host, port=noproc.port, dbname=name,
                              template_dbname=noproc.template_dbname, password=noproc.password,
                              maintenance_dbname=noproc.maintenance_dbname)
    with janitor:
        mdb = ModuleDB(name, noproc.host, int(noproc.port), noproc.user, noproc.password, logins)
        try:
            yield mdb
        finally:
            mdb.close_all()


def catalog_functions(conn: psycopg.Connection) -> list[dict]:
    """Every function in ql3 with what a call needs: regprocedure, arg types, variadic, definer."""
    return conn.execute(
        """
        SELECT p.oid::pg_catalog.regprocedure::text AS sig, p.proname AS name, p.prosecdef AS definer,
               pg_catalog.pg_get_userbyid(p.proowner) AS owner,
               ARRAY(SELECT pg_catalog.format_type(t, NULL)
                       FROM pg_catalog.unnest(p.proargtypes::oid[]) WITH ORDINALITY u(t, i) ORDER BY i) AS argtypes,
               ARRAY(SELECT CASE WHEN ty.typtype = 'c'
                              THEN (SELECT pg_catalog.count(*) FROM pg_catalog.pg_attribute a
                                     WHERE a.attrelid = ty.typrelid AND a.attnum > 0 AND NOT a.attisdropped)
                              ELSE -1 END
                       FROM pg_catalog.unnest(p.proargtypes::oid[]) WITH ORDINALITY u(t, i)
                       JOIN pg_catalog.pg_type ty ON ty.oid = u.t ORDER BY i) AS argfields,
               p.provariadic <> 0 AS variadic, p.proisstrict AS strict,
               p.prorettype = 'pg_catalog.trigger'::pg_catalog.regtype AS is_trigger
          FROM pg_catalog.pg_proc p
         WHERE p.pronamespace = 'ql3'::pg_catalog.regnamespace
         ORDER BY 1
        """
    ).fetchall()


def catalog_tables(conn: psycopg.Connection) -> list[dict]:
    """Every table/view/sequence of ql3 with its first column (for an UPDATE statement)."""
    return conn.execute(
        """
        SELECT pg_catalog.format('%I.%I', n.nspname, c.relname) AS name, c.relname, c.relkind::text AS relkind,
               (SELECT pg_catalog.quote_ident(a.attname) FROM pg_catalog.pg_attribute a
                 WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum LIMIT 1) AS col
          FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'ql3' AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
         ORDER BY 1
        """
    ).fetchall()


_DUMMIES = {"text": "'x'", "integer": "0", "bigint": "0", "smallint": "0", "boolean": "false",
            "json": "'{}'::json", "jsonb": "'{}'::jsonb", "bytea": "''::bytea"}


def dummy_args(fn: dict) -> list[str]:
    """Typed placeholder arguments for a function missing from call_args.json.

    Non-NULL on purpose: the planner folds a STRICT function called with a constant NULL to NULL
    without ever checking EXECUTE, which would make an internal helper look callable.
    """
    args = []
    for t, nfields in zip(fn["argtypes"], fn["argfields"]):
        if t.endswith("[]"):
            args.append(f"'{{}}'::{t}")
        elif nfields >= 0:  # composite: a non-NULL row of NULL fields
            args.append(f"ROW({', '.join(['NULL'] * nfields)})::{t}")
        else:
            args.append(f"{_DUMMIES.get(t, 'NULL')}::{t}")
    if fn["variadic"] and args:
        args[-1] = "VARIADIC " + args[-1]
    return args


def call_sql(fn: dict, args: list[str] | None = None) -> str:
    """The SQL that calls ``fn`` with the data-table literals (or :func:`dummy_args`).

    A trigger function cannot be called directly; it is "called" the only way a session could use
    it: by attaching it to a temporary table, which needs EXECUTE on it.
    """
    name = fn["sig"].split("(", 1)[0]
    if fn["is_trigger"]:
        return (f"CREATE TEMP TABLE qlpg_sec_trigger_probe (x int); "
                f"CREATE TRIGGER qlpg_sec_probe BEFORE INSERT ON qlpg_sec_trigger_probe "
                f"FOR EACH ROW EXECUTE FUNCTION {name}()")
    if args is None:
        args = dummy_args(fn)
    return f"SELECT * FROM {name}({', '.join(args)})"


def attempt(conn: psycopg.Connection, query: str, params=None) -> tuple[str | None, str]:
    """Run ``query`` in a transaction that is always rolled back; (sqlstate or None, message)."""
    try:
        with conn.transaction(force_rollback=True):
            conn.execute(query, params)
        return None, "ok"
    except psycopg.Error as exc:
        return (exc.sqlstate or "?"), (exc.diag.message_primary or str(exc))


def may_call(expected: dict, sig: str, role: str, definer: bool) -> bool:
    """Whether ``role`` may call ``sig`` per expected_grants.json (the owner may call its internals)."""
    roles = expected["functions"].get(sig, [])
    if role in roles:
        return True
    return role == OWNER and not definer
