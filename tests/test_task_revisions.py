"""ADR-0023 Task Execution Revisions (issue 3): record shape, append-only writes, exact resolve,
canonical template rules, fail-closed reads, frozen Python results, roles and bad input.

Every test runs against a fresh migrated database (``qlpg_db``) through the real SQL authority,
as the test login of the role that owns the call (``as_role``); the superuser connection
(``ql3_owner``) is used only to inspect the catalog, count rows and corrupt rows on purpose.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
import uuid

import psycopg
import pytest

from qlpg import api, errors, roles
from qlpg.revision import ExecutionRevision, execution_revision_digest

P, T, R = "proj-1", "pkg:demo:build", "qltd:v1:1:" + "ab" * 32
TEMPLATE = {
    "command": ["bash", "-c", "echo hi"],
    "working_directory": "/srv/app",
    "timeout_ms": 30000,
    "env_names": ["PATH", "HOME"],
    "resource_policy": {"max_output_bytes": 1048576, "cpu_ms": 5000},
}
CTX = "ctx:recipe:1"
INSERT_SQL = "SELECT * FROM ql3.task_revision_insert(%s, %s, %s, %s, %s::jsonb, %s)"
RESOLVE_SQL = "SELECT * FROM ql3.task_revision_resolve(%s, %s, %s)"
TABLE = "ql3.task_execution_revisions"
COLUMNS = ["project_id", "task_id", "task_revision", "executor_type", "execution_template", "context_ref",
           "content_digest", "created_at_ms"]


def count_rows(owner, task_id: str | None = None) -> int:
    """Rows in the table (all, or of one task_id)."""
    if task_id is None:
        return owner.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]
    return owner.execute(f"SELECT count(*) FROM {TABLE} WHERE task_id = %s", (task_id,)).fetchone()[0]


def stored(owner, p=None, t=None, r=None) -> dict | None:
    cur = owner.execute(f"SELECT * FROM {TABLE} WHERE project_id = %s AND task_id = %s AND task_revision = %s",
                        (p or P, t or T, r or R))
    row = cur.fetchone()
    return None if row is None else dict(zip([d.name for d in cur.description], row))


# One database for the whole module (cloning one per test would cost ~0.4 s each). Tests stay
# independent by writing under their own task_id (``T``, fixture ``_own_task_id``), so "writes nothing"
# is checked as "the table's row count did not change".
@pytest.fixture(scope="module")
def mdb(postgresql_noproc, test_logins):
    from security import support

    yield from support.module_db(postgresql_noproc, test_logins, "taskrev")


@pytest.fixture(scope="module")
def ql3_owner(mdb):
    """Superuser connection (tuple rows) to the module database."""
    conn = psycopg.connect(mdb.conninfo, autocommit=True)
    yield conn
    conn.close()


@pytest.fixture(scope="module")
def as_role(mdb):
    """``as_role(role)``: a cached autocommit dict-row connection as that role's test login."""
    cache: dict[str, psycopg.Connection] = {}

    def make(role: str) -> psycopg.Connection:
        if role not in cache:
            cache[role] = mdb.connect(role)
        return cache[role]

    return make


@pytest.fixture(scope="module")
def admin(as_role):
    return as_role("ql3_admin")


@pytest.fixture(autouse=True)
def _own_task_id(monkeypatch, ql3_owner):
    """Give each test its own task_id: the module global ``T`` (read by the test bodies at call
    time) is replaced by a fresh id, so tests sharing the module database never meet."""
    monkeypatch.setattr(sys.modules[__name__], "T", "pkg:t:" + uuid.uuid4().hex[:12])


@pytest.fixture
def rows_before(ql3_owner) -> int:
    """Row count of the whole table when the test starts ("writes nothing" = unchanged)."""
    return count_rows(ql3_owner)


# ------------------------------------------------------------------ 1. identity and record (catalog)
def test_record_shape_in_catalog(ql3_owner):
    c = ql3_owner
    cols = c.execute(
        """SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull
             FROM pg_attribute a WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped
            ORDER BY a.attnum""", (TABLE,)).fetchall()
    # Exactly these columns: nothing secret, no env values, no run/attempt/lease/token/pid/log handle.
    assert cols == [("project_id", "text", True), ("task_id", "text", True), ("task_revision", "text", True),
                    ("executor_type", "text", True), ("execution_template", "jsonb", True),
                    ("context_ref", "text", False), ("content_digest", "text", True),
                    ("created_at_ms", "bigint", True)]
    pk = c.execute(
        """SELECT array_agg(a.attname ORDER BY k.ord) FROM pg_index i
             CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
            WHERE i.indrelid = %s::regclass AND i.indisprimary""", (TABLE,)).fetchone()[0]
    assert pk == ["project_id", "task_id", "task_revision"]
    # An index usable for a retention scan by project and creation time.
    idx = c.execute(
        """SELECT (SELECT array_agg(a.attname ORDER BY k.ord) FROM unnest(i.indkey) WITH ORDINALITY k(attnum, ord)
                     JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum)
             FROM pg_index i WHERE i.indrelid = %s::regclass AND NOT i.indisprimary""", (TABLE,)).fetchall()
    assert any(cols[:2] == ["project_id", "created_at_ms"] for (cols,) in idx), idx
    # No foreign key out of the table (nothing mutable can make a revision vanish or change) and
    # nothing references it with a cascading action.
    fks = c.execute("SELECT conname, confdeltype, confupdtype, conrelid::regclass::text FROM pg_constraint"
                    " WHERE contype = 'f' AND (conrelid = %s::regclass OR confrelid = %s::regclass)",
                    (TABLE, TABLE)).fetchall()
    assert [f for f in fks if f[3] == TABLE] == []
    assert all(f[1] in ("a", "r") and f[2] in ("a", "r") for f in fks), fks
    checks = dict(c.execute("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint"
                            " WHERE conrelid = %s::regclass AND contype = 'c'", (TABLE,)).fetchall())
    assert any("local_process" in d and "remote_worker" in d for d in checks.values())
    assert any("[0-9a-f]{64}" in d for d in checks.values())
    # Owned by ql3_migration; no table privilege for anybody else; both immutability triggers on.
    owner, acl = c.execute("SELECT relowner::regrole::text, relacl::text FROM pg_class WHERE oid = %s::regclass",
                           (TABLE,)).fetchone()
    assert owner == "ql3_migration"
    assert acl is None or all(e.startswith("ql3_migration=") for e in acl.strip("{}").split(",")), acl
    trig = dict(c.execute("SELECT tgname, tgenabled FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal",
                          (TABLE,)).fetchall())
    assert trig == {"task_execution_revisions_immutable": "O", "task_execution_revisions_no_truncate": "O"}


