"""The role × object privilege matrix of schema ``ql3``, read from the live catalog (issue 6).

``privilege_matrix(conn)`` explodes every ACL with ``aclexplode`` (``information_schema`` omits
grants to PUBLIC) and, where an ACL is NULL, the built-in default ``acldefault`` — so the owner's
implicit privileges appear explicitly in the owner's column, and a function whose ACL was never
touched shows the EXECUTE that PUBLIC holds by default. It covers:

* schema ``ql3``;
* every table, partitioned table, view, materialized view, foreign table and sequence in ``ql3``
  (and any column-level grant on them);
* every function in ``ql3`` (object name ``oid::regprocedure``), with its security properties:
  SECURITY DEFINER, owner, ``proconfig`` (pinned ``search_path``), comment present;
* the attributes of the six group roles, memberships among them, and the owner's default
  privileges (``pg_default_acl``).

Only the six ``ql3_*`` group roles and PUBLIC are grantees of the matrix: it holds no OID, no
database name and no login name, so the rendered report is identical on every cluster and is kept
as the golden file ``docs/security/grants.md``. Grants to any other role are returned by
:func:`foreign_grants` (the conformance tests require it to be empty, superusers aside).

CLI: ``python -m qlpg.security report [--json] [--dsn DSN] [-o FILE]`` (``qlpg security report``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row

SCHEMA = "ql3"
OWNER = "ql3_migration"
GROUP_ROLES = (
    "ql3_migration",
    "ql3_admin",
    "ql3_package_manager",
    "ql3_package_executor",
    "ql3_runtime",
    "ql3_worker_ingress",
)
PUBLIC = "PUBLIC"
GRANTEES = GROUP_ROLES + (PUBLIC,)

# privilege_type (aclexplode) -> ACL letter (PostgreSQL's aclitem notation).
LETTERS = {
    "INSERT": "a",
    "SELECT": "r",
    "UPDATE": "w",
    "DELETE": "d",
    "TRUNCATE": "D",
    "REFERENCES": "x",
    "TRIGGER": "t",
    "MAINTAIN": "m",  # PostgreSQL 17+
    "EXECUTE": "X",
    "USAGE": "U",
    "CREATE": "C",
    "TEMPORARY": "T",
    "CONNECT": "c",
}
LETTER_ORDER = "arwdDxtmXUCTc"
RELKINDS = {"r": "table", "p": "partitioned table", "v": "view", "m": "materialized view",
            "f": "foreign table", "S": "sequence"}
ROLE_ATTRIBUTES = ("rolsuper", "rolinherit", "rolcreaterole", "rolcreatedb", "rolcanlogin",
                   "rolreplication", "rolbypassrls")
DEFACL_OBJTYPES = {"r": "tables", "S": "sequences", "f": "functions", "T": "types", "n": "schemas"}

#: The golden file per server family. PostgreSQL 17 added the MAINTAIN table privilege (``m``),
#: and the owner's implicit table privileges (``acldefault``) include it from 17 on, so the live
#: matrix of an identical deployment differs by that one letter in the owner's column of every
#: table. Each file is kept byte-exact for its family (the conformance tests and ``qlpg doctor``
#: compare against the one for the server they talk to); ``tests/test_security_golden.py`` checks
#: that the two files differ by nothing else.
GOLDEN_PG17PLUS_FROM = 170000
GOLDEN_FILES = ("grants.md", "grants-pg17plus.md")
_OWNER_ALL_PRE17 = "arwdDxt"


def golden_file_name(server_version_num: int) -> str:
    """``grants.md`` for PostgreSQL 15/16, ``grants-pg17plus.md`` for 17 and later."""
    return GOLDEN_FILES[1] if server_version_num >= GOLDEN_PG17PLUS_FROM else GOLDEN_FILES[0]


def without_owner_maintain(markdown: str) -> str:
    """The PG17+ report with the owner's implicit MAINTAIN dropped: equals the PG15/16 report."""
    return re.sub(r"(?<=\| )(a\*?r\*?w\*?d\*?D\*?x\*?t\*?)m(\*?)(?= \|)", lambda m: m.group(1), markdown)


