"""Catalog conformance of schema ql3 (issue 6 §2), read from the live catalog — no hand list of functions.

The only hand-written data are tests/security/expected_grants.json (DESIGN §5: who may call what)
and DESIGN §4's list of append-only tables below. Everything else is enumerated from pg_catalog,
so a function, table or grant added later is checked without touching this file.
"""

from __future__ import annotations

import re

import psycopg
import pytest

from qlpg import security
from security import support

GROUP_ROLES = support.GROUP_ROLES
OWNER = support.OWNER
PINNED_SEARCH_PATHS = {"search_path=pg_catalog, pg_temp", 'search_path=""', "search_path="}

# DESIGN §4: "Immutable tables (revisions, receipts, ledgers, events, mutations)", resolved to tables.
APPEND_ONLY = {
    "revisions": {"package_materialized_revisions", "package_revision_tasks", "package_revision_workflows",
                  "task_execution_revisions"},
    "receipts": {"task_reconciliation_receipts", "task_reconciliation_items", "run_attempt_completions"},
    "ledgers": {"workflow_admissions", "workflow_admission_steps", "task_attempt_admissions",
                "package_quarantines", "publisher_revocations"},
    "events": {"run_events"},
    "mutations": {"step_run_mutations"},
    "memos": {"task_revision_verifications"},  # fail-closed verification memo (docs/api-notes.md)
}
EXPECTED_APPEND_ONLY = set().union(*APPEND_ONLY.values())


@pytest.fixture(scope="module")
def mdb(postgresql_noproc, test_logins):
    yield from support.module_db(postgresql_noproc, test_logins, "catalog")


@pytest.fixture(scope="module")
def su(mdb):
    return mdb.connect()


@pytest.fixture(scope="module")
def matrix(su):
    return security.privilege_matrix(su)


@pytest.fixture(scope="module")
def expected():
    return support.load_expected()


def _callable_by_non_owner(info: dict) -> list[str]:
    return [g for g, letters in info["privileges"].items() if g != info["owner"] and "X" in letters]


def test_expected_grants_file_lists_every_catalog_function(matrix, expected):
    catalog = set(matrix["functions"])
    listed = set(expected["functions"])
    missing = sorted(catalog - listed)
    stale = sorted(listed - catalog)
    assert not missing, (
        "functions in schema ql3 missing from tests/security/expected_grants.json: "
        + ", ".join(missing)
        + ". Add each under \"functions\" with the roles DESIGN §5 grants it ([] for an internal, owner-only "
          "helper), and under \"design\" by name if it is part of the public API."
    )
    assert not stale, (
        "tests/security/expected_grants.json lists functions the catalog does not have (renamed or "
        "signature changed?): " + ", ".join(stale)
    )


def test_expected_grants_file_agrees_with_design(expected):
    """Every function of DESIGN §5 present in the file carries exactly DESIGN's roles; others are internal."""
    design = expected["design"]
    bad = []
    for sig, roles in expected["functions"].items():
        name = sig.split("(", 1)[0].removeprefix("ql3.")
        want = design.get(name, [])
        if sorted(roles) != sorted(want):
            bad.append(f"{sig}: file {roles} vs design {want}")
    assert not bad, "expected_grants.json 'functions' disagrees with its 'design' (DESIGN §5): " + "; ".join(bad)


def test_catalog_execute_grants_equal_expected(matrix, expected):
    bad = []
    for sig, info in matrix["functions"].items():
        want = set(expected["functions"].get(sig, [])) - {info["owner"]}
        have = set(_callable_by_non_owner(info))
        if have != want:
            bad.append(f"{sig}: catalog grants EXECUTE to {sorted(have)}, expected {sorted(want)}")
    assert not bad, "EXECUTE grants differ from tests/security/expected_grants.json:\n" + "\n".join(bad)


def test_no_grants_to_foreign_roles(su):
    rows = security.foreign_grants(su)
    assert rows == [], f"privileges on ql3 objects held by roles outside the six group roles: {rows}"