def test_plan_uses_retention_index(ql3_owner, admin):
    for i in range(3):
        api.task_revision_insert(admin, P, T, f"r{i}", "local_process", TEMPLATE, None)
    with ql3_owner.transaction():
        ql3_owner.execute("SET LOCAL enable_seqscan = off")
        plan = "\n".join(r[0] for r in ql3_owner.execute(
            f"EXPLAIN SELECT task_id, task_revision FROM {TABLE} WHERE project_id = 'proj-1'"
            " AND created_at_ms < 9999999999999 ORDER BY created_at_ms"))
    assert "task_execution_revisions_retention_idx" in plan, plan


# ------------------------------------------------------------------ 2. append-only writes
def test_insert_then_idempotent_keeps_first_time(ql3_owner, admin):
    first = api.task_revision_insert(admin, P, T, R, "local_process", TEMPLATE, CTX)
    assert first["outcome"] == "inserted"
    assert first["content_digest"] == execution_revision_digest(P, T, R, "local_process", TEMPLATE, CTX)
    row = stored(ql3_owner)
    assert row["created_at_ms"] == first["created_at_ms"]
    assert abs(first["created_at_ms"] - time.time() * 1000) < 60_000
    time.sleep(0.02)  # a re-write would get a later now_ms()
    again = api.task_revision_insert(admin, P, T, R, "local_process", copy.deepcopy(TEMPLATE), CTX)
    assert again == {**first, "outcome": "idempotent"}
    # The same canonical content in another spelling (unknown fields, null optionals) is idempotent too.
    noisy = {**TEMPLATE, "labels": {"a": "b"}, "priority": 1.5, "env": None}
    third = api.task_revision_insert(admin, P, T, R, "local_process", noisy, CTX)
    assert third == {**first, "outcome": "idempotent"}
    assert count_rows(ql3_owner, T) == 1
    assert stored(ql3_owner) == row


@pytest.mark.parametrize("change", [
    ("executor_type", "remote_worker"),
    ("context_ref", "ctx:recipe:2"),
    ("context_ref", None),
    ("command", ["bash", "-c", "echo bye"]),
    ("timeout_ms", 30001),
    ("env_names", ["HOME", "PATH"]),           # order matters: array order is kept
    ("resource_policy", {"max_output_bytes": 1048576}),
    ("working_directory", None),
])
def test_other_content_is_ql201_and_first_record_kept(ql3_owner, admin, change):
    first = api.task_revision_insert(admin, P, T, R, "local_process", TEMPLATE, CTX)
    before = stored(ql3_owner)
    key, value = change
    args = {"executor_type": "local_process", "context_ref": CTX, "template": dict(TEMPLATE)}
    if key in args:
        args[key] = value
    else:
        args["template"][key] = value
    with pytest.raises(errors.ImmutableConflict) as ei:
        api.task_revision_insert(admin, P, T, R, args["executor_type"], args["template"], args["context_ref"])
    assert ei.value.sqlstate == "QL201"
    assert first["content_digest"] in str(ei.value) and R in str(ei.value)
    # Raw SQL gives the same SQLSTATE (no Python involvement).
    with pytest.raises(psycopg.Error) as raw:
        admin.execute(INSERT_SQL, (P, T, R, args["executor_type"], json.dumps(args["template"]), args["context_ref"]))
    assert raw.value.sqlstate == "QL201"
    assert stored(ql3_owner) == before and count_rows(ql3_owner, T) == 1
    assert api.task_revision_resolve(admin, P, T, R).content_digest == first["content_digest"]


