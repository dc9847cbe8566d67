"""`qlpg doctor` and `qlpg api-docs`.

``run_checks`` returns the rows of ``ql3.readiness()`` (as whichever login connects; it must be
in one of the six roles, or a superuser) plus checks only the shell can make: the grants golden
file ``docs/security/grants.md`` (``grants-pg17plus.md`` on PostgreSQL 17+, see
:data:`qlpg.security.GOLDEN_FILES`) equals the live privilege matrix, every immutable record's digest
still verifies (``verify_digests``), the deployed function files equal ``sql/functions``, and the
planner statistics of the ``ql3`` tables are not stale (``planner_statistics``).
``$QLPG_GRANTS_GOLDEN`` names another golden file to compare with (e.g. a deployment's own).
"""

from __future__ import annotations

from pathlib import Path

import psycopg

from . import api, db, ha
from .paths import sql_dir


def _golden_path(server_version_num: int) -> Path:
    """The grants golden file to compare with: ``$QLPG_GRANTS_GOLDEN`` if set, else the checked-in one."""
    import os

    if os.environ.get("QLPG_GRANTS_GOLDEN"):
        return Path(os.environ["QLPG_GRANTS_GOLDEN"])
    from .security import golden_file_name

    return sql_dir().parent / "docs" / "security" / golden_file_name(server_version_num)