def test_granted_functions_are_hardened(su, matrix):
    """Every function a non-owner may execute: SECURITY DEFINER, owner ql3_migration, pinned search_path,
    ql3.require_role( in its body, and a COMMENT."""
    bodies = {r["sig"]: r for r in su.execute(
        "SELECT p.oid::pg_catalog.regprocedure::text AS sig, p.prosrc, l.lanname"
        "  FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang"
        " WHERE p.pronamespace = 'ql3'::pg_catalog.regnamespace").fetchall()}
    # regprocedure text depends on search_path; the module connection has the default one, which
    # does not include ql3, so both sides are schema-qualified.
    problems = []
    granted = [sig for sig, info in matrix["functions"].items() if _callable_by_non_owner(info)]
    assert granted, "no ql3 function is granted to anyone: the catalog is empty or unreadable"
    for sig in granted:
        info = matrix["functions"][sig]
        if not info["security_definer"]:
            problems.append(f"{sig}: not SECURITY DEFINER")
        if info["owner"] != OWNER:
            problems.append(f"{sig}: owned by {info['owner']}, not {OWNER}")
        sp = [c for c in info["config"] if c.startswith("search_path=")]
        if len(sp) != 1 or sp[0] not in PINNED_SEARCH_PATHS:
            problems.append(f"{sig}: search_path not pinned to 'pg_catalog, pg_temp' (proconfig {info['config']})")
        if not info["has_comment"]:
            problems.append(f"{sig}: no COMMENT ON FUNCTION")
        src = bodies[sig]["prosrc"]
        if not re.search(r"\bql3\.require_role\s*\(", src):
            problems.append(f"{sig}: body does not call ql3.require_role( (caller role check)")
        if bodies[sig]["lanname"] != "plpgsql":
            problems.append(f"{sig}: language {bodies[sig]['lanname']}, expected plpgsql")
    assert not problems, "granted ql3 functions that are not hardened:\n" + "\n".join(problems)


def test_require_role_checks_session_user_membership(su):
    src = su.execute("SELECT prosrc FROM pg_catalog.pg_proc WHERE oid = 'ql3.require_role(text, text[])'::regprocedure"
                     ).fetchone()["prosrc"]
    assert re.search(r"pg_has_role\(\s*session_user\s*,\s*r\s*,\s*'MEMBER'\s*\)", src, re.I), src
    assert "QL601" in src


def test_every_function_has_a_comment_and_pinned_search_path(matrix):
    """Not only the granted ones: internal helpers must also be safe to call from a definer."""
    bad = [f"{sig}: comment={info['has_comment']} config={info['config']}"
           for sig, info in matrix["functions"].items()
           if not info["has_comment"] or not any(c in PINNED_SEARCH_PATHS for c in info["config"])]
    assert not bad, "\n".join(bad)


def test_public_has_nothing(matrix):
    leaks = []
    for kind in ("schema", "relations", "columns", "functions"):
        for obj, info in matrix[kind].items():
            if info["privileges"].get("PUBLIC"):
                leaks.append(f"{kind} {obj}: PUBLIC has {info['privileges']['PUBLIC']}")
    assert not leaks, "PUBLIC holds privileges in ql3:\n" + "\n".join(leaks)


def test_schema_usage_only_for_the_six(matrix):
    privs = matrix["schema"]["ql3"]["privileges"]
    assert matrix["schema"]["ql3"]["owner"] == OWNER
    assert privs[OWNER] == "UC"
    for role in support.SERVICE_ROLES:
        assert privs.get(role) == "U", f"{role} on schema ql3: {privs.get(role)!r} (expected USAGE only)"


def test_no_service_role_has_table_or_sequence_privilege(matrix):
    leaks = []
    for kind in ("relations", "columns"):
        for obj, info in matrix[kind].items():
            for g, letters in info["privileges"].items():
                if g != info.get("owner", OWNER) and letters:
                    leaks.append(f"{obj}: {g} has {letters}")
    assert not leaks, "table/sequence privileges held by non-owners:\n" + "\n".join(leaks)


def test_relations_owned_by_migration(matrix):
    bad = [f"{obj}: owner {info['owner']}" for obj, info in matrix["relations"].items() if info["owner"] != OWNER]
    assert not bad, "\n".join(bad)


def _append_only_tables(su) -> dict[str, dict]:
    rows = su.execute(
        """
        SELECT c.relname,
               pg_catalog.obj_description(c.oid, 'pg_class') AS comment,
               ARRAY(SELECT t.tgname || ':' || t.tgtype::int || ':' || t.tgenabled::text || ':' || t.tgfoid::regproc::text
                       FROM pg_catalog.pg_trigger t WHERE t.tgrelid = c.oid AND NOT t.tgisinternal) AS triggers
          FROM pg_catalog.pg_class c
         WHERE c.relnamespace = 'ql3'::pg_catalog.regnamespace AND c.relkind IN ('r', 'p')
        """).fetchall()
    out = {}
    for r in rows:
        names = {t.split(":", 1)[0] for t in r["triggers"]}
        if (r["comment"] or "").startswith("Append-only") or f"{r['relname']}_immutable" in names:
            out[r["relname"]] = r
    return out


def test_append_only_tables_match_design(su):
    found = set(_append_only_tables(su))
    assert found == EXPECTED_APPEND_ONLY, (
        f"append-only tables (comment 'Append-only' or trigger <table>_immutable) differ from DESIGN §4: "
        f"missing {sorted(EXPECTED_APPEND_ONLY - found)}, unexpected {sorted(found - EXPECTED_APPEND_ONLY)}")


# pg_trigger.tgtype bits (src/include/catalog/pg_trigger.h)
ROW, BEFORE, INSERT, DELETE, UPDATE, TRUNCATE = 1, 2, 4, 8, 16, 32