def test_identity_is_the_full_triple(ql3_owner, admin):
    """Same task in another project or revision is a separate identity, not a conflict."""
    other = {**TEMPLATE, "command": ["true"]}
    ids = [(P, T, R), ("proj-2", T, R), (P, T + "x", R), (P, T, "r2")]
    outs = [api.task_revision_insert(admin, p, t, r, "local_process", TEMPLATE if i == 0 else other, CTX)
            for i, (p, t, r) in enumerate(ids)]
    assert [o["outcome"] for o in outs] == ["inserted"] * 4
    assert len({o["content_digest"] for o in outs}) == 4  # the digest covers the identity
    assert all(stored(ql3_owner, *i)["content_digest"] == o["content_digest"] for i, o in zip(ids, outs))


# ------------------------------------------------------------------ exact resolve
def test_resolve_exact_record_or_ql101(admin):
    ins = api.task_revision_insert(admin, P, T, R, "remote_worker", TEMPLATE, CTX)
    api.task_revision_insert(admin, P, T, "r-later", "local_process", {"command": ["later"], "timeout_ms": 5}, None)
    rev = api.task_revision_resolve(admin, P, T, R)
    assert isinstance(rev, ExecutionRevision)
    assert rev.to_json() == {"project_id": P, "task_id": T, "task_revision": R, "executor_type": "remote_worker",
                             "execution_template": TEMPLATE, "context_ref": CTX,
                             "content_digest": ins["content_digest"], "created_at_ms": ins["created_at_ms"]}
    raw = admin.execute(RESOLVE_SQL, (P, T, R)).fetchall()
    assert len(raw) == 1 and list(raw[0]) == COLUMNS and raw[0]["execution_template"] == TEMPLATE
    later = api.task_revision_resolve(admin, P, T, "r-later")
    assert later.context_ref is None and later.execution_template["command"] == ("later",)
    # Near misses never fall back to another (e.g. the latest) revision.
    for p, t, r in [(P, T, "r-other"), (P, T, R.upper()), (P, T, R[:-1]), ("proj-2", T, R),
                    (P, T[:-1], R), (P, T, R + "0")]:
        with pytest.raises(errors.Unavailable) as ei:
            api.task_revision_resolve(admin, p, t, r)
        assert ei.value.sqlstate == "QL101" and "unavailable" in str(ei.value)


# ------------------------------------------------------------------ immutability: trigger + grants
MUTATIONS = [
    ("UPDATE", f"UPDATE {TABLE} SET created_at_ms = created_at_ms + 1"),
    ("UPDATE", f"UPDATE {TABLE} SET execution_template = '{{\"command\": [\"rm\"], \"timeout_ms\": 1}}'"),
    ("DELETE", f"DELETE FROM {TABLE}"),
    ("TRUNCATE", f"TRUNCATE {TABLE}"),
]


@pytest.mark.parametrize("as_who", ["superuser", "SET ROLE ql3_migration", "ql3_migration login"])
def test_trigger_refuses_mutation_even_for_owner(ql3_owner, admin, as_role, as_who):
    api.task_revision_insert(admin, P, T, R, "local_process", TEMPLATE, CTX)
    before = stored(ql3_owner)
    conn = as_role("ql3_migration") if as_who == "ql3_migration login" else ql3_owner
    for op, stmt in MUTATIONS:
        with pytest.raises(psycopg.Error) as ei:
            with conn.transaction():
                if as_who == "SET ROLE ql3_migration":
                    conn.execute("SET LOCAL ROLE ql3_migration")
                conn.execute(stmt)
        assert ei.value.sqlstate == "QL201", (op, ei.value)
        assert f"{op} is refused" in str(ei.value)
    assert stored(ql3_owner) == before and count_rows(ql3_owner, T) == 1


@pytest.mark.parametrize("role", [*roles.SERVICE_ROLES, "nobody"])
def test_grants_refuse_every_table_operation(ql3_owner, admin, as_role, role):
    api.task_revision_insert(admin, P, T, R, "local_process", TEMPLATE, CTX)
    before = stored(ql3_owner)
    conn = as_role(role)
    for stmt in [f"SELECT * FROM {TABLE}",
                 f"INSERT INTO {TABLE} VALUES ('p', 't', 'r', 'local_process', '{{}}', NULL, '{'0' * 64}', 1)",
                 *(m for _, m in MUTATIONS),
                 f"INSERT INTO {TABLE} SELECT * FROM {TABLE} ON CONFLICT DO NOTHING"]:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(stmt)
    assert stored(ql3_owner) == before


def test_no_update_upsert_or_delete_function_exists(ql3_owner):
    names = [r[0] for r in ql3_owner.execute(
        "SELECT p.proname FROM pg_proc p WHERE p.pronamespace = 'ql3'::regnamespace AND p.proname LIKE '%%revision%%'")]
    assert set(names) >= {"task_revision_insert", "task_revision_resolve", "task_revision_write",
                          "task_revision_verify"}
    assert not [n for n in names if any(w in n for w in ("update", "upsert", "delete", "replace", "set_"))]
    # Only the four documented writers/readers reach the table in their bodies with INSERT; none UPDATE/DELETE it.
    bodies = ql3_owner.execute(
        "SELECT p.proname, p.prosrc FROM pg_proc p WHERE p.pronamespace = 'ql3'::regnamespace"
        " AND p.prosrc ~* 'task_execution_revisions'").fetchall()
    for name, src in bodies:
        low = " ".join(src.lower().split())
        assert "update ql3.task_execution_revisions" not in low, name
        assert "delete from ql3.task_execution_revisions" not in low, name
        if "insert into ql3.task_execution_revisions" in low:
            assert name == "task_revision_write", name


