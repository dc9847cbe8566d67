"""`qlpg roles create-login` / `drop-login` through the real CLI (subprocess, ``--dsn`` superuser).

Logins are cluster-wide: every name here carries this process id and is dropped after the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from conftest import server_conninfo
from security import support

QLPG = str(Path(sys.executable).parent / "qlpg")
GROUP_ROLES = ("ql3_migration", "ql3_admin", "ql3_package_manager", "ql3_package_executor",
               "ql3_runtime", "ql3_worker_ingress")
ELEVATED = ("rolsuper", "rolcreatedb", "rolcreaterole", "rolreplication", "rolbypassrls")


def qlpg(*args: str, dsn: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([QLPG, *args, "--dsn", dsn], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **(env or {})))


@pytest.fixture(scope="module")
def mdb(postgresql_noproc, test_logins):
    """One migrated database for the module (logins are cluster-wide anyway)."""
    yield from support.module_db(postgresql_noproc, test_logins, "rolescli")


@pytest.fixture
def names():
    """Unique login names for this test (dropped afterwards, whatever happened)."""
    made: list[str] = []

    def make(tag: str) -> str:
        name = f"qlpg_t_cli_{tag}_{os.getpid()}"
        made.append(name)
        return name

    yield make
    with psycopg.connect(server_conninfo(), autocommit=True) as c:
        for n in made:
            c.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(n)))
        c.execute("DROP ROLE IF EXISTS qlpg_t_cli_mid_" + str(os.getpid()))


def role_facts(name: str) -> dict | None:
    with psycopg.connect(server_conninfo(), autocommit=True) as c:
        row = c.execute(
            "SELECT rolcanlogin, rolinherit, " + ", ".join(ELEVATED) + ","
            " ARRAY(SELECT g FROM unnest(%s::text[]) g WHERE pg_has_role(r.oid, g, 'MEMBER') ORDER BY g) AS effective,"
            " ARRAY(SELECT m.roleid::regrole::text FROM pg_auth_members m WHERE m.member = r.oid ORDER BY 1) AS direct"
            " FROM pg_roles r WHERE rolname = %s", (list(GROUP_ROLES), name)).fetchone()
    if row is None:
        return None
    cols = ["login", "inherit", *ELEVATED, "effective", "direct"]
    return dict(zip(cols, row))


def test_create_login_is_plain_member_of_exactly_one_role_and_idempotent(mdb, names):
    for role in GROUP_ROLES[1:]:
        name = names(role.removeprefix("ql3_").replace("package_", "pkg"))
        first = qlpg("roles", "create-login", name, "--role", role, dsn=mdb.conninfo)
        assert first.returncode == 0, first.stderr
        assert "created" in first.stdout
        facts = role_facts(name)
        assert facts["login"] and facts["inherit"]
        assert not any(facts[a] for a in ELEVATED), facts
        assert facts["effective"] == [role] and facts["direct"] == [role], facts
    # idempotent: same name, same role
    again = qlpg("roles", "create-login", name, "--role", role, dsn=mdb.conninfo)
    assert again.returncode == 0, again.stderr
    assert "exists" in again.stdout
    assert role_facts(name) == facts
    # the login works, with exactly that role's authority
    with psycopg.connect(mdb.conninfo_for(name), autocommit=True) as c:
        assert {r[0] for r in c.execute("SELECT \"check\" FROM ql3.readiness()")} >= {"roles_present"}
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute("SELECT count(*) FROM ql3.runs")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute("SELECT * FROM ql3.run_inspect('x')")


def test_create_login_refuses_a_second_ql3_role(mdb, names):
    name = names("two")
    assert qlpg("roles", "create-login", name, "--role", "ql3_runtime", dsn=mdb.conninfo).returncode == 0
    other = qlpg("roles", "create-login", name, "--role", "ql3_admin", dsn=mdb.conninfo)
    assert other.returncode != 0
    assert "already a member of ql3_runtime" in other.stderr, other.stderr
    assert role_facts(name)["effective"] == ["ql3_runtime"]


def test_create_login_refuses_a_second_role_held_through_a_chain(mdb, names):
    """A login already in ql3_admin through an intermediate role is refused ql3_runtime too."""
    name = names("chain")
    mid = f"qlpg_t_cli_mid_{os.getpid()}"
    with psycopg.connect(server_conninfo(), autocommit=True) as c:
        c.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(mid)))
        c.execute(sql.SQL("GRANT ql3_admin TO {}").format(sql.Identifier(mid)))
        c.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        c.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(mid), sql.Identifier(name)))
    out = qlpg("roles", "create-login", name, "--role", "ql3_runtime", dsn=mdb.conninfo)
    assert out.returncode != 0 and "already a member of ql3_admin" in out.stderr, out.stderr
    assert role_facts(name)["effective"] == ["ql3_admin"]


def test_create_login_refuses_reserved_and_malformed_names(mdb):
    for bad, why in (("ql3_evil", "ql3_ prefix is reserved"), ("x; DROP ROLE postgres", "must match")):
        out = qlpg("roles", "create-login", bad, "--role", "ql3_runtime", dsn=mdb.conninfo)
        assert out.returncode == 2 and why in out.stderr, (bad, out.returncode, out.stderr)
        assert role_facts(bad) is None


def test_create_login_refuses_unknown_role_and_elevated_existing_user(mdb, names):
    name = names("elev")
    out = qlpg("roles", "create-login", name, "--role", "pg_read_all_data", dsn=mdb.conninfo)
    assert out.returncode == 2 and "must be one of" in out.stderr, out.stderr
    assert role_facts(name) is None
    with psycopg.connect(server_conninfo(), autocommit=True) as c:
        c.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEDB").format(sql.Identifier(name)))
    out = qlpg("roles", "create-login", name, "--role", "ql3_runtime", dsn=mdb.conninfo)
    assert out.returncode != 0 and "not a plain login" in out.stderr, out.stderr
    assert role_facts(name)["effective"] == []


def test_create_login_with_password_from_environment(mdb, names):
    name = names("pw")
    missing = qlpg("roles", "create-login", name, "--role", "ql3_worker_ingress", "--password-env", "QLPG_T_NOPE",
                   dsn=mdb.conninfo)
    assert missing.returncode == 2 and role_facts(name) is None
    ok = qlpg("roles", "create-login", name, "--role", "ql3_worker_ingress", "--password-env", "QLPG_T_PW",
              dsn=mdb.conninfo, env={"QLPG_T_PW": "s3cret-'quote"})
    assert ok.returncode == 0, ok.stderr
    with psycopg.connect(server_conninfo(), autocommit=True) as c:
        assert c.execute("SELECT rolpassword IS NOT NULL FROM pg_authid WHERE rolname = %s", (name,)).fetchone()[0]
    assert "s3cret" not in ok.stdout + ok.stderr


def test_drop_login(mdb, names):
    name = names("drop")
    assert qlpg("roles", "create-login", name, "--role", "ql3_admin", dsn=mdb.conninfo).returncode == 0
    out = qlpg("roles", "drop-login", name, dsn=mdb.conninfo)
    assert out.returncode == 0 and "dropped" in out.stdout, out.stderr
    assert role_facts(name) is None
    again = qlpg("roles", "drop-login", name, dsn=mdb.conninfo)
    assert again.returncode == 0 and "absent" in again.stdout


def test_drop_login_refuses_group_roles(mdb):
    out = qlpg("roles", "drop-login", "ql3_runtime", dsn=mdb.conninfo)
    assert out.returncode == 2 and "reserved" in out.stderr, out.stderr
    assert role_facts("ql3_runtime") is not None


def test_drop_login_refuses_a_role_that_is_not_a_plain_login(mdb, names):
    name = names("nolog")
    with psycopg.connect(server_conninfo(), autocommit=True) as c:
        c.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(name)))
    out = qlpg("roles", "drop-login", name, dsn=mdb.conninfo)
    assert out.returncode != 0 and "not a plain service login" in out.stderr, out.stderr
    assert role_facts(name) is not None


def test_service_login_cannot_create_logins(mdb, names):
    """create-login needs CREATEROLE: as a service login it fails cleanly and creates nothing."""
    name = names("deny")
    out = qlpg("roles", "create-login", name, "--role", "ql3_runtime", dsn=mdb.conninfo_as("ql3_runtime"))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert role_facts(name) is None