def test_append_only_tables_have_enabled_guards(su):
    problems = []
    for name, r in sorted(_append_only_tables(su).items()):
        trig = [t.split(":") for t in r["triggers"]]
        row_guard = [t for t in trig if int(t[1]) & ROW and int(t[1]) & BEFORE and int(t[1]) & UPDATE
                     and int(t[1]) & DELETE and t[2] in ("O", "A")]
        trunc_guard = [t for t in trig if not int(t[1]) & ROW and int(t[1]) & BEFORE and int(t[1]) & TRUNCATE
                       and t[2] in ("O", "A")]
        if not row_guard:
            problems.append(f"{name}: no enabled BEFORE UPDATE OR DELETE row trigger ({r['triggers']})")
        if not trunc_guard:
            problems.append(f"{name}: no enabled BEFORE TRUNCATE trigger ({r['triggers']})")
        if not (r["comment"] or "").startswith("Append-only"):
            problems.append(f"{name}: COMMENT ON TABLE does not say 'Append-only'")
    assert not problems, "\n".join(problems)


def test_owner_truncate_of_append_only_table_fails_loudly(mdb, su):
    """Even the owner: TRUNCATE of every append-only table is refused (QL201 trigger, or 0A000 FK)."""
    mig = mdb.connect("ql3_migration")
    bad = []
    for name in sorted(EXPECTED_APPEND_ONLY):
        state, msg = support.attempt(mig, f"SET LOCAL ROLE ql3_migration; TRUNCATE ql3.{name}")
        if state not in ("QL201", "0A000"):
            bad.append(f"{name}: {state} {msg}")
    assert not bad, "\n".join(bad)


def test_default_privileges_revoke_public_execute(matrix):
    entries = matrix["default_privileges"]
    assert "ql3_migration functions" in entries, entries
    assert "PUBLIC" not in entries["ql3_migration functions"]


def test_function_created_later_by_owner_is_not_public(mdb):
    """Prove the default ACL: a function the owner creates later is not executable by PUBLIC or a service role."""
    own = mdb.connect("ql3_migration")
    own.execute("SET ROLE ql3_migration")
    own.execute("CREATE FUNCTION ql3.qlpg_sec_probe_later() RETURNS int LANGUAGE sql AS 'SELECT 1'")
    try:
        acl = own.execute("SELECT proacl::text[] AS acl FROM pg_catalog.pg_proc"
                          " WHERE oid = 'ql3.qlpg_sec_probe_later()'::regprocedure").fetchone()["acl"]
        assert acl is not None and not any(a.startswith("=") for a in acl), acl
        for role in ("ql3_runtime", "nobody"):
            conn = mdb.connect(role)
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT ql3.qlpg_sec_probe_later()")
        ok = own.execute("SELECT pg_catalog.has_function_privilege('public', 'ql3.qlpg_sec_probe_later()',"
                         " 'EXECUTE') AS x").fetchone()["x"]
        assert ok is False
    finally:
        own.execute("DROP FUNCTION ql3.qlpg_sec_probe_later()")


def test_group_roles_have_no_elevated_attributes(matrix):
    bad = []
    for role in GROUP_ROLES:
        attrs = matrix["roles"][role]
        if attrs is None:
            bad.append(f"{role}: missing")
            continue
        for a in ("super", "createdb", "createrole", "replication", "bypassrls", "canlogin"):
            if attrs[a]:
                bad.append(f"{role}: {a}")
    assert not bad, "group roles must be NOLOGIN without SUPERUSER/CREATEDB/CREATEROLE/REPLICATION/BYPASSRLS: " + ", ".join(bad)


def test_group_roles_are_not_members_of_each_other(matrix):
    assert matrix["memberships"] == []


def test_test_logins_hold_exactly_one_group_role(su, test_logins):
    """The fixture logins mirror production: each login is a member of exactly one ql3 role."""
    for role, login in test_logins.items():
        groups = su.execute(
            "SELECT ARRAY(SELECT g.rolname FROM pg_catalog.pg_auth_members m JOIN pg_catalog.pg_roles g"
            " ON g.oid = m.roleid WHERE m.member = r.oid AND g.rolname LIKE 'ql3%%' ORDER BY 1) AS g"
            " FROM pg_catalog.pg_roles r WHERE r.rolname = %s", (login,)).fetchone()["g"]
        assert groups == ([] if role == "nobody" else [role]), (login, groups)


def test_readiness_agrees(mdb):
    """ql3.readiness() (the doctor's view) reports the same properties as ok."""
    conn = mdb.connect("ql3_runtime")
    rows = {r["check"]: r for r in conn.execute("SELECT * FROM ql3.readiness()").fetchall()}
    for check in ("roles_present", "roles_least_privilege", "function_security", "immutability_triggers",
                  "no_table_privileges"):
        assert rows[check]["ok"], rows[check]