# ------------------------------------------------------------------ canonical template rules
def test_unknown_fields_dropped_and_deep_copied(ql3_owner, admin):
    tmpl = copy.deepcopy(TEMPLATE)
    tmpl.update({"labels": {"team": "ops"}, "retries": 3, "nested": [{"x": [1, 2]}], "env_names": ["PATH", "HOME"]})
    out = api.task_revision_insert(admin, P, T, R, "local_process", tmpl, CTX)
    # Mutate every nested structure of the caller's input after the insert.
    tmpl["command"].append("--evil")
    tmpl["command"][0] = "rm"
    tmpl["resource_policy"]["max_output_bytes"] = 1
    tmpl["env_names"].append("SECRET")
    tmpl["timeout_ms"] = 1
    row = stored(ql3_owner)
    assert row["execution_template"] == TEMPLATE  # unknown fields gone, nested values as sent
    canon = ql3_owner.execute(f"SELECT ql3.canonical_json(execution_template) FROM {TABLE}").fetchone()[0]
    assert canon == ('{"command":["bash","-c","echo hi"],"env_names":["PATH","HOME"],'
                     '"resource_policy":{"cpu_ms":5000,"max_output_bytes":1048576},'
                     '"timeout_ms":30000,"working_directory":"/srv/app"}')
    rev = api.task_revision_resolve(admin, P, T, R)
    assert rev.content_digest == out["content_digest"]
    assert rev.to_json()["execution_template"] == TEMPLATE
    # A copy handed out by to_json() is independent of the frozen record too.
    j = rev.to_json()
    j["execution_template"]["command"].append("x")
    j["execution_template"]["resource_policy"]["cpu_ms"] = 0
    assert rev.to_json()["execution_template"] == TEMPLATE


def test_python_result_is_deeply_frozen(admin):
    api.task_revision_insert(admin, P, T, R, "local_process", TEMPLATE, CTX)
    rev = api.task_revision_resolve(admin, P, T, R)
    tmpl = rev.execution_template
    with pytest.raises(dataclasses.FrozenInstanceError):
        rev.task_revision = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rev.execution_template = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        tmpl["command"] = ["rm", "-rf", "/"]  # type: ignore[index]
    with pytest.raises(TypeError):
        del tmpl["timeout_ms"]  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        tmpl["command"][0] = "rm"  # type: ignore[index]
    with pytest.raises(AttributeError):
        tmpl["command"].append("--evil")  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        tmpl["env_names"].append("SECRET")  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        tmpl["resource_policy"]["max_output_bytes"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        tmpl["resource_policy"].update(cpu_ms=0)  # type: ignore[attr-defined]
    assert rev.to_json()["execution_template"] == TEMPLATE
    # A second resolve is equal (same shared fact), not affected by anything done to the first.
    assert api.task_revision_resolve(admin, P, T, R) == rev


# ------------------------------------------------------------------ fail-closed reads
def corrupt(owner, set_sql: str, params: tuple = (), *, drop_check: bool = False, where=None) -> None:
    """As superuser, in one transaction: disable the immutability trigger (and optionally the
    executor_type CHECK), damage the row, then restore trigger and check (the check NOT VALID,
    since the damaged row now violates it)."""
    con = "task_execution_revisions_executor_type_check"
    with owner.transaction():
        owner.execute(f"ALTER TABLE {TABLE} DISABLE TRIGGER task_execution_revisions_immutable")
        if drop_check:
            owner.execute(f"ALTER TABLE {TABLE} DROP CONSTRAINT {con}")
        n = owner.execute(f"UPDATE {TABLE} SET {set_sql} WHERE project_id = %s AND task_id = %s AND task_revision = %s",
                          (*params, *(where or (P, T, R)))).rowcount
        assert n == 1
        if drop_check:
            owner.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT {con}"
                          " CHECK (executor_type IN ('local_process', 'remote_worker')) NOT VALID")
        owner.execute(f"ALTER TABLE {TABLE} ENABLE TRIGGER task_execution_revisions_immutable")
    assert owner.execute("SELECT tgenabled FROM pg_trigger WHERE tgname = 'task_execution_revisions_immutable'"
                         " AND tgrelid = %s::regclass", (TABLE,)).fetchone()[0] == "O"


