"""Behavioural conformance (issue 6 §3): every role × every ql3 function and table, actually executed.

Privilege tests as data (Supabase style): the functions and tables come from the live catalog, who
may call what comes from tests/security/expected_grants.json, arguments from
tests/security/call_args.json (typed placeholders for functions not listed there). Each call runs
in a transaction that is rolled back, against one database cloned for this module.

A call is *allowed* when it does not fail with 42501 (permission denied) or QL601 (caller not in
role); any other outcome — success or another QL error — proves the caller got past authority.
Everything else must fail with exactly 42501 or QL601.

The membership / SET ROLE scenarios at the end record observed PostgreSQL behaviour; the same
findings are written up in docs/security.md, "Memberships and SET ROLE".
"""

from __future__ import annotations

import os
import uuid

import psycopg
import pytest
from psycopg import sql

from security import support

EXPECTED = support.load_expected()
CALL_ARGS = support.load_call_args()
TABLE_OPS = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE")


@pytest.fixture(scope="module")
def mdb(postgresql_noproc, test_logins):
    yield from support.module_db(postgresql_noproc, test_logins, "behaviour")


@pytest.fixture(scope="module")
def su(mdb):
    return mdb.connect()


@pytest.fixture(scope="module")
def functions(su):
    su.execute("SET search_path = pg_catalog")
    return support.catalog_functions(su)


@pytest.fixture(scope="module")
def tables(su):
    return support.catalog_tables(su)


def test_call_args_name_existing_functions(functions):
    stale = sorted(set(CALL_ARGS) - {f["sig"] for f in functions})
    assert not stale, f"tests/security/call_args.json names functions the catalog does not have: {stale}"


def test_every_granted_function_has_call_args(functions):
    """Granted functions should be exercised with valid-ish arguments, not placeholders."""
    missing = sorted(f["sig"] for f in functions
                     if any(r != support.OWNER for r in EXPECTED["functions"].get(f["sig"], []))
                     and f["sig"] not in CALL_ARGS)
    assert not missing, f"add valid-ish arguments to tests/security/call_args.json for: {missing}"


@pytest.mark.parametrize("role", support.ALL_CALLERS)
def test_function_authority(mdb, functions, role):
    conn = mdb.connect(role)
    wrong = []
    for fn in functions:
        state, msg = support.attempt(conn, support.call_sql(fn, CALL_ARGS.get(fn["sig"])))
        allowed = support.may_call(EXPECTED, fn["sig"], role, fn["definer"])
        if allowed and state in support.DENIED:
            wrong.append(f"{fn['sig']}: granted to {role} but refused: {state} {msg}")
        elif not allowed and state not in support.DENIED:
            wrong.append(f"{fn['sig']}: NOT granted to {role} but got {state or 'success'}: {msg}")
    assert not wrong, f"{len(wrong)} authority violations for {role}:\n" + "\n".join(wrong)


def test_denials_name_the_reason(mdb, functions):
    """A non-member gets 42501 from EXECUTE; the owner calling a definer it is not granted gets QL601."""
    fn = next(f for f in functions if f["sig"] == "ql3.task_attempt_candidates(text,text,integer)")
    state, msg = support.attempt(mdb.connect("ql3_admin"), support.call_sql(fn, CALL_ARGS[fn["sig"]]))
    assert state == "42501" and "permission denied for function task_attempt_candidates" in msg, (state, msg)
    state, msg = support.attempt(mdb.connect("nobody"), support.call_sql(fn, CALL_ARGS[fn["sig"]]))
    assert state == "42501" and "schema ql3" in msg, (state, msg)
    state, msg = support.attempt(mdb.connect("ql3_migration"), support.call_sql(fn, CALL_ARGS[fn["sig"]]))
    assert state == "QL601" and "is not a member of ql3_runtime" in msg, (state, msg)


