"""`qlpg doctor` and `qlpg api-docs`.

``run_checks`` returns the rows of ``ql3.readiness()`` (as whichever login connects; it must be
in one of the six roles, or a superuser) plus checks only the shell can make: the grants golden
file ``docs/security/grants.md`` equals the live privilege matrix, every immutable record's digest
still verifies (``verify_digests``), and the deployed function files equal ``sql/functions``.
"""

from __future__ import annotations

from pathlib import Path

import psycopg

from . import api, db
from .paths import sql_dir


def _golden_path() -> Path:
    return sql_dir().parent / "docs" / "security" / "grants.md"


def run_checks(conninfo: str) -> list[dict]:
    """All checks as rows ``{check, ok, detail}``."""
    rows: list[dict] = []
    with db.connect(conninfo, application_name="qlpg-doctor") as conn:
        rows.extend(dict(r) for r in api.readiness(conn))
        try:
            from . import security

            live = security.render_markdown(security.privilege_matrix(conn))
            golden = _golden_path()
            if golden.exists():
                same = golden.read_text() == live
                rows.append({"check": "grants_golden_file", "ok": same,
                             "detail": f"{golden} {'matches' if same else 'DIFFERS from'} the live catalog"})
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


def api_markdown(conn: psycopg.Connection) -> str:
    """``docs/api.md`` text generated from the catalog: every granted ql3 function, its roles and comment."""
    rows = conn.execute(
        """
        SELECT p.oid::regprocedure::text AS sig, pg_get_function_result(p.oid) AS result,
               obj_description(p.oid, 'pg_proc') AS comment,
               ARRAY(SELECT DISTINCT x.grantee::regrole::text FROM aclexplode(p.proacl) x
                      WHERE x.privilege_type = 'EXECUTE' AND x.grantee <> p.proowner AND x.grantee <> 0
                      ORDER BY 1) AS roles
          FROM pg_proc p
         WHERE p.pronamespace = 'ql3'::regnamespace AND p.prosecdef
         ORDER BY p.proname, p.oid::regprocedure::text
        """
    ).fetchall()
    out = ["# qlpg SQL API (schema `ql3`)", "",
           "Generated from the live catalog by `qlpg api-docs` (COMMENT ON FUNCTION of every SECURITY DEFINER",
           "function). Do not edit by hand; `tests/test_docs.py` fails when it drifts.", ""]
    for r in rows:
        out += [f"## `{r['sig']}`", "", f"- returns: `{r['result']}`", f"- granted to: {', '.join(r['roles']) or '-'}",
                "", (r["comment"] or "").strip(), ""]
    return "\n".join(out)