CORRUPTIONS = {
    # name: (SET clause, params, drop executor CHECK, reason expected in the QL501 message)
    "unknown field in stored template": ("execution_template = execution_template || '{\"extra\": 1}'", (), False,
                                         "not canonical"),
    "JSON null optional in stored template": ("execution_template = execution_template || '{\"env_names\": null}'",
                                              (), False, "not canonical"),
    "required field removed": ("execution_template = execution_template - 'timeout_ms'", (), False,
                               "execution_template.timeout_ms: is required"),
    "template not an object": ("execution_template = '[\"bash\"]'", (), False, "must be a JSON object"),
    "timeout out of bounds": ("execution_template = jsonb_set(execution_template, '{timeout_ms}', '86400001')", (),
                              False, "execution_template.timeout_ms"),
    "timeout float": ("execution_template = jsonb_set(execution_template, '{timeout_ms}', '1.5')", (), False,
                      "execution_template.timeout_ms"),
    "negative resource bound": ("execution_template = jsonb_set(execution_template, '{resource_policy,cpu_ms}', '-1')",
                                (), False, "execution_template.resource_policy.cpu_ms"),
    "empty command element": ("execution_template = jsonb_set(execution_template, '{command,0}', '\"\"')", (), False,
                              "execution_template.command[0]"),
    "env value smuggled in": ("execution_template = execution_template || '{\"env\": {\"TOKEN\": \"s3cret\"}}'", (),
                              False, "environment values are not allowed"),
    "env_names NAME=value": ("execution_template = jsonb_set(execution_template, '{env_names,0}', '\"A=b\"')", (),
                             False, "env_names[0]"),
    "command changed, digest stale": ("execution_template = jsonb_set(execution_template, '{command,2}', '\"rm -rf /\"')",
                                      (), False, "content_digest mismatch"),
    "context_ref changed": ("context_ref = 'ctx:other'", (), False, "content_digest mismatch"),
    "context_ref removed": ("context_ref = NULL", (), False, "content_digest mismatch"),
    "executor swapped to the other legal type": ("executor_type = 'remote_worker'", (), False, "content_digest mismatch"),
    "illegal executor type": ("executor_type = 'shell'", (), True, "illegal executor_type"),
    "digest damaged": ("content_digest = %s", ("f" * 64,), False, "content_digest mismatch"),
    "created_at_ms negative": ("created_at_ms = -1", (), False, "damaged created_at_ms"),
    "created_at_ms far future": ("created_at_ms = created_at_ms + 10 * 86400000", (), False, "damaged created_at_ms"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_resolve_fails_closed_on_corruption(ql3_owner, admin, case):
    set_sql, params, drop_check, reason = CORRUPTIONS[case]
    api.task_revision_insert(admin, P, T, R, "local_process", TEMPLATE, CTX)
    good = stored(ql3_owner)
    assert api.task_revision_resolve(admin, P, T, R).content_digest == good["content_digest"]
    corrupt(ql3_owner, set_sql, params, drop_check=drop_check)
    assert stored(ql3_owner) != good  # the damage is really there
    # Raw SQL: QL501, no row.
    with pytest.raises(psycopg.Error) as ei:
        admin.execute(RESOLVE_SQL, (P, T, R)).fetchall()
    assert ei.value.sqlstate == "QL501", ei.value
    assert reason in ei.value.diag.message_primary and R in ei.value.diag.message_primary
    # Python API: IntegrityFailure, nothing returned.
    got = None
    with pytest.raises(errors.IntegrityFailure):
        got = api.task_revision_resolve(admin, P, T, R)
    assert got is None
    # The Python twin refuses the same stored row read directly (it has no database clock, so a
    # future timestamp is SQL's to catch).
    if case != "created_at_ms far future":
        with pytest.raises(errors.IntegrityFailure):
            ExecutionRevision.from_row(stored(ql3_owner))
    # Repairing the row (same route back) makes it resolvable again: the failure came from the damage.
    repair = ", ".join(f"{k} = %s" for k in ("execution_template", "executor_type", "context_ref",
                                             "content_digest", "created_at_ms"))
    corrupt(ql3_owner, repair, (json.dumps(good["execution_template"]), good["executor_type"], good["context_ref"],
                                good["content_digest"], good["created_at_ms"]), drop_check=drop_check)
    assert api.task_revision_resolve(admin, P, T, R).content_digest == good["content_digest"]


def test_corrupted_identity_fails_closed(ql3_owner, admin):
    """A row moved to another identity keeps its old digest: resolving the new identity is QL501."""
    api.task_revision_insert(admin, P, T, R, "local_process", TEMPLATE, CTX)
    corrupt(ql3_owner, "task_revision = 'forged'")
    with pytest.raises(psycopg.Error) as ei:
        admin.execute(RESOLVE_SQL, (P, T, "forged"))
    assert ei.value.sqlstate == "QL501" and "content_digest mismatch" in ei.value.diag.message_primary
    with pytest.raises(errors.IntegrityFailure):
        api.task_revision_resolve(admin, P, T, "forged")
    with pytest.raises(errors.Unavailable):
        api.task_revision_resolve(admin, P, T, R)


# ------------------------------------------------------------------ roles
@pytest.mark.parametrize("role", [*roles.GROUP_ROLES, "nobody"])
def test_insert_and_resolve_only_for_admin(ql3_owner, admin, as_role, role):
    api.task_revision_insert(admin, P, T, R, "local_process", TEMPLATE, CTX)
    conn = as_role(role)
    calls = [(INSERT_SQL, (P, T, "r-role", "local_process", json.dumps(TEMPLATE), None)),
             (RESOLVE_SQL, (P, T, R)),
             # internal helpers are owner-only (no grant to any role)
             ("SELECT * FROM ql3.task_revision_write(%s, %s, %s, %s, %s::jsonb, %s)",
              (P, T, "r-role", "local_process", json.dumps(TEMPLATE), None))]
    for sql_, args in calls:
        if role == "ql3_migration" and "task_revision_write" in sql_:
            continue  # the owner may run its own internal helper (it owns the table anyway): DDL role
        if role == "ql3_admin" and "task_revision_write" not in sql_:
            assert conn.execute(sql_, args).fetchall()
            continue
        with pytest.raises(psycopg.Error) as ei:
            conn.execute(sql_, args)
        # 42501: no EXECUTE grant (or no USAGE on ql3); QL601: the owner's implicit EXECUTE reaches
        # the function but its role check refuses (ql3_migration is not ql3_admin).
        expected = {"42501", "QL601"} if role == "ql3_migration" else {"42501"}
        assert ei.value.sqlstate in expected, (role, sql_, ei.value)
        if role == "ql3_migration" and "task_revision_write" not in sql_:
            assert ei.value.sqlstate == "QL601"
    assert count_rows(ql3_owner, T) == (2 if role == "ql3_admin" else 1)


def test_python_api_surfaces_role_errors(as_role):
    for role in ("ql3_runtime", "ql3_worker_ingress", "ql3_package_manager"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            api.task_revision_insert(as_role(role), P, T, R, "local_process", TEMPLATE, None)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            api.task_revision_resolve(as_role(role), P, T, R)
    with pytest.raises(errors.NotInRole):
        api.task_revision_resolve(as_role("ql3_migration"), P, T, R)


def test_install_path_writes_revisions_as_package_manager(ql3_owner, as_role):
    """The package install path reaches the write path through task_reconciliation_record."""
    from helpers import EXAMPLES
    from qlpg import install

    res = install.install_package(as_role("ql3_package_manager"), EXAMPLES / "fanout")
    rows = ql3_owner.execute(f"SELECT task_id, task_revision, context_ref FROM {TABLE}"
                             " WHERE project_id = 'default' AND task_id LIKE 'pkg:fanout:%%' ORDER BY task_id").fetchall()
    assert len(rows) == len(res.manifest.tasks) and rows
    assert all(t.startswith("pkg:fanout:") and r.startswith("qltd:v1:1:") and c == "qlpkg:default/fanout@1"
               for t, r, c in rows)
    # ... and the admin resolves exactly those, verified.
    admin = as_role("ql3_admin")
    for t, r, _ in rows:
        rev = api.task_revision_resolve(admin, "default", t, r)
        assert rev.task_id == t and rev.executor_type == "local_process"


# ------------------------------------------------------------------ bad input
BIG = "x" * (10 * 1024 * 1024)
GOOD = (P, T, R, "local_process", json.dumps(TEMPLATE), CTX)


def _with(i, v):
    a = list(GOOD)
    a[i] = v
    return tuple(a)


BAD_SQL = {
    # name: (args, sqlstate, text expected in the message)
    "null project_id": (_with(0, None), "QL001", "project_id: must not be null"),
    "null task_id": (_with(1, None), "QL001", "task_id: must not be null"),
    "null task_revision": (_with(2, None), "QL001", "task_revision: must not be null"),
    "null executor_type": (_with(3, None), "QL001", "executor_type"),
    "null template": (_with(4, None), "QL001", "execution_template: must not be null"),
    "empty project_id": (_with(0, ""), "QL001", "project_id"),
    "empty task_id": (_with(1, ""), "QL001", "task_id"),
    "empty task_revision": (_with(2, ""), "QL001", "task_revision"),
    "empty executor_type": (_with(3, ""), "QL001", "executor_type"),
    "empty context_ref": (_with(5, ""), "QL001", "context_ref"),
    "unknown executor_type": (_with(3, "docker"), "QL001", "executor_type: must be local_process or remote_worker"),
    "project_id 37 bytes": (_with(0, "p" * 37), "QL001", "project_id: longer than 36 bytes"),
    "task_id 129 bytes": (_with(1, "t" * 129), "QL001", "task_id: longer than 128 bytes"),
    "task_revision 129 bytes": (_with(2, "r" * 129), "QL001", "task_revision: longer than 128 bytes"),
    "context_ref 1025 bytes": (_with(5, "c" * 1025), "QL001", "context_ref"),
    "project_id not portable": (_with(0, "proj 1"), "QL001", "project_id"),
    "task_id not portable": (_with(1, "-task"), "QL001", "task_id"),
    "template JSON null": (_with(4, "null"), "QL001", "execution_template: must be a JSON object"),
    "template array": (_with(4, '["true"]'), "QL001", "execution_template: must be a JSON object"),
    "template string": (_with(4, '"true"'), "QL001", "execution_template: must be a JSON object"),
    "template number": (_with(4, "1"), "QL001", "execution_template: must be a JSON object"),
    "template empty object": (_with(4, "{}"), "QL001", "execution_template.command: is required"),
    "float timeout 1.5": (_with(4, '{"command": ["true"], "timeout_ms": 1.5}'), "QL001", "execution_template.timeout_ms"),
    "float timeout 1.0": (_with(4, '{"command": ["true"], "timeout_ms": 1.0}'), "QL001", "execution_template.timeout_ms"),
    "timeout 0": (_with(4, '{"command": ["true"], "timeout_ms": 0}'), "QL001", "execution_template.timeout_ms"),
    "timeout string": (_with(4, '{"command": ["true"], "timeout_ms": "1000"}'), "QL001", "execution_template.timeout_ms"),
    "float resource bound": (_with(4, '{"command": ["true"], "timeout_ms": 1, "resource_policy": {"cpu_ms": 2.5}}'),
                             "QL001", "execution_template.resource_policy.cpu_ms"),
    "empty command": (_with(4, '{"command": [], "timeout_ms": 1}'), "QL001", "execution_template.command"),
    "command string": (_with(4, '{"command": "true", "timeout_ms": 1}'), "QL001", "execution_template.command"),
    "command empty element": (_with(4, '{"command": ["true", ""], "timeout_ms": 1}'), "QL001",
                              "execution_template.command[1]"),
    "env value": (_with(4, '{"command": ["true"], "timeout_ms": 1, "env": {"PGPASSWORD": "x"}}'), "QL001",
                  "execution_template.env"),
    "env NAME=value": (_with(4, '{"command": ["true"], "timeout_ms": 1, "env_names": ["PGPASSWORD=x"]}'), "QL001",
                       "execution_template.env_names[0]"),
    "env duplicate": (_with(4, '{"command": ["true"], "timeout_ms": 1, "env_names": ["A", "A"]}'), "QL001",
                      "execution_template.env_names[1]"),
    "10 MB template": (_with(4, json.dumps({"command": [BIG], "timeout_ms": 1})), "QL002",
                       "execution_template: larger than 256 KiB"),
    "10 MB unknown field": (_with(4, json.dumps({"command": ["true"], "timeout_ms": 1, "blob": BIG})), "QL002",
                            "execution_template: larger than 256 KiB"),
    "10 MB project_id": (_with(0, BIG), "QL001", "project_id: longer than 36 bytes"),
    "10 MB task_id": (_with(1, BIG), "QL001", "task_id: longer than 128 bytes"),
    "10 MB task_revision": (_with(2, BIG), "QL001", "task_revision: longer than 128 bytes"),
    "10 MB context_ref": (_with(5, BIG), "QL001", "context_ref"),
    "10 MB executor_type": (_with(3, BIG), "QL001", "executor_type"),
    "5000-byte command element": (_with(4, json.dumps({"command": ["y" * 5000], "timeout_ms": 1})), "QL002",
                                "execution_template.command[0]: longer than 4096 bytes"),
}


@pytest.mark.parametrize("case", list(BAD_SQL))
def test_bad_input_sql(ql3_owner, rows_before, admin, case):
    args, state, text = BAD_SQL[case]
    with pytest.raises(psycopg.Error) as ei:
        admin.execute(INSERT_SQL, args)
    assert ei.value.sqlstate == state, ei.value
    msg = ei.value.diag.message_primary
    assert text in msg, msg
    assert len(msg) < 600  # a clear message, not an echo of the payload
    assert count_rows(ql3_owner) == rows_before


def test_null_context_ref_is_valid(ql3_owner, admin):
    """context_ref is optional: SQL NULL means none (covered by the digest as JSON null)."""
    row = admin.execute(INSERT_SQL, (P, T, R, "local_process", json.dumps(TEMPLATE), None)).fetchone()
    assert row["outcome"] == "inserted"
    assert row["content_digest"] == execution_revision_digest(P, T, R, "local_process", TEMPLATE, None)
    assert count_rows(ql3_owner, T) == 1


@pytest.mark.parametrize("args, state, text", [
    ((None, T, R), "QL001", "project_id: must not be null"),
    ((P, None, R), "QL001", "task_id: must not be null"),
    ((P, T, None), "QL001", "task_revision: must not be null"),
    (("", T, R), "QL001", "project_id"),
    ((P, "", R), "QL001", "task_id"),
    ((P, T, ""), "QL001", "task_revision"),
    (("p" * 37, T, R), "QL001", "project_id: longer than 36 bytes"),
    ((P, BIG, R), "QL001", "task_id: longer than 128 bytes"),
    ((P, T, "r" * 129), "QL001", "task_revision: longer than 128 bytes"),
])
def test_bad_input_resolve(admin, args, state, text):
    with pytest.raises(psycopg.Error) as ei:
        admin.execute(RESOLVE_SQL, args)
    assert ei.value.sqlstate == state and text in ei.value.diag.message_primary


class _NoConnection:
    """Stands in for a connection: any use fails the test (proves nothing was sent)."""

    def __getattr__(self, name):
        raise AssertionError(f"the database was contacted ({name})")


@pytest.mark.parametrize("text, cls, where", [
    ('{"command": ["true"], "command": ["rm", "-rf", "/"], "timeout_ms": 1}', errors.InvalidInput,
     "execution_template.command: duplicate object key"),
    ('{"command": ["true"], "timeout_ms": 1, "resource_policy": {"cpu_ms": 1, "cpu_ms": 2}}', errors.InvalidInput,
     "execution_template.resource_policy.cpu_ms: duplicate object key"),
    ('{"command": ["true"], "timeout_ms": 1, "labels": {"a": 1, "a": 2}}', errors.InvalidInput,
     "execution_template.labels.a: duplicate object key"),
    ('{"command": ["true"], "timeout_ms": 1.5}', errors.InvalidInput, "execution_template.timeout_ms"),
    ('{"command": ["true"], "timeout_ms": 1e3}', errors.InvalidInput, "execution_template.timeout_ms"),
    ('{"command": ["true"], "timeout_ms": NaN}', errors.InvalidInput, "execution_template.timeout_ms"),
    ('{"command": ["true"], "timeout_ms": 1', errors.InvalidInput, "execution_template: invalid JSON"),
    ("[" * 40 + "]" * 40, errors.LimitExceeded, "nesting depth"),
])
def test_json_text_api_rejects_before_sending(ql3_owner, rows_before, admin, text, cls, where):
    with pytest.raises(cls) as ei:
        api.task_revision_insert_json(_NoConnection(), P, T, R, "local_process", text, CTX)
    assert where in str(ei.value)
    with pytest.raises(cls):
        api.task_revision_insert_json(admin, P, T, R, "local_process", text, CTX)
    assert count_rows(ql3_owner) == rows_before
    # Through jsonb the duplicate would silently collapse (last one wins) -- the documented limitation.
    if "duplicate" in where and "command" in where:
        row = admin.execute(INSERT_SQL, (P, T, R, "local_process", text, CTX)).fetchone()
        assert stored(ql3_owner)["execution_template"]["command"] == ["rm", "-rf", "/"]
        assert row["outcome"] == "inserted"


def test_json_text_api_inserts_valid_text(ql3_owner, admin):
    text = json.dumps(TEMPLATE).encode()
    out = api.task_revision_insert_json(admin, P, T, R, "local_process", text, CTX)
    assert out["outcome"] == "inserted"
    assert out["content_digest"] == execution_revision_digest(P, T, R, "local_process", TEMPLATE, CTX)


@pytest.mark.parametrize("args, cls, text", [
    ((None, T, R, "local_process", TEMPLATE, CTX), errors.InvalidInput, "project_id"),
    ((P, "", R, "local_process", TEMPLATE, CTX), errors.InvalidInput, "task_id"),
    ((P, T, R, "local_process", None, CTX), errors.InvalidInput, "execution_template"),
    ((P, T, R, "local_process", [], CTX), errors.InvalidInput, "execution_template: must be a JSON object"),
    ((P, T, R, "local_process", {**TEMPLATE, "timeout_ms": 1.5}, CTX), errors.InvalidInput,
     "execution_template.timeout_ms"),
    ((P, T, R, "local_process", {**TEMPLATE, "command": [BIG]}, CTX), errors.LimitExceeded,
     "execution_template.command[0]"),
    ((P, T, R, "local_process", {**TEMPLATE, "blob": BIG}, CTX), errors.LimitExceeded,
     "execution_template: larger than 256 KiB"),
    ((P, T, R, "local_process", {**TEMPLATE, "blob": object()}, CTX), errors.InvalidInput,
     "execution_template: not representable as JSON"),
    (("p" * 37, T, R, "local_process", TEMPLATE, CTX), errors.InvalidInput, "project_id: longer than 36 bytes"),
    ((P, T, R, "local_process", TEMPLATE, ""), errors.InvalidInput, "context_ref"),
])
def test_bad_input_python_api(ql3_owner, rows_before, admin, args, cls, text):
    with pytest.raises(cls) as ei:
        api.task_revision_insert(admin, *args)
    assert text in str(ei.value)
    assert count_rows(ql3_owner) == rows_before


# ------------------------------------------------------------------ canonical fast path == general walk
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_chars = st.characters(codec="utf-8", exclude_characters="\x00")
_norm_templates = st.fixed_dictionaries(
    {"command": st.lists(st.text(_chars, min_size=1, max_size=8), min_size=1, max_size=5),
     "timeout_ms": st.integers(1, 86_400_000)},
    optional={"working_directory": st.text(_chars, min_size=1, max_size=8),
              "env_names": st.lists(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True), max_size=4,
                                    unique=True),
              "resource_policy": st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True),
                                                 st.integers(0, 2**53 - 1), max_size=4)})