def _table_sql(t: dict, op: str) -> str:
    name = t["name"]
    if t["relkind"] == "S":
        return {"SELECT": f"SELECT * FROM {name}", "UPDATE": f"SELECT pg_catalog.nextval('{name}')"}.get(op, "")
    return {
        "SELECT": f"SELECT * FROM {name} LIMIT 1",
        "INSERT": f"INSERT INTO {name} DEFAULT VALUES",
        "UPDATE": f"UPDATE {name} SET {t['col']} = {t['col']}",
        "DELETE": f"DELETE FROM {name}",
        "TRUNCATE": f"TRUNCATE {name}",
    }[op]


@pytest.mark.parametrize("role", support.SERVICE_ROLES + ("nobody",))
def test_table_access_denied(mdb, tables, role):
    assert tables, "no ql3 tables in the catalog"
    conn = mdb.connect(role)
    wrong = []
    for t in tables:
        for op in TABLE_OPS:
            stmt = _table_sql(t, op)
            if not stmt:
                continue
            state, msg = support.attempt(conn, stmt)
            if state != "42501":
                wrong.append(f"{op} {t['name']}: {state or 'success'} {msg}")
    assert not wrong, f"{role} reached ql3 tables directly:\n" + "\n".join(wrong)


def test_owner_reaches_tables(mdb, tables):
    """Control: the 42501s above are about privileges, not about the statements being broken."""
    conn = mdb.connect("ql3_migration")
    for t in tables:
        state, msg = support.attempt(conn, _table_sql(t, "SELECT"))
        assert state is None, (t["name"], state, msg)


# ------------------------------------------------------------------ memberships and SET ROLE

RUNTIME_CALL = "SELECT * FROM ql3.task_attempt_candidates(NULL, NULL, 10)"   # granted to ql3_runtime
ADMIN_CALL = "SELECT * FROM ql3.task_revision_resolve('p', 't', 'r')"         # granted to ql3_admin (QL101)
SHARED_CALL = "SELECT * FROM ql3.run_inspect('run-x')"                         # ql3_admin and ql3_runtime (QL101)
EXECUTOR_CALL = "SELECT * FROM ql3.workflow_admission_inspect('run-x', NULL)"  # ql3_package_executor


def _outcome(conn, stmt: str) -> str:
    """'allowed' (past authority: success or a non-authority error), else the SQLSTATE."""
    state, _msg = support.attempt(conn, stmt)
    return "allowed" if state not in support.DENIED else state


@pytest.fixture
def temp_logins(mdb, su):
    """Factory for cluster-wide roles created for one test and dropped after it."""
    made: list[str] = []

    def make(kind: str, *, login: bool = True, inherit: bool = True, member_of: tuple[str, ...] = ()) -> str:
        name = f"qlpg_sec_{kind}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        su.execute(sql.SQL("CREATE ROLE {} {} {}").format(
            sql.Identifier(name), sql.SQL("LOGIN" if login else "NOLOGIN"),
            sql.SQL("INHERIT" if inherit else "NOINHERIT")))
        made.append(name)
        for g in member_of:
            su.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(g), sql.Identifier(name)))
        return name

    yield make
    for name in reversed(made):
        su.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def test_login_in_two_roles_gets_the_union(mdb, temp_logins):
    login = temp_logins("two", member_of=("ql3_admin", "ql3_runtime"))
    conn = mdb.connect(user=login)
    assert _outcome(conn, ADMIN_CALL) == "allowed"
    assert _outcome(conn, RUNTIME_CALL) == "allowed"
    assert _outcome(conn, SHARED_CALL) == "allowed"
    assert _outcome(conn, EXECUTOR_CALL) == "42501"
    # SET ROLE narrows EXECUTE (checked against current_user) but not the in-function role check
    # (session_user): the login now acts with ql3_runtime's privileges only.
    conn.execute("SET ROLE ql3_runtime")
    assert _outcome(conn, RUNTIME_CALL) == "allowed"
    assert _outcome(conn, SHARED_CALL) == "allowed"
    assert _outcome(conn, ADMIN_CALL) == "42501"
    conn.execute("RESET ROLE")
    assert _outcome(conn, ADMIN_CALL) == "allowed"


