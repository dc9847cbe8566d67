"""Login users for services: each a member of exactly one ``ql3_*`` group role (DESIGN §3).

``create_login`` makes a ``LOGIN INHERIT`` user with no other attribute (no SUPERUSER, CREATEDB,
CREATEROLE, REPLICATION, BYPASSRLS) and grants it one group role; it refuses a name that already
exists with another ``ql3_*`` membership (direct or through a chain of roles) or with elevated
attributes. Needs CREATEROLE.
"""

from __future__ import annotations

import re

import psycopg
from psycopg import sql

from . import errors

GROUP_ROLES = (
    "ql3_migration",
    "ql3_admin",
    "ql3_package_manager",
    "ql3_package_executor",
    "ql3_runtime",
    "ql3_worker_ingress",
)
SERVICE_ROLES = GROUP_ROLES[1:]
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class RoleError(errors.QlpgError):
    """A login could not be created or dropped as asked."""


def _check(name: str, role: str | None = None) -> None:
    if not _NAME.match(name or ""):
        raise RoleError(f"login name {name!r}: must match {_NAME.pattern}")
    if name in GROUP_ROLES or name.startswith("ql3_"):
        raise RoleError(f"login name {name!r}: the ql3_ prefix is reserved for the group roles")
    if role is not None and role not in GROUP_ROLES:
        raise RoleError(f"role {role!r}: must be one of {', '.join(GROUP_ROLES)}")


def create_login(conn: psycopg.Connection, name: str, role: str, password: str | None = None) -> str:
    """Create (or confirm) login ``name`` as a member of exactly ``role``; returns ``created`` or ``exists``.

    Raises :class:`RoleError` when ``name`` exists with another ql3 membership or elevated
    attributes, and :class:`qlpg.errors.QlpgError` subclasses for server errors (42501 without
    CREATEROLE).
    """
    _check(name, role)
    with conn.transaction():
        row = conn.execute(
            "SELECT r.rolcanlogin, r.rolsuper, r.rolcreatedb, r.rolcreaterole, r.rolreplication, r.rolbypassrls,"
            # effective memberships: direct or through any chain of roles (pg_has_role MEMBER)
            " ARRAY(SELECT g FROM unnest(%s::text[]) g WHERE pg_has_role(r.oid, g, 'MEMBER') ORDER BY g) AS groups"
            " FROM pg_roles r WHERE r.rolname = %s",
            (list(GROUP_ROLES), name),
        ).fetchone()
        if row is None:
            stmt = sql.SQL(
                "CREATE ROLE {} LOGIN INHERIT NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"
            ).format(sql.Identifier(name))
            if password is not None:
                stmt = stmt + sql.SQL(" PASSWORD {}").format(sql.Literal(password))
            try:
                conn.execute(stmt)
            except psycopg.Error as exc:
                raise errors.translate(exc) from exc
            conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(role), sql.Identifier(name)))
            return "created"
        if not row["rolcanlogin"] or any(row[k] for k in ("rolsuper", "rolcreatedb", "rolcreaterole",
                                                           "rolreplication", "rolbypassrls")):
            raise RoleError(f"{name!r} exists but is not a plain login (LOGIN without elevated attributes)")
        others = [g for g in row["groups"] if g != role]
        if others:
            raise RoleError(f"{name!r} is already a member of {', '.join(others)}; a service login holds exactly one ql3 role")
        if role not in row["groups"]:
            conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(role), sql.Identifier(name)))
        if password is not None:
            conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(name), sql.Literal(password)))
        return "exists"


def drop_login(conn: psycopg.Connection, name: str) -> str:
    """Drop login ``name`` (``dropped`` or ``absent``). It owns nothing in ql3, so DROP ROLE suffices.

    Refuses the ``ql3_*`` group roles and any role that is not a plain login (no LOGIN, or
    SUPERUSER, CREATEDB, CREATEROLE, REPLICATION or BYPASSRLS): this command is for service logins.
    """
    _check(name)
    with conn.transaction():
        row = conn.execute(
            "SELECT rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls"
            " FROM pg_roles WHERE rolname = %s", (name,)).fetchone()
        if row is None:
            return "absent"
        if not row["rolcanlogin"] or any(row[k] for k in ("rolsuper", "rolcreatedb", "rolcreaterole",
                                                           "rolreplication", "rolbypassrls")):
            raise RoleError(f"{name!r} is not a plain service login (LOGIN without elevated attributes); "
                            "drop it with DROP ROLE if that is really meant")
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))
    return "dropped"