def with_owner_maintain(markdown: str) -> str:
    """The PG15/16 report with MAINTAIN added wherever every pre-17 table privilege is held (the
    owner's implicit privileges): what the same deployment reports on PostgreSQL 17+."""
    return re.sub(r"(?<=\| )(a(\*?)r\*?w\*?d\*?D\*?x\*?t\*?)(?= \|)", lambda m: m.group(1) + "m" + m.group(2),
                  markdown)


_GRANTEE_SQL = "CASE WHEN x.grantee = 0 THEN 'PUBLIC' ELSE pg_catalog.pg_get_userbyid(x.grantee) END"

_SCHEMA_Q = f"""
SELECT n.nspname AS object, pg_catalog.pg_get_userbyid(n.nspowner) AS owner,
       {_GRANTEE_SQL} AS grantee, x.privilege_type, x.is_grantable
  FROM pg_catalog.pg_namespace n,
       LATERAL pg_catalog.aclexplode(COALESCE(n.nspacl, pg_catalog.acldefault('n', n.nspowner))) x
 WHERE n.nspname = %(schema)s
"""

_REL_Q = f"""
SELECT pg_catalog.format('%%I.%%I', n.nspname, c.relname) AS object, c.relkind::text AS relkind,
       pg_catalog.pg_get_userbyid(c.relowner) AS owner,
       {_GRANTEE_SQL} AS grantee, x.privilege_type, x.is_grantable
  FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace,
       LATERAL pg_catalog.aclexplode(COALESCE(c.relacl, pg_catalog.acldefault(
         CASE WHEN c.relkind = 'S' THEN 's' ELSE 'r' END::"char", c.relowner))) x
 WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
"""

_COL_Q = f"""
SELECT pg_catalog.format('%%I.%%I(%%I)', n.nspname, c.relname, a.attname) AS object,
       pg_catalog.pg_get_userbyid(c.relowner) AS owner,
       {_GRANTEE_SQL} AS grantee, x.privilege_type, x.is_grantable
  FROM pg_catalog.pg_attribute a
  JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace,
       LATERAL pg_catalog.aclexplode(a.attacl) x
 WHERE n.nspname = %(schema)s AND a.attacl IS NOT NULL AND NOT a.attisdropped AND a.attnum > 0
"""

_FUNC_Q = f"""
SELECT p.oid::pg_catalog.regprocedure::text AS object,
       pg_catalog.pg_get_userbyid(p.proowner) AS owner,
       {_GRANTEE_SQL} AS grantee, x.privilege_type, x.is_grantable
  FROM pg_catalog.pg_proc p
  JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace,
       LATERAL pg_catalog.aclexplode(COALESCE(p.proacl, pg_catalog.acldefault('f', p.proowner))) x
 WHERE n.nspname = %(schema)s
"""

_FUNC_PROPS_Q = """
SELECT p.oid::pg_catalog.regprocedure::text AS object,
       pg_catalog.pg_get_userbyid(p.proowner) AS owner,
       p.prosecdef AS security_definer,
       COALESCE(p.proconfig, '{}'::text[]) AS config,
       l.lanname AS language,
       CASE p.prokind WHEN 'f' THEN 'function' WHEN 'p' THEN 'procedure'
                      WHEN 'a' THEN 'aggregate' WHEN 'w' THEN 'window' END AS kind,
       pg_catalog.obj_description(p.oid, 'pg_proc') IS NOT NULL AS has_comment
  FROM pg_catalog.pg_proc p
  JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
  JOIN pg_catalog.pg_language l ON l.oid = p.prolang
 WHERE n.nspname = %(schema)s
"""

_ROLES_Q = """
SELECT r.rolname, r.rolsuper, r.rolinherit, r.rolcreaterole, r.rolcreatedb, r.rolcanlogin,
       r.rolreplication, r.rolbypassrls
  FROM pg_catalog.pg_roles r WHERE r.rolname = ANY(%(roles)s)
"""

_MEMBERS_Q = """
SELECT g.rolname AS role, m.rolname AS member
  FROM pg_catalog.pg_auth_members am
  JOIN pg_catalog.pg_roles g ON g.oid = am.roleid
  JOIN pg_catalog.pg_roles m ON m.oid = am.member
 WHERE g.rolname = ANY(%(roles)s) AND m.rolname = ANY(%(roles)s)
"""