# Shapes the fast path must refuse (and hand to the general walk): unknown keys, nulls, wrong types.
_other_templates = _norm_templates.flatmap(lambda t: st.one_of(
    st.builds(lambda v: {**t, "extra": v}, st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none())),
    st.just({**t, "env_names": None}),
    st.builds(lambda v: {**t, "command": [*t["command"], v]}, st.integers(0, 3)),
    st.builds(lambda v: {**t, "resource_policy": {"Bad-Key": v}}, st.integers(0, 3)),
))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tmpl=st.one_of(_norm_templates, _other_templates),
       ctx=st.one_of(st.none(), st.text(_chars, min_size=1, max_size=6)),
       ident=st.tuples(*(st.text(_chars, min_size=1, max_size=6),) * 3),
       executor=st.sampled_from(["local_process", "remote_worker"]))
def test_canonical_fast_path_equals_general_walk(ql3_owner, tmpl, ctx, ident, executor):
    """ql3.task_revision_canonical (used by write, verify and the digest) is byte-identical to
    ql3.canonical_json of the same document, for normalised templates (fast path) and others."""
    doc = json.dumps({"project_id": ident[0], "task_id": ident[1], "task_revision": ident[2],
                      "executor_type": executor, "execution_template": tmpl, "context_ref": ctx})
    fast, general = ql3_owner.execute(
        "SELECT ql3.task_revision_canonical(%s, %s, %s, %s, %s::jsonb, %s), ql3.canonical_json(%s::json)",
        (*ident, executor, json.dumps(tmpl), ctx, doc)).fetchone()
    assert fast == general