def _golden_row(golden: Path, live: str) -> dict:
    """The ``grants_golden_file`` row: ok when ``golden`` equals ``live``; else what differs, briefly."""
    if not golden.exists():
        return {"check": "grants_golden_file", "ok": False,
                "detail": f"{golden} not found: generate it with `qlpg security report -o` or "
                          "QLPG_UPDATE_GOLDEN=1 pytest tests/test_security_golden.py"}
    have = golden.read_text(encoding="utf-8")
    if have == live:
        return {"check": "grants_golden_file", "ok": True, "detail": f"{golden} matches the live catalog"}
    import difflib

    changed = [ln for ln in difflib.unified_diff(have.splitlines(), live.splitlines(), lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    shown = "; ".join(ln[:160] for ln in changed[:4])
    return {"check": "grants_golden_file", "ok": False,
            "detail": f"{golden} DIFFERS from the live catalog ({len(changed)} changed line(s); '-' golden, "
                      f"'+' live): {shown}{' …' if len(changed) > 4 else ''} — `qlpg security report` shows "
                      "the full matrix"}


# A ql3 table whose statistics describe a tiny table (fewer than STALE_MAX_PAGES pages) while it
# holds at least STALE_MIN_ROWS live rows, more than STALE_FACTOR times what the statistics say,
# fails ``planner_statistics``.
STALE_MIN_ROWS = 1000
STALE_FACTOR = 10
STALE_MAX_PAGES = 10

_STALE_Q = """
SELECT c.relname, c.reltuples::bigint AS reltuples, s.n_live_tup
  FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_stat_all_tables s ON s.relid = c.oid
 WHERE c.relnamespace = 'ql3'::pg_catalog.regnamespace AND c.relkind = 'r'
   AND c.reltuples >= 0 AND c.relpages < %(pages)s
   AND s.n_live_tup >= %(min)s AND s.n_live_tup > %(factor)s * GREATEST(c.reltuples, 1)
 ORDER BY s.n_live_tup DESC, c.relname
"""


def planner_statistics_row(conn: psycopg.Connection) -> dict:
    """The ``planner_statistics`` check: ``{check, ok, detail}``.

    Fails when a ``ql3`` table was last analyzed (or vacuumed) while it was tiny -- its statistics
    say fewer than :data:`STALE_MAX_PAGES` pages -- and has since grown past :data:`STALE_MIN_ROWS`
    live rows and :data:`STALE_FACTOR` times its ``pg_class.reltuples``. Long-lived sessions may
    then still run the step functions' generic plans cached while the table was tiny (sequential
    scans), and every step reads the whole table, until ANALYZE (autovacuum's, or a DBA's)
    invalidates those plans. It is a proxy: an autovacuum that merely lags on a table that was
    already large is not flagged (its plans use the indexes), and a table never analyzed
    (``reltuples = -1``) is not either (the planner assumes 10 pages and uses the indexes). Reads
    only ``pg_class`` and ``pg_stat_all_tables`` (any login); ``n_live_tup`` is the statistics
    system's estimate and can lag by up to a minute, and is empty after a crash restart or on a
    standby. Source: docs/operations.md "Planner statistics".
    """
    rows = conn.execute(_STALE_Q, {"min": STALE_MIN_ROWS, "factor": STALE_FACTOR, "pages": STALE_MAX_PAGES}).fetchall()
    if not rows:
        return {"check": "planner_statistics", "ok": True,
                "detail": "no ql3 table has outgrown its planner statistics"}
    shown = ", ".join(f"ql3.{r['relname']} (statistics {r['reltuples']:,} rows, live ~{r['n_live_tup']:,})"
                      for r in rows[:5])
    return {"check": "planner_statistics", "ok": False,
            "detail": f"stale planner statistics: {shown}{' …' if len(rows) > 5 else ''}; cached plans of the "
                      "step functions may scan these tables sequentially. Run ANALYZE on them as the owner "
                      "(autovacuum's analyze does it once it runs); see docs/operations.md \"Planner statistics\""}


def run_checks(conninfo: str) -> list[dict]:
    """All checks as rows ``{check, ok, detail}``."""
    rows: list[dict] = []
    with db.connect(conninfo, application_name="qlpg-doctor") as conn:
        rows.extend(dict(r) for r in api.readiness(conn))
        rows.append(ha.durability_check(conn))
        rows.append(planner_statistics_row(conn))
        try:
            from . import security

            live = security.render_markdown(security.privilege_matrix(conn))
            rows.append(_golden_row(_golden_path(conn.info.server_version), live))
        except (ImportError, psycopg.Error) as exc:
            rows.append({"check": "grants_golden_file", "ok": False, "detail": f"could not compare: {exc}"})
        try:
            from .migrate import functions_digest

            files = sorted((sql_dir() / "functions").glob("*.sql"))
            digest = functions_digest(files)
            have = conn.execute("SELECT digest FROM ql3.function_deployments ORDER BY applied_at_ms DESC LIMIT 1").fetchone()
            ok = have is not None and have["digest"] == digest
            rows.append({"check": "functions_deployed", "ok": ok,
                         "detail": "deployed functions equal sql/functions" if ok else "sql/functions differ from the deployed set: run qlpg migrate"})
        except psycopg.Error as exc:
            conn.rollback()
            rows.append({"check": "functions_deployed", "ok": True,
                         "detail": f"not readable by this login ({exc.diag.sqlstate}); checked by readiness instead"})
        try:
            from .verify import verify_digests

            bad = verify_digests(conn)
            rows.append({"check": "immutable_digests", "ok": not bad,
                         "detail": "every stored receipt, plan and revision digest verifies" if not bad
                         else f"{len(bad)} record(s) fail: " + "; ".join(bad[:5])})
        except psycopg.errors.InsufficientPrivilege:
            conn.rollback()
            rows.append({"check": "immutable_digests", "ok": True,
                         "detail": "skipped: needs the owner or a superuser (tables are unreadable to service roles)"})
    return rows


API_DOCS_REGEN = "QLPG_UPDATE_DOCS=1 .venv/bin/python -m pytest tests/test_docs.py"
_API_ROLES = ("ql3_admin", "ql3_package_manager", "ql3_package_executor", "ql3_runtime", "ql3_worker_ingress",
              "ql3_migration")

_API_Q = """
SELECT p.proname AS name, p.oid::pg_catalog.regprocedure::text AS sig,
       pg_catalog.pg_get_function_arguments(p.oid) AS args,
       pg_catalog.pg_get_function_result(p.oid) AS result,
       p.provolatile::text AS volatility, p.proisstrict AS strict,
       pg_catalog.obj_description(p.oid, 'pg_proc') AS comment,
       ARRAY(SELECT DISTINCT pg_catalog.pg_get_userbyid(x.grantee)
               FROM pg_catalog.aclexplode(COALESCE(p.proacl, pg_catalog.acldefault('f', p.proowner))) x
              WHERE x.privilege_type = 'EXECUTE' AND x.grantee <> p.proowner AND x.grantee <> 0
              ORDER BY 1) AS roles,
       EXISTS (SELECT 1 FROM pg_catalog.aclexplode(COALESCE(p.proacl, pg_catalog.acldefault('f', p.proowner))) x
                WHERE x.privilege_type = 'EXECUTE' AND x.grantee = 0) AS public
  FROM pg_catalog.pg_proc p
 WHERE p.pronamespace = 'ql3'::pg_catalog.regnamespace AND p.prosecdef
 ORDER BY p.proname, 2
"""


def api_markdown(conn: psycopg.Connection) -> str:
    """``docs/api.md`` generated from the catalog: every SECURITY DEFINER ql3 function, by role.

    Each function: its signature with argument names and defaults, result type, volatility, the
    roles granted EXECUTE, and its ``COMMENT ON FUNCTION`` text verbatim. Deterministic and
    independent of the session's search_path (pinned to ``pg_catalog`` while reading, so every name
    is schema-qualified), so the checked-in file can be compared byte for byte.
    """
    saved = conn.execute("SELECT pg_catalog.current_setting('search_path') AS s").fetchone()
    saved = saved["s"] if isinstance(saved, dict) else saved[0]
    conn.execute("SELECT pg_catalog.set_config('search_path', 'pg_catalog', false)")
    try:
        cur = conn.execute(_API_Q)
        cols = [d.name for d in cur.description]
        rows = [r if isinstance(r, dict) else dict(zip(cols, r)) for r in cur.fetchall()]
    finally:
        conn.execute("SELECT pg_catalog.set_config('search_path', %s, false)", (saved,))

    vol = {"i": "IMMUTABLE", "s": "STABLE", "v": "VOLATILE"}
    by_role: dict[str, list[dict]] = {}
    for r in rows:
        for role in r["roles"] or ["(no role)"]:
            by_role.setdefault(role, []).append(r)
    order = [x for x in _API_ROLES if x in by_role] + sorted(x for x in by_role if x not in _API_ROLES)

    def anchor(r: dict) -> str:
        return r["name"].replace("_", "-") if sum(x["name"] == r["name"] for x in rows) == 1 else (
            r["name"] + "-" + str([x["sig"] for x in rows if x["name"] == r["name"]].index(r["sig"]) + 1)).replace("_", "-")

    out = ["# qlpg SQL API (schema `ql3`)", "",
           "<!-- Generated from the live catalog by `qlpg api-docs --output docs/api.md` (doctor.api_markdown) on a",
           "     freshly migrated database. Do not edit by hand: tests/test_docs.py fails on drift; regenerate with",
           f"     `{API_DOCS_REGEN}`. -->", "",
           "Every `SECURITY DEFINER` function in schema `ql3`: the public API. Each runs as `ql3_migration`",
           "with `search_path = pg_catalog, pg_temp`, checks that the calling login is a member of one of the",
           "roles listed (`QL601` otherwise), and is described by its `COMMENT ON FUNCTION` (role, inputs,",
           "outputs, errors), reproduced verbatim. Errors are the SQLSTATEs of DESIGN §8 (`qlpg.errors` maps",
           "them to Python exceptions). Internal helpers (not SECURITY DEFINER, owner only) are not part of",
           "the API and are not listed. Who may call what is also in the grants golden file",
           "[`docs/security/grants.md`](security/grants.md).", "",
           f"{len(rows)} functions.", "", "## By role", ""]
    for role in order:
        out.append(f"- `{role}`: " + ", ".join(f"[`{r['name']}`](#{anchor(r)})" for r in by_role[role]))
    out += ["", "## Functions", ""]
    for r in rows:
        roles = ", ".join(f"`{x}`" for x in r["roles"]) or "none"
        if r["public"]:
            roles += ", **PUBLIC**"
        out += [f"### {r['name']}", "",
                "```sql", f"ql3.{r['name']}({r['args']})", f"  RETURNS {r['result']}", "```", "",
                f"- granted to: {roles}",
                f"- {vol.get(r['volatility'], r['volatility'])}{', STRICT' if r['strict'] else ''}; "
                f"signature `{r['sig']}`", "",
                (r["comment"] or "**no COMMENT ON FUNCTION**").strip(), ""]
    return "\n".join(out)
