"""The step hot path's cheaper digests are the same bytes (DESIGN §6): the hand-written StepRun
digest and the flat-receipt canonicaliser against the general ql3.canonical_json and Python's
RFC 8785; and the fail-closed verification memo never hides an altered revision."""

from __future__ import annotations

import hashlib

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from psycopg.types.json import Jsonb

from qlpg import api, canonical, errors

from helpers import check_audit_invariants
from test_attempt_support import admit_run, install_pkg, roots, start, write_pkg

text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
ints = st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def conn(postgresql_noproc):
    """The migrated template database, read only (pure functions): no per-test database needed."""
    from conftest import server_conninfo

    c = psycopg.connect(server_conninfo(postgresql_noproc.template_dbname), autocommit=True)
    c.execute("SET default_transaction_read_only = on")
    yield c
    c.close()


@SETTINGS
@given(run_id=text, step_run_id=text, step_key=text, task_key=text, status=text,
       version=st.integers(1, 2**31 - 1), count=st.integers(0, 64), ready=st.one_of(st.none(), ints))
def test_step_run_digest_is_canonical(conn, run_id, step_run_id, step_key, task_key, status, version, count, ready):
    doc = {"run_id": run_id, "step_run_id": step_run_id, "step_key": step_key, "task_key": task_key,
           "status": status, "version": version, "attempt_count": count, "ready_at_ms": ready}
    got, general = conn.execute(
        "SELECT ql3.step_run_digest(%s, %s, %s, %s, %s, %s, %s, %s),"
        " ql3.domain_digest('qinglong/step-run-digest@v1', ql3.canonical_json(json_build_object("
        "'run_id', %s::text, 'step_run_id', %s::text, 'step_key', %s::text, 'task_key', %s::text, 'status', %s::text,"
        " 'version', %s::int, 'attempt_count', %s::int, 'ready_at_ms', %s::bigint)))",
        (run_id, step_run_id, step_key, task_key, status, version, count, ready) * 2).fetchone()
    assert got == general == canonical.domain_digest("qinglong/step-run-digest@v1", doc)


flat_values = st.one_of(st.none(), st.booleans(), ints, text)
any_values = st.recursive(flat_values, lambda c: st.one_of(st.lists(c, max_size=3),
                                                           st.dictionaries(text, c, max_size=3)), max_leaves=6)


@SETTINGS
@given(doc=st.one_of(st.dictionaries(st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=12),
                                     flat_values, max_size=12),
                     st.dictionaries(text, any_values, max_size=6)))
def test_flat_canonical_json_equals_the_general_one(conn, doc):
    flat, general = conn.execute("SELECT ql3.canonical_json_flat(%s), ql3.canonical_json(%s::jsonb::json)",
                                 (Jsonb(doc), Jsonb(doc))).fetchone()
    assert flat == general == canonical.canonical_bytes(doc).decode()


def test_tampered_revision_is_refused_although_it_was_verified_before(qlpg_db, as_role, ql3_owner, tmp_path):
    """The memo remembers the SHA-256 of the exact stored row: a row changed afterwards (here by the
    owner with the immutability trigger disabled) misses it and fails verification (QL501)."""
    pkg = write_pkg(tmp_path, "memo", {"wide": roots(3)})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "wide")
    rt, wk = as_role("ql3_runtime"), as_role("ql3_worker_ingress")
    admit_run(rt, run_id)
    memo = ql3_owner.execute("SELECT row_sha256 FROM ql3.task_revision_verifications").fetchall()
    row = ql3_owner.execute("SELECT to_jsonb(r)::text FROM ql3.task_execution_revisions r").fetchone()[0]
    assert memo == [(hashlib.sha256(row.encode()).hexdigest(),)]
    (l,) = api.lease_acquire(wk, "w", "local_process", 1, 30000)  # memo hit
    ql3_owner.execute("ALTER TABLE ql3.task_execution_revisions DISABLE TRIGGER task_execution_revisions_immutable")
    ql3_owner.execute("""UPDATE ql3.task_execution_revisions
                            SET execution_template = jsonb_set(execution_template, '{command}', '["evil"]')""")
    ql3_owner.execute("ALTER TABLE ql3.task_execution_revisions ENABLE TRIGGER task_execution_revisions_immutable")
    with pytest.raises(errors.IntegrityFailure):
        api.lease_acquire(wk, "w", "local_process", 1, 30000)
    # a new Run of the same generation cannot be admitted either (nor its snapshot read)
    start(as_role, pkg, "wide")
    with pytest.raises(errors.IntegrityFailure):
        api.task_attempt_admit_page(rt, None, 64)
    with pytest.raises(psycopg.Error):  # and the memo itself is append-only
        ql3_owner.execute("UPDATE ql3.task_revision_verifications SET content_digest = content_digest")
    assert l.execution_revision["execution_template"]["command"] == ["true"]
    check_audit_invariants(ql3_owner)
