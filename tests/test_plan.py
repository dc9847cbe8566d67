"""Package facts and the immutable plan at the admission boundary (ADR-0223 §1-2).

* package facts are unreadable to ``ql3_runtime``, ``ql3_package_executor`` and ``ql3_worker_ingress``
  (every SELECT / COPY is 42501) and are written only through ``ql3_package_manager`` functions;
* every invalid plan of ``tests/vectors/plan.json`` is refused by ``ql3.workflow_plan_admit`` with
  the vector's SQLSTATE and writes nothing; the limits hold end to end (128 steps admitted, 129 and
  a > 256 KiB canonical plan refused), and only root steps start ``ready``.
"""

from __future__ import annotations

import json
import re

import psycopg
import pytest

from qlpg import api, errors, install as installmod, plan as planmod

from helpers import check_audit_invariants
from test_plan_support import (DIAMOND, PACKAGE_FACT_TABLES, Driver, chain, install, owner_snapshot, package,
                               row_counts)
from test_plan_vectors import _load

FACT_TABLES = PACKAGE_FACT_TABLES + ("security_boundaries",)
SERVICE_ROLES = ("ql3_runtime", "ql3_package_executor", "ql3_worker_ingress", "ql3_admin", "ql3_package_manager")


@pytest.fixture
def installed(qlpg_db, as_role, ql3_owner):
    """One package with a diamond workflow, one Run admitted and its root completed (facts exist)."""
    pm = as_role("ql3_package_manager")
    install(pm, package("facts", {"wf": DIAMOND}))
    api.package_quarantine(pm, "default", "other-pkg", "test", "tester")
    api.publisher_revoke(pm, "other-publisher", "test", "tester")
    pe = as_role("ql3_package_executor")
    rec = installmod.start_workflow(pe, "default", "facts", "wf")
    Driver(as_role).step_ready()
    counts = row_counts(ql3_owner, FACT_TABLES)
    assert all(counts[t] > 0 for t in FACT_TABLES), counts
    return rec


def test_package_facts_are_unreadable(installed, as_role):
    """SELECT, COPY and whole-row reads of every package-fact table are 42501 for every service role
    (the three the issue names, and the admin and package-manager roles too)."""
    for role in SERVICE_ROLES:
        _unreadable(as_role(role))