def test_nested_membership_with_inherit(mdb, temp_logins):
    mid = temp_logins("mid", login=False, inherit=True, member_of=("ql3_runtime",))
    login = temp_logins("nested", member_of=(mid,))
    conn = mdb.connect(user=login)
    assert _outcome(conn, RUNTIME_CALL) == "allowed"
    assert _outcome(conn, ADMIN_CALL) == "42501"
    row = conn.execute("SELECT pg_has_role(session_user, 'ql3_runtime', 'MEMBER') AS m,"
                       " pg_has_role(session_user, 'ql3_runtime', 'USAGE') AS u").fetchone()
    assert row == {"m": True, "u": True}


def test_nested_membership_through_noinherit_role(mdb, temp_logins):
    """MEMBER (what require_role checks) is transitive regardless of INHERIT; privileges are not."""
    mid = temp_logins("midni", login=False, inherit=False, member_of=("ql3_runtime",))
    login = temp_logins("nestedni", member_of=(mid,))
    conn = mdb.connect(user=login)
    row = conn.execute("SELECT pg_has_role(session_user, 'ql3_runtime', 'MEMBER') AS m,"
                       " pg_has_role(session_user, 'ql3_runtime', 'USAGE') AS u").fetchone()
    assert row == {"m": True, "u": False}
    state, msg = support.attempt(conn, RUNTIME_CALL)
    assert state == "42501" and "schema ql3" in msg, (state, msg)   # no inherited USAGE on ql3
    conn.execute("SET ROLE ql3_runtime")                               # allowed: member via the chain
    assert _outcome(conn, RUNTIME_CALL) == "allowed"
    assert _outcome(conn, ADMIN_CALL) == "42501"


def test_noinherit_login_must_set_role(mdb, temp_logins):
    login = temp_logins("noinh", inherit=False, member_of=("ql3_runtime",))
    conn = mdb.connect(user=login)
    assert _outcome(conn, RUNTIME_CALL) == "42501"
    conn.execute("SET ROLE ql3_runtime")
    assert _outcome(conn, RUNTIME_CALL) == "allowed"


def test_set_role_from_superuser_session(mdb):
    conn = mdb.connect()  # superuser
    # Without SET ROLE a superuser passes both checks for every function.
    assert _outcome(conn, ADMIN_CALL) == "allowed"
    assert _outcome(conn, RUNTIME_CALL) == "allowed"
    conn.execute("SET ROLE ql3_runtime")
    assert conn.execute("SELECT current_user AS c, session_user <> current_user AS d").fetchone() == {
        "c": "ql3_runtime", "d": True}
    # EXECUTE is now checked against ql3_runtime; require_role sees the superuser session_user,
    # which pg_has_role reports as a member of every role.
    assert _outcome(conn, RUNTIME_CALL) == "allowed"
    assert _outcome(conn, SHARED_CALL) == "allowed"
    assert _outcome(conn, ADMIN_CALL) == "42501"
    assert _outcome(conn, EXECUTOR_CALL) == "42501"
    state, _ = support.attempt(conn, "SELECT * FROM ql3.runs LIMIT 1")
    assert state == "42501"
    conn.execute("RESET ROLE")


def test_set_role_from_member_login(mdb):
    conn = mdb.connect("ql3_runtime")
    conn.execute("SET ROLE ql3_runtime")
    assert _outcome(conn, RUNTIME_CALL) == "allowed"
    assert _outcome(conn, ADMIN_CALL) == "42501"
    conn.execute("RESET ROLE")
    for target in ("ql3_admin", "ql3_migration"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(target)))
    nobody = mdb.connect("nobody")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        nobody.execute("SET ROLE ql3_runtime")


def test_migration_login_cannot_borrow_service_authority(mdb):
    """The owner's login has EXECUTE on everything (ownership) but require_role still refuses it."""
    conn = mdb.connect("ql3_migration")
    conn.execute("SET ROLE ql3_migration")
    state, msg = support.attempt(conn, RUNTIME_CALL)
    assert state == "QL601", (state, msg)
    state, msg = support.attempt(conn, ADMIN_CALL)
    assert state == "QL601", (state, msg)
    assert _outcome(conn, "SELECT * FROM ql3.readiness()") == "allowed"