_DEFACL_Q = f"""
SELECT pg_catalog.pg_get_userbyid(d.defaclrole) AS role,
       COALESCE(n.nspname, '') AS schema, d.defaclobjtype::text AS objtype,
       {_GRANTEE_SQL} AS grantee, x.privilege_type, x.is_grantable
  FROM pg_catalog.pg_default_acl d
  LEFT JOIN pg_catalog.pg_namespace n ON n.oid = d.defaclnamespace,
       LATERAL pg_catalog.aclexplode(d.defaclacl) x
 WHERE pg_catalog.pg_get_userbyid(d.defaclrole) = ANY(%(roles)s)
"""

_FOREIGN_Q = f"""
WITH acl AS (
  {_SCHEMA_Q.replace('SELECT n.nspname AS object,', "SELECT 'schema' AS kind, n.nspname AS object,")}
  UNION ALL
  SELECT 'relation', object, owner, grantee, privilege_type, is_grantable FROM ({_REL_Q}) r
  UNION ALL
  SELECT 'column', object, owner, grantee, privilege_type, is_grantable FROM ({_COL_Q}) c
  UNION ALL
  SELECT 'function', object, owner, grantee, privilege_type, is_grantable FROM ({_FUNC_Q}) f
)
SELECT acl.kind, acl.object, acl.grantee, acl.privilege_type
  FROM acl
 WHERE acl.grantee <> 'PUBLIC' AND acl.grantee <> ALL(%(roles)s)
   AND NOT COALESCE((SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = acl.grantee), false)
 ORDER BY 1, 2, 3, 4
"""


def _cells(rows: list[dict]) -> dict[str, dict[str, str]]:
    """object -> grantee -> letters (``*`` after a letter held WITH GRANT OPTION); grantees limited to GRANTEES."""
    acc: dict[str, dict[str, dict[str, bool]]] = {}
    for r in rows:
        obj = acc.setdefault(r["object"], {})
        if r["grantee"] not in GRANTEES:
            continue
        g = obj.setdefault(r["grantee"], {})
        g[r["privilege_type"]] = g.get(r["privilege_type"], False) or bool(r["is_grantable"])
    out: dict[str, dict[str, str]] = {}
    for obj, grantees in acc.items():
        out[obj] = {}
        for grantee, privs in grantees.items():
            text = "".join(
                LETTERS[p] + ("*" if privs[p] else "")
                for p in sorted(privs, key=lambda p: LETTER_ORDER.index(LETTERS[p]))
            )
            out[obj][grantee] = text
    return out


def _ordered(grantees: dict[str, str]) -> dict[str, str]:
    return {g: grantees[g] for g in GRANTEES if grantees.get(g)}


def _search_path(config: list[str]) -> str | None:
    for item in config:
        if item.startswith("search_path="):
            return item.split("=", 1)[1]
    return None


def privilege_matrix(conn: psycopg.Connection) -> dict[str, Any]:
    """The deterministic privilege matrix of schema ``ql3`` (see the module docstring).

    Keys: ``grantees`` (column order), ``schema``, ``relations``, ``columns``, ``functions``,
    ``roles``, ``memberships``, ``default_privileges``. Every mapping is sorted by object name.
    """
    # regprocedure text qualifies names by the session's search_path: pin it so the object names
    # are always schema-qualified, then restore the caller's setting. Transaction-local
    # (set_config(..., true) inside one transaction): behind a transaction pooler a session-level
    # setting would land on, and stay with, whichever server connection ran that one statement.
    with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
        saved = cur.execute("SELECT pg_catalog.current_setting('search_path')").fetchone()[0]
        cur.execute("SELECT pg_catalog.set_config('search_path', 'pg_catalog', true)")
        out = _matrix(conn)
        cur.execute("SELECT pg_catalog.set_config('search_path', %s, true)", (saved,))
        return out


