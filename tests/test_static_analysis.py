"""Static analysis (issue 6 §7): plpgsql_check on every plpgsql function, squawk on every migration.

plpgsql_check runs in a scratch database cloned from the session's migrated template, with the
extension created there only, as superuser, with every warning class enabled
(``static_analysis.CHECK_OPTIONS``; docs/security.md §8). One test per SQL source file: it fails on
any finding that is neither accepted in ``tests/security/plpgsql_check_allow.json`` (justified) nor
listed in :data:`KNOWN_FINDINGS` below. Skipped, with the reason, when the server has no
plpgsql_check (``apt-get install postgresql-15-plpgsql-check``, or ``scripts/static-analysis``).

KNOWN_FINDINGS are defects reported to the lead for fixing (files this suite's owner may not edit).
They behave like ``xfail(strict=True)``: the test xfails while every listed finding is still
present, and FAILS as soon as one of them is fixed ("remove it from KNOWN_FINDINGS") — so the list
cannot go stale and cannot hide a new finding in the same file.

squawk runs with ``.squawk.toml`` (project-wide exclusions justified there); KNOWN_SQUAWK works the
same way as KNOWN_FINDINGS.
"""

from __future__ import annotations

import re

import psycopg
import pytest

from security import static_analysis as sa
from security import support

# file -> [(function name, message regex, detail regex or None)] — reported to the lead, to be fixed.
KNOWN_FINDINGS: dict[str, list[tuple[str, str, str | None]]] = {
    # dead parameter: the callers fence the lease before calling, but the completing UPDATE of
    # run_dispatch_leases does not re-check token_sha256 = p_token_sha256 (use it, or drop it)
}

# file -> [(rule, source-line regex)] — reported to the lead, to be fixed in the migration.
KNOWN_SQUAWK: dict[str, list[tuple[str, str]]] = {
    # Accepted, not fixable: 0001 is released (tag v0.1.0) and a released migration never changes
    # (tests/test_upgrade.py::test_released_migrations_are_unchanged). Its statements only create new,
    # empty objects under lock_timeout; every later migration sets statement_timeout.
    "sql/migrations/0001_core_schema.sql": [
        ("require-statement-timeout", r"^ALTER DEFAULT PRIVILEGES")],
}

SOURCE_FILES = [sa._rel(p) for p in sa.source_files()]
MIGRATIONS = [sa._rel(p) for p in sa.migration_files()]


@pytest.fixture(scope="module")
def checked(postgresql_noproc, test_logins):
    """(findings, functions checked) of plpgsql_check over a scratch clone of the migrated template."""
    admin = psycopg.conninfo.make_conninfo(
        "", host=postgresql_noproc.host, port=postgresql_noproc.port, user=postgresql_noproc.user,
        dbname=postgresql_noproc.template_dbname, **({"password": postgresql_noproc.password}
                                                     if postgresql_noproc.password else {}))
    with psycopg.connect(admin, autocommit=True) as c:
        if not sa.extension_available(c):
            version = c.execute("SHOW server_version").fetchone()[0]
            pytest.skip(f"plpgsql_check is not installed on PostgreSQL {version}: "
                        "apt-get install postgresql-15-plpgsql-check (or run scripts/static-analysis)")
    gen = support.module_db(postgresql_noproc, test_logins, "plpgsqlcheck")
    mdb = next(gen)
    try:
        conn = mdb.connect()
        conn.execute("CREATE EXTENSION plpgsql_check SCHEMA public")
        yield sa.plpgsql_check(conn)
    finally:
        gen.close()


def _known_matches(known: tuple, f: sa.Finding) -> bool:
    name, msg, detail = known
    return (f.function.split("(", 1)[0] == name and re.search(msg, f.message) is not None
            and (detail is None or re.search(detail, f.detail or "") is not None))


@pytest.mark.parametrize("path", SOURCE_FILES)
def test_plpgsql_check(checked, path):
    findings, _ = checked
    allow = sa.load_allow()
    mine = [f for f in findings if f.file == path]
    known = KNOWN_FINDINGS.get(path, [])
    unexpected = [f for f in mine if not sa.allowed_by(f, allow) and not any(_known_matches(k, f) for k in known)]
    assert not unexpected, (
        f"plpgsql_check ({sa.CHECK_OPTIONS}) reports {len(unexpected)} finding(s) in {path}; fix them, or, if "
        "one is not a defect, accept it in tests/security/plpgsql_check_allow.json with a justification:\n"
        + "\n".join("  " + f.describe() for f in unexpected))
    fixed = [k for k in known if not any(_known_matches(k, f) for f in mine)]
    assert not fixed, (f"fixed, so remove from KNOWN_FINDINGS in tests/test_static_analysis.py: {path}: {fixed}")
    if known:
        pytest.xfail("known plpgsql_check findings reported to the lead:\n"
                     + "\n".join("  " + f.describe() for f in mine if not sa.allowed_by(f, allow)))