def _unreadable(conn):
    for t in FACT_TABLES:
        for stmt in (f"SELECT count(*) FROM ql3.{t}", f"SELECT * FROM ql3.{t} LIMIT 1",
                     f"SELECT to_jsonb(x) FROM ql3.{t} x", f"COPY ql3.{t} TO STDOUT"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                if stmt.startswith("COPY"):
                    with conn.cursor().copy(stmt) as cp:
                        for _ in cp:
                            pass
                else:
                    conn.execute(stmt)
    # and the catalog agrees: no privilege of any kind on any of them
    rows = conn.execute(
        "SELECT t, p FROM unnest(%s::text[]) t, unnest(ARRAY['SELECT','INSERT','UPDATE','DELETE','TRUNCATE',"
        "'REFERENCES','TRIGGER']) p WHERE has_table_privilege('ql3.' || t, p)", (list(FACT_TABLES),)).fetchall()
    assert rows == []


def test_package_facts_are_written_only_by_package_manager_functions(installed, as_role, ql3_owner):
    # 1. no direct DML, even for the package manager
    pm = as_role("ql3_package_manager")
    for stmt in ("INSERT INTO ql3.package_quarantines VALUES ('default', 'x', 1, 'r', 'a')",
                 "INSERT INTO ql3.publisher_revocations VALUES ('p', 1, 'r', 'a')",
                 "UPDATE ql3.automation_publications SET status = 'active'",
                 "DELETE FROM ql3.automation_publication_heads",
                 "UPDATE ql3.security_boundaries SET version = version + 1",
                 "TRUNCATE ql3.package_quarantines"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            pm.execute(stmt)
    # 2. in the catalog, every function whose source writes a package-fact table is either granted
    #    to ql3_package_manager only, or internal (no grant) and called only by such functions;
    #    task_execution_revisions is also written by ql3_admin's task_revision_insert (ADR-0023 §2).
    funcs = ql3_owner.execute(
        """SELECT p.proname, p.prosrc,
                  ARRAY(SELECT DISTINCT a.grantee::regrole::text FROM aclexplode(p.proacl) a
                         WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner) AS grantees
             FROM pg_proc p WHERE p.pronamespace = 'ql3'::regnamespace""").fetchall()
    writes = re.compile(r"(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+ql3\.(" + "|".join(FACT_TABLES) + r")\b", re.I)
    writers = {name: (src, grantees) for name, src, grantees in funcs if writes.search(src)}
    assert {"package_revision_materialize", "automation_publish", "automation_withdraw", "package_quarantine",
            "publisher_revoke", "task_reconciliation_record"} <= set(writers)
    for name, (src, grantees) in writers.items():
        tables = {m.group(2) for m in writes.finditer(src)}
        if grantees:
            assert grantees == ["ql3_package_manager"], (name, grantees)
            continue
        callers = {n: g for n, s, g in funcs if re.search(rf"ql3\.{name}\s*\(", s) and n != name}
        assert callers, f"internal writer {name} has no caller"
        for caller, g in callers.items():
            allowed = {"ql3_package_manager"} | ({"ql3_admin"} if tables == {"task_execution_revisions"} else set())
            assert set(g) <= allowed and g, (name, caller, g)
    # 3. the package-manager functions refuse every other role (QL601 or no EXECUTE grant)
    for role in ("ql3_runtime", "ql3_package_executor", "ql3_worker_ingress", "ql3_admin"):
        c = as_role(role)
        for call, args in (("ql3.package_quarantine(%s, %s, %s, %s)", ("default", "facts", "r", "a")),
                           ("ql3.publisher_revoke(%s, %s, %s)", ("qlpg-tests", "r", "a")),
                           ("ql3.automation_withdraw(%s, %s)", (installed.receipt["publication_id"], "r")),
                           ("ql3.automation_publish(%s, %s, %s)", ("default", "facts", 1))):
            with pytest.raises(psycopg.Error) as ei:
                with c.transaction():
                    c.execute(f"SELECT * FROM {call}", args)
            assert ei.value.sqlstate in {"QL601", "42501"}, (role, call, ei.value.sqlstate)


def test_invalid_plans_are_refused_at_admission_and_write_nothing(qlpg_db, as_role, ql3_owner):
    """Every invalid vector, sent as package_executor: the vector's SQLSTATE, a message, no row."""
    install(as_role("ql3_package_manager"), package("facts", {"wf": DIAMOND}))
    installmod.start_workflow(as_role("ql3_package_executor"), "default", "facts", "wf")
    pe = as_role("ql3_package_executor")
    before = row_counts(ql3_owner)
    vectors = _load()["invalid"]
    assert len(vectors) >= 20
    for vec in vectors:
        text = vec.get("input_text") or json.dumps(vec["input"])
        with pytest.raises(psycopg.Error) as ei:
            with pe.transaction():
                pe.execute("SELECT * FROM ql3.workflow_plan_admit(%s::json)", (text,))
        assert ei.value.sqlstate == vec["sqlstate"], (vec["name"], str(ei.value))
        assert ei.value.diag.message_primary
    assert row_counts(ql3_owner) == before


def test_128_steps_admitted_129_refused(qlpg_db, as_role, ql3_owner):
    pm = as_role("ql3_package_manager")
    install(pm, package("limits", {"c128": chain(128)}, task_of={k: "t" for k in chain(128)}))
    pe = as_role("ql3_package_executor")
    plan, digest = installmod.prepare_plan(pe, "default", "limits", "c128")
    assert len(plan["steps"]) == 128
    rec = installmod.admit_plan(pe, plan, digest)
    assert len(rec.receipt["step_runs"]) == 128 and rec.receipt["event_sequence"] == 129
    statuses = dict(ql3_owner.execute("SELECT step_key, status FROM ql3.step_runs WHERE run_id = %s",
                                      (rec.run_id,)).fetchall())
    assert statuses == {k: ("ready" if k == "s000" else "pending") for k in chain(128)}
    before = row_counts(ql3_owner)
    # one more step (any id) is 129: refused before anything else is looked at
    extra = dict(plan["steps"][-1], step_key="s128", step_run_id="sr:extra", needs=["s127"])
    big = dict(plan, run_id="run:129", steps=plan["steps"] + [extra])
    with pytest.raises(errors.LimitExceeded):
        planmod.normalize_plan(big)
    with pytest.raises(errors.LimitExceeded, match="more than 128 steps"):
        api.workflow_plan_admit(pe, big)
    # a manifest with 129 steps is refused at materialisation too
    bad = planmod.materialized_document(
        __import__("qlpg.manifest", fromlist=["x"]).parse_manifest(
            package("limits", {"c128": chain(128)}), path="<t>", directory="."))
    bad["workflows"]["c128"]["steps"]["s128"] = {"task": "t-s000", "needs": ["s127"]}
    with pytest.raises(errors.LimitExceeded):
        api.package_revision_materialize(pm, bad)
    assert row_counts(ql3_owner) == before
    check_audit_invariants(ql3_owner, rec.run_id)


def test_plan_over_256_kib_canonical_is_refused(qlpg_db, as_role, ql3_owner):
    """A real, enabled workflow of 100 steps with 64-byte keys, each needing every earlier step: its
    plan's canonical form is > 256 KiB. Python refuses to build it; SQL refuses it (QL002)."""
    keys = [f"k{i:03d}" + "x" * 60 for i in range(100)]
    steps = {k: keys[:i] for i, k in enumerate(keys)}
    install(as_role("ql3_package_manager"), package("huge", {"wf": steps}, task_of={k: "t" for k in keys}))
    pe = as_role("ql3_package_executor")
    with pytest.raises(errors.LimitExceeded, match="256 KiB"):
        installmod.prepare_plan(pe, "default", "huge", "wf")
    snap = api.workflow_admission_snapshot(pe, "default", "huge", "wf")
    run = "run:huge"
    plan = {"schema": planmod.PLAN_SCHEMA, **{k: snap[k] for k in (
        "project_id", "package_id", "installation_id", "lock_digest", "generation", "revision_digest",
        "publication_id", "publication_digest", "workflow_key", "workflow_semantic_digest")}, "run_id": run,
        "steps": [{"step_key": k, "step_run_id": planmod.step_run_id(run, k), "task_key": s["task_key"],
                   "task_reference": s["task_reference"], "source_digest": s["source_digest"],
                   "needs": sorted(s["needs"]), "initial_status": "pending" if s["needs"] else "ready"}
                  for k, s in sorted(snap["steps"].items())]}
    assert len(json.dumps(plan, separators=(",", ":"))) > 256 * 1024
    before = row_counts(ql3_owner)
    with pytest.raises(errors.LimitExceeded, match="256 KiB"):
        api.workflow_plan_admit(pe, plan)
    assert row_counts(ql3_owner) == before


def test_only_roots_are_ready_and_plan_binds_everything(qlpg_db, as_role, ql3_owner):
    wf = {"r1": [], "r2": [], "j": ["r1", "r2"], "k": ["j"], "solo": []}
    install(as_role("ql3_package_manager"), package("roots", {"wf": wf}))
    pe = as_role("ql3_package_executor")
    plan, digest = installmod.prepare_plan(pe, "default", "roots", "wf", "run:roots")
    assert [s["step_key"] for s in plan["steps"]] == sorted(wf)
    for s in plan["steps"]:
        assert s["initial_status"] == ("ready" if not wf[s["step_key"]] else "pending")
        assert s["task_reference"] == f"pkgref:v1:roots:1:t-{s['step_key']}"
    rec = installmod.admit_plan(pe, plan, digest)
    snap = owner_snapshot(ql3_owner, "default", "roots", "wf")
    stored = ql3_owner.execute("SELECT plan FROM ql3.workflow_admissions WHERE run_id = %s", (rec.run_id,)).fetchone()[0]
    assert stored == plan  # the normalised plan is stored as sent (no plan_digest)
    for k in ("project_id", "package_id", "installation_id", "lock_digest", "generation", "revision_digest",
              "publication_id", "publication_digest", "workflow_key", "workflow_semantic_digest"):
        assert stored[k] == snap[k], k
    rows = ql3_owner.execute("SELECT step_key, status, unmet_needs FROM ql3.step_runs WHERE run_id = %s",
                             (rec.run_id,)).fetchall()
    assert {r[0]: (r[1], r[2]) for r in rows} == {k: ("ready" if not n else "pending", len(n)) for k, n in wf.items()}
    check_audit_invariants(ql3_owner, rec.run_id)


def test_security_boundary_rows(qlpg_db, as_role, ql3_owner):
    """Materialisation creates the package and publisher boundary rows; every boundary change bumps its
    row; a read-only snapshot takes no lock; a missing row fails closed (QL501), writing nothing."""
    pm = as_role("ql3_package_manager")
    install(pm, package("rows", {"wf": DIAMOND}, publisher="rows-publisher"))
    rows = dict(ql3_owner.execute("SELECT kind || ':' || id, version FROM ql3.security_boundaries").fetchall())
    assert rows == {"package:default/rows": 2, "publisher:rows-publisher": 1}  # publish bumped the package row
    pe = as_role("ql3_package_executor")
    with pe.transaction():
        pe.execute("SET TRANSACTION READ ONLY")
        snap = pe.execute("SELECT ql3.workflow_admission_snapshot('default', 'rows', 'wf') AS s").fetchone()["s"]
    plan = planmod.build_plan(snap, "run:rows")
    api.package_quarantine(pm, "default", "elsewhere", "test", "tester")  # another package: its own row
    assert ql3_owner.execute("SELECT version FROM ql3.security_boundaries WHERE id = 'default/elsewhere'").fetchone()[0] == 1
    ql3_owner.execute("DELETE FROM ql3.security_boundaries WHERE kind = 'publisher' AND id = 'rows-publisher'")
    before = row_counts(ql3_owner)
    with pytest.raises(errors.IntegrityFailure, match="security boundary rows"):
        installmod.admit_plan(pe, plan, planmod.plan_digest(plan))
    assert row_counts(ql3_owner) == before
    api.publisher_revoke(pm, "rows-publisher", "test", "tester")  # recreates the row (upsert), then revokes
    assert ql3_owner.execute("SELECT version FROM ql3.security_boundaries WHERE id = 'rows-publisher'").fetchone()[0] == 1
    with pytest.raises(errors.StartGuardDenied, match="revoked"):
        installmod.admit_plan(pe, plan, planmod.plan_digest(plan))