def _matrix(conn: psycopg.Connection) -> dict[str, Any]:
    params = {"schema": SCHEMA, "roles": list(GROUP_ROLES)}

    def q(sql: str) -> list[dict]:
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(sql, params)
            return cur.fetchall()

    out: dict[str, Any] = {"grantees": list(GRANTEES)}

    srows = q(_SCHEMA_Q)
    scells = _cells(srows)
    out["schema"] = {
        obj: {"owner": next(r["owner"] for r in srows if r["object"] == obj), "privileges": _ordered(scells[obj])}
        for obj in sorted(scells)
    }

    rrows = q(_REL_Q)
    rcells = _cells(rrows)
    meta = {r["object"]: r for r in rrows}
    out["relations"] = {
        obj: {"kind": RELKINDS[meta[obj]["relkind"]], "owner": meta[obj]["owner"],
              "privileges": _ordered(rcells[obj])}
        for obj in sorted(rcells)
    }

    crows = q(_COL_Q)
    ccells = _cells(crows)
    out["columns"] = {obj: {"privileges": _ordered(ccells[obj])} for obj in sorted(ccells)}

    fcells = _cells(q(_FUNC_Q))
    props = {r["object"]: r for r in q(_FUNC_PROPS_Q)}
    out["functions"] = {}
    for obj in sorted(props):
        p = props[obj]
        out["functions"][obj] = {
            "owner": p["owner"],
            "kind": p["kind"],
            "language": p["language"],
            "security_definer": p["security_definer"],
            "config": list(p["config"]),
            "search_path": _search_path(list(p["config"])),
            "has_comment": p["has_comment"],
            "privileges": _ordered(fcells.get(obj, {})),
        }

    roles = {r["rolname"]: r for r in q(_ROLES_Q)}
    out["roles"] = {
        name: ({a.removeprefix("rol"): roles[name][a] for a in ROLE_ATTRIBUTES} if name in roles else None)
        for name in GROUP_ROLES
    }
    out["memberships"] = sorted([m["member"], m["role"]] for m in q(_MEMBERS_Q))

    defacl: dict[str, dict[str, str]] = {}
    drows = q(_DEFACL_Q)
    for r in drows:
        key = f"{r['role']} {DEFACL_OBJTYPES.get(r['objtype'], r['objtype'])}" + (
            f" in schema {r['schema']}" if r["schema"] else "")
        r["object"] = key
    dcells = _cells(drows)
    for key in {r["object"] for r in drows}:
        defacl[key] = _ordered(dcells.get(key, {}))
    out["default_privileges"] = {k: defacl[k] for k in sorted(defacl)}
    return out


def foreign_grants(conn: psycopg.Connection) -> list[dict[str, str]]:
    """Privileges on ql3 objects held by a role that is neither one of the six, PUBLIC, nor a superuser.

    Rows ``{kind, object, grantee, privilege_type}``; qlpg expects none.
    """
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_FOREIGN_Q, {"schema": SCHEMA, "roles": list(GROUP_ROLES)})
        return [dict(r) for r in cur.fetchall()]


def _short(role: str) -> str:
    return role.removeprefix("ql3_")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c if c else " " for c in cells) + " |"


def _grant_cols(privs: dict[str, str]) -> list[str]:
    return [privs.get(g, "") or "·" for g in GRANTEES]


