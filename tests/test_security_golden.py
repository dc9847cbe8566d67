"""The grants golden file (issue 6 §4): docs/security/grants.md must equal `qlpg security report`.

The report is regenerated from a freshly migrated test database; any grant, ownership, SECURITY
DEFINER, search_path or comment change shows up as a reviewable diff of the checked-in file.
Regenerate after an intended change with

    QLPG_UPDATE_GOLDEN=1 pytest tests/test_security_golden.py

One file per server family (PostgreSQL 17 added the owner's implicit MAINTAIN privilege, see
``qlpg.security.GOLDEN_FILES``): ``grants.md`` for 15/16, ``grants-pg17plus.md`` for 17+. Regenerating
on either writes the family's file from the catalog and derives the other one;
``test_golden_files_differ_only_by_owner_maintain`` keeps them in step.

(or `python -m qlpg.security report --dsn <freshly migrated db> -o docs/security/grants.md`).
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg

from qlpg import security

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "docs" / "security"
REGEN = "QLPG_UPDATE_GOLDEN=1 pytest tests/test_security_golden.py"


def golden_for(conn) -> Path:
    """The golden file of the server family ``conn`` talks to."""
    return GOLDEN_DIR / security.golden_file_name(conn.info.server_version)


def test_golden_files_differ_only_by_owner_maintain():
    pre17, pg17 = (GOLDEN_DIR / name for name in security.GOLDEN_FILES)
    assert pre17.exists() and pg17.exists(), f"regenerate with: {REGEN}"
    a, b = pre17.read_text(encoding="utf-8"), pg17.read_text(encoding="utf-8")
    assert security.without_owner_maintain(b) == a and security.with_owner_maintain(a) == b, (
        f"{pre17.name} and {pg17.name} must describe the same grants (they differ only by the owner's implicit "
        f"MAINTAIN on PostgreSQL 17+); regenerate with: {REGEN}")


def test_grants_golden_file(qlpg_db):
    with psycopg.connect(qlpg_db.conninfo, autocommit=True) as conn:
        text = security.render_markdown(security.privilege_matrix(conn))
        GOLDEN = golden_for(conn)
    if os.environ.get("QLPG_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text, encoding="utf-8")
        other = ({*security.GOLDEN_FILES} - {GOLDEN.name}).pop()
        derive = security.without_owner_maintain if GOLDEN.name == security.GOLDEN_FILES[1] else security.with_owner_maintain
        (GOLDEN_DIR / other).write_text(derive(text), encoding="utf-8")
    assert GOLDEN.exists(), f"{GOLDEN.relative_to(ROOT)} is missing; create it with: {REGEN}"
    have = GOLDEN.read_text(encoding="utf-8")
    if have != text:
        diff = "".join(difflib.unified_diff(
            have.splitlines(keepends=True), text.splitlines(keepends=True),
            fromfile=f"{GOLDEN.relative_to(ROOT)} (checked in)", tofile="catalog (qlpg security report)"))
        raise AssertionError(
            f"the privilege matrix drifted from {GOLDEN.relative_to(ROOT)}; review the diff and, if the "
            f"change is intended, regenerate with: {REGEN}\n\n{diff}")


def test_report_is_deterministic_and_session_independent(qlpg_db):
    """Same matrix whatever the session's search_path or login; JSON renders with sorted keys."""
    with psycopg.connect(qlpg_db.conninfo, autocommit=True) as a, \
            psycopg.connect(qlpg_db.conninfo, autocommit=True, options="-c search_path=ql3,public") as b:
        ma, mb = security.privilege_matrix(a), security.privilege_matrix(b)
        assert b.execute("SHOW search_path").fetchone()[0] == "ql3,public"  # restored
    assert ma == mb
    js = security.render_json(ma)
    assert json.loads(js) == ma
    assert js == json.dumps(ma, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    assert qlpg_db.dbname not in js and "qlpg_t_" not in js and "postgres" not in js


def test_cli_report(qlpg_db):
    with psycopg.connect(qlpg_db.conninfo, autocommit=True) as conn:
        GOLDEN = golden_for(conn)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "pyshell"))
    out = subprocess.run([sys.executable, "-m", "qlpg.security", "report", "--dsn", qlpg_db.conninfo],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == GOLDEN.read_text(encoding="utf-8") or not GOLDEN.exists()
    js = subprocess.run([sys.executable, "-m", "qlpg.security", "report", "--json", "--dsn", qlpg_db.conninfo],
                        capture_output=True, text=True, env=env, timeout=60)
    assert js.returncode == 0, js.stderr
    assert "ql3.readiness()" in json.loads(js.stdout)["functions"]
