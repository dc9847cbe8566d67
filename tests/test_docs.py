"""docs/api.md is generated from the catalog (`qlpg api-docs`) and must not drift from it.

Regenerate after changing a function, its comment or its grants (review the diff):

    QLPG_UPDATE_DOCS=1 .venv/bin/python -m pytest tests/test_docs.py

(or `qlpg api-docs --output docs/api.md --dsn <a freshly migrated database>`).
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg

from qlpg import doctor

ROOT = Path(__file__).resolve().parents[1]
API_MD = ROOT / "docs" / "api.md"
REGEN = doctor.API_DOCS_REGEN


def _generate(conninfo: str) -> str:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return doctor.api_markdown(conn)


def test_api_md_is_generated_from_the_catalog(qlpg_db):
    text = _generate(qlpg_db.conninfo)
    if os.environ.get("QLPG_UPDATE_DOCS") == "1":
        API_MD.write_text(text, encoding="utf-8")
    assert API_MD.exists(), f"docs/api.md is missing; generate it with: {REGEN}"
    have = API_MD.read_text(encoding="utf-8")
    if have != text:
        diff = "".join(difflib.unified_diff(have.splitlines(keepends=True), text.splitlines(keepends=True),
                                            fromfile="docs/api.md (checked in)", tofile="catalog (qlpg api-docs)"))
        raise AssertionError(f"docs/api.md drifted from the catalog; review the diff and regenerate with: {REGEN}\n\n"
                             + diff[:20000])


def test_api_docs_cli_writes_the_same_text(qlpg_db, tmp_path):
    out = tmp_path / "api.md"
    p = subprocess.run([str(Path(sys.executable).parent / "qlpg"), "api-docs", "--output", str(out),
                        "--dsn", qlpg_db.conninfo], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert out.read_text(encoding="utf-8") == _generate(qlpg_db.conninfo)


def test_api_docs_are_session_independent(qlpg_db):
    """Same text whatever the session's search_path, and the caller's setting is restored."""
    with psycopg.connect(qlpg_db.conninfo, autocommit=True, options="-c search_path=ql3,public") as c:
        text = doctor.api_markdown(c)
        assert c.execute("SHOW search_path").fetchone()[0] == "ql3,public"
    assert text == _generate(qlpg_db.conninfo)
    assert qlpg_db.dbname not in text and "qlpg_t_" not in text


def test_every_api_function_is_documented_for_its_roles(qlpg_db):
    """Each granted function's comment names every role granted EXECUTE and lists its errors."""
    with psycopg.connect(qlpg_db.conninfo, autocommit=True) as c:
        rows = c.execute(
            """SELECT p.oid::regprocedure::text, obj_description(p.oid, 'pg_proc'),
                      ARRAY(SELECT DISTINCT pg_get_userbyid(x.grantee) FROM aclexplode(p.proacl) x
                             WHERE x.privilege_type = 'EXECUTE' AND x.grantee NOT IN (0, p.proowner))
                 FROM pg_proc p WHERE p.pronamespace = 'ql3'::regnamespace AND p.prosecdef""").fetchall()
    assert rows
    bad = []
    for sig, comment, roles in rows:
        comment = comment or ""
        missing = [r for r in roles if r not in comment]
        if missing or not re.search(r"\bErrors\b", comment):
            bad.append(f"{sig}: comment lacks {missing or ''} {'' if re.search(r'Errors', comment) else 'an Errors list'}")
    assert not bad, "COMMENT ON FUNCTION must state role(s) and errors (DESIGN §5):\n" + "\n".join(bad)