def test_plpgsql_check_covered_every_function(checked):
    findings, names = checked
    assert len(names) >= 40, names
    unlocated = [f.describe() for f in findings if f.file is None]
    assert not unlocated, f"findings whose source file was not found: {unlocated}"
    assert set(KNOWN_FINDINGS) <= set(SOURCE_FILES), set(KNOWN_FINDINGS) - set(SOURCE_FILES)


def test_plpgsql_check_allow_list_is_justified_and_current(checked):
    findings, _ = checked
    allow = sa.load_allow()  # validates fields, justification length and regexes
    stale = sa.unused_allow_entries(findings, allow)
    assert not stale, f"allow-list entries no finding needs any more (remove them): {stale}"


def test_plpgsql_check_detects_a_planted_defect(checked, postgresql_noproc, test_logins):
    """The harness is live: a function with a wrong column and an unused variable is reported."""
    gen = support.module_db(postgresql_noproc, test_logins, "plpgsqlcanary")
    mdb = next(gen)
    try:
        conn = mdb.connect()
        conn.execute("CREATE EXTENSION plpgsql_check SCHEMA public")
        conn.execute("""CREATE FUNCTION ql3.qlpg_sa_canary() RETURNS bigint LANGUAGE plpgsql
                        SET search_path = pg_catalog, pg_temp AS $c$
                        DECLARE v_unused integer; v bigint;
                        BEGIN SELECT r.no_such_column INTO v FROM ql3.runs r; RETURN v; END $c$""")
        found, _ = sa.plpgsql_check(conn)
        mine = [f.message for f in found if f.function == "ql3.qlpg_sa_canary()"]
        assert any("no_such_column" in m for m in mine), mine
        assert any('unused variable "v_unused"' in m for m in mine), mine
    finally:
        gen.close()


# ------------------------------------------------------------------ squawk

@pytest.fixture(scope="module")
def squawked():
    if sa.squawk_binary() is None:
        pytest.skip("squawk is not installed: .venv/bin/pip install -e '.[test]' (PyPI squawk-cli)")
    return sa.squawk()


@pytest.mark.parametrize("path", MIGRATIONS)
def test_squawk(squawked, path):
    mine = [d for d in squawked if d["file"] == path]
    known = KNOWN_SQUAWK.get(path, [])

    def is_known(d):
        return any(d["rule_name"] == rule and re.search(src, d["source"]) for rule, src in known)

    unexpected = [d for d in mine if not is_known(d)]
    assert not unexpected, (
        f"squawk reports {len(unexpected)} finding(s) in {path}; fix them, or justify an exception "
        "(`-- squawk-ignore RULE` before the statement, or a project-wide entry in .squawk.toml):\n"
        + "\n".join("  " + sa.describe_squawk(d) for d in unexpected))
    fixed = [k for k in known if not any(d["rule_name"] == k[0] and re.search(k[1], d["source"]) for d in mine)]
    assert not fixed, f"fixed, so remove from KNOWN_SQUAWK in tests/test_static_analysis.py: {path}: {fixed}"
    if known:
        pytest.xfail("known squawk findings reported to the lead:\n"
                     + "\n".join("  " + sa.describe_squawk(d) for d in mine))


def test_squawk_config_is_used_and_live(tmp_path):
    """squawk reads .squawk.toml (an excluded rule stays quiet) and still flags a planted defect."""
    if sa.squawk_binary() is None:
        pytest.skip("squawk is not installed: .venv/bin/pip install -e '.[test]' (PyPI squawk-cli)")
    bad = tmp_path / "9999_bad.sql"
    bad.write_text("SET LOCAL lock_timeout = '1s';\nSET LOCAL statement_timeout = '1min';\n"
                   "ALTER TABLE ql3.runs ADD COLUMN x integer NOT NULL;\nDROP TABLE ql3.run_events;\n")
    rules = {d["rule_name"] for d in sa.squawk([bad])}
    assert "ban-drop-table" in rules and "adding-required-field" in rules, rules
    assert "prefer-bigint-over-int" not in rules, rules