def render_markdown(matrix: dict[str, Any]) -> str:
    """A reviewable markdown report: one table per object class, rows objects, columns grantees."""
    heads = [_short(g) for g in GRANTEES]
    lines: list[str] = [
        "# ql3 privilege matrix",
        "",
        "<!-- Generated by `python -m qlpg.security report` (`qlpg security report`) against a freshly",
        "     migrated database. Do not edit by hand: tests/test_security_golden.py fails on drift;",
        "     regenerate with `QLPG_UPDATE_GOLDEN=1 pytest tests/test_security_golden.py`. -->",
        "",
        "Read from the live catalog with `aclexplode` (so PUBLIC is included); a NULL ACL is shown as",
        "its built-in default (`acldefault`), which is how the owner's implicit privileges appear in",
        "the `migration` column. Grantees: the six `ql3_*` group roles (prefix dropped) and PUBLIC.",
        "",
        "Letters (PostgreSQL ACL notation): `a` INSERT, `r` SELECT, `w` UPDATE, `d` DELETE,",
        "`D` TRUNCATE, `x` REFERENCES, `t` TRIGGER, `m` MAINTAIN (PG17+), `X` EXECUTE, `U` USAGE,",
        "`C` CREATE; `*` after a letter = WITH GRANT OPTION; `·` = nothing.",
        "",
        "## Roles",
        "",
        _row(["role", "superuser", "inherit", "createrole", "createdb", "login", "replication", "bypassrls"]),
        _row(["---"] * 8),
    ]
    for name, attrs in matrix["roles"].items():
        if attrs is None:
            lines.append(_row([f"`{name}`", "MISSING"] + [""] * 6))
        else:
            lines.append(_row([f"`{name}`"] + ["yes" if attrs[a.removeprefix("rol")] else "no"
                                               for a in ROLE_ATTRIBUTES]))
    lines += ["", "Memberships among the six roles: " + (
        ", ".join(f"`{m}` in `{r}`" for m, r in matrix["memberships"]) or "none") + ".", ""]

    lines += ["## Schema", "", _row(["schema", "owner"] + heads), _row(["---"] * (2 + len(heads)))]
    for obj, info in matrix["schema"].items():
        lines.append(_row([f"`{obj}`", _short(info["owner"])] + _grant_cols(info["privileges"])))

    lines += ["", "## Default privileges", "",
              "`pg_default_acl` entries of the six roles (privileges that objects they create later get;",
              "a global entry without PUBLIC revokes the built-in PUBLIC default).", "",
              _row(["entry"] + heads), _row(["---"] * (1 + len(heads)))]
    for key, privs in matrix["default_privileges"].items():
        lines.append(_row([f"`{key}`"] + _grant_cols(privs)))
    if not matrix["default_privileges"]:
        lines.append(_row(["none"] + [""] * len(heads)))

    lines += ["", "## Tables, views and sequences", "",
              _row(["relation", "kind", "owner"] + heads), _row(["---"] * (3 + len(heads)))]
    for obj, info in matrix["relations"].items():
        lines.append(_row([f"`{obj}`", info["kind"], _short(info["owner"])] + _grant_cols(info["privileges"])))
    lines += ["", "Column-level grants: " + ("none." if not matrix["columns"] else "")]
    if matrix["columns"]:
        lines += ["", _row(["column"] + heads), _row(["---"] * (1 + len(heads)))]
        for obj, info in matrix["columns"].items():
            lines.append(_row([f"`{obj}`"] + _grant_cols(info["privileges"])))

    lines += ["", "## Functions", "",
              "`definer` = SECURITY DEFINER; `search_path` = the pinned setting (`proconfig`);",
              "`comment` = has COMMENT ON FUNCTION; other `proconfig` settings are listed under it.", "",
              _row(["function", "definer", "search_path", "comment", "owner"] + heads),
              _row(["---"] * (5 + len(heads)))]
    for obj, info in matrix["functions"].items():
        sp = info["search_path"]
        extra = [c for c in info["config"] if not c.startswith("search_path=")]
        sp_cell = ("`" + sp + "`" if sp is not None else "**unset**") + (
            "".join(f"<br>`{c}`" for c in extra))
        lines.append(_row([f"`{obj}`", "yes" if info["security_definer"] else "no", sp_cell,
                           "yes" if info["has_comment"] else "**no**", _short(info["owner"])]
                          + _grant_cols(info["privileges"])))
    lines.append("")
    return "\n".join(lines)


def render_json(matrix: dict[str, Any]) -> str:
    """The matrix as JSON: sorted keys, indent 2, trailing newline."""
    return json.dumps(matrix, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def report(conninfo: str = "", *, as_json: bool = False) -> str:
    """Connect to ``conninfo`` (libpq conventions) and render the matrix."""
    from . import db

    with db.connect(db.resolve_conninfo(conninfo), application_name="qlpg-security") as conn:
        matrix = privilege_matrix(conn)
    return render_json(matrix) if as_json else render_markdown(matrix)


def main(argv: list[str] | None = None) -> int:
    """``python -m qlpg.security report [--json] [--dsn DSN] [-o FILE]``; returns the exit status."""
    ap = argparse.ArgumentParser(prog="qlpg security", description="ql3 role × object privilege matrix")
    sub = ap.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("report", help="print the privilege matrix (markdown, or JSON with --json)")
    rp.add_argument("--json", action="store_true", help="JSON instead of markdown")
    rp.add_argument("--dsn", default=None, help="connection string (default: $DATABASE_URL, then PG* variables)")
    rp.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    args = ap.parse_args(argv)
    from . import errors

    try:
        text = report(args.dsn or "", as_json=args.json)
    except errors.QlpgError as exc:
        print(f"qlpg security report: {exc}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
