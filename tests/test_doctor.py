"""`qlpg doctor` (issue 6 §6): exit 0 on a freshly migrated database, non-zero when anything is wrong.

Each broken case runs in its own fresh database (``qlpg_db``). The grants golden file compared is
generated from that fresh database before it is broken (``QLPG_GRANTS_GOLDEN``), so these tests
check doctor itself; whether the checked-in ``docs/security/grants.md`` is current is
``tests/test_security_golden.py``'s job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from qlpg import cli, security

QLPG = str(Path(sys.executable).parent / "qlpg")


@pytest.fixture
def golden(qlpg_db, tmp_path, monkeypatch) -> Path:
    """The fresh database's own privilege matrix as the golden file doctor compares with."""
    with psycopg.connect(qlpg_db.conninfo, autocommit=True) as c:
        text = security.render_markdown(security.privilege_matrix(c))
    path = tmp_path / "grants.md"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setenv("QLPG_GRANTS_GOLDEN", str(path))
    return path


def doctor_subprocess(dsn: str) -> tuple[int, list[dict] | None, str]:
    p = subprocess.run([QLPG, "doctor", "--json", "--dsn", dsn], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ))
    try:
        rows = json.loads(p.stdout)
    except ValueError:
        rows = None
    return p.returncode, rows, p.stderr


def doctor(dsn: str, capsys) -> tuple[int, list[dict]]:
    """The CLI entry point in-process (same code as the `qlpg` script, without interpreter start-up)."""
    capsys.readouterr()
    rc = cli.main(["doctor", "--json", "--dsn", dsn])
    return rc, json.loads(capsys.readouterr().out)


def failing(rows: list[dict]) -> set[str]:
    return {r["check"] for r in rows if not r["ok"]}


EXPECTED_CHECKS = {"schema_capabilities", "migrations_applied", "roles_present", "roles_least_privilege",
                   "function_security", "immutability_triggers", "no_table_privileges", "synchronous_commit",
                   "server_encoding", "server_version", "grants_golden_file", "functions_deployed",
                   "immutable_digests", "planner_statistics"}


def test_doctor_exits_0_on_a_fresh_database_as_superuser(qlpg_db, golden):
    rc, rows, err = doctor_subprocess(qlpg_db.conninfo)
    assert rows is not None, err
    assert rc == 0, f"doctor failed on a fresh database: {[r for r in rows if not r['ok']]} {err}"
    assert {r["check"] for r in rows} >= EXPECTED_CHECKS
    assert all(r["ok"] for r in rows)


@pytest.mark.parametrize("role", ["ql3_runtime", "ql3_worker_ingress", "ql3_admin"])
def test_doctor_exits_0_as_a_service_login(qlpg_db, golden, role, capsys):
    rc, rows = doctor(qlpg_db.conninfo_as(role), capsys)
    assert rc == 0, [r for r in rows if not r["ok"]]
    by = {r["check"]: r for r in rows}
    assert set(by) >= EXPECTED_CHECKS
    # a service login cannot read the deployment table or the records; doctor says so instead of failing
    assert "not readable by this login" in by["functions_deployed"]["detail"]
    assert by["immutable_digests"]["detail"].startswith("skipped")
    assert "matches" in by["grants_golden_file"]["detail"]


def test_doctor_as_a_login_in_no_role_fails(qlpg_db, golden):
    rc, rows, err = doctor_subprocess(qlpg_db.conninfo_as("nobody"))
    assert rc == 2, (rc, err)
    assert "permission denied" in err or "QL601" in err, err


def _regprocedure(conn, name: str) -> str:
    return conn.execute("SELECT p.oid::regprocedure::text FROM pg_proc p WHERE p.pronamespace = 'ql3'::regnamespace"
                        " AND p.proname = %s", (name,)).fetchone()[0]


# name -> (SQL breaking the fresh database, the checks that must fail — exactly)
BREAKAGES = {
    "comment_dropped": ("COMMENT ON FUNCTION {run_inspect} IS NULL", {"function_security", "grants_golden_file"}),
    "search_path_unpinned": ("ALTER FUNCTION {run_inspect} RESET search_path", {"function_security", "grants_golden_file"}),
    "immutability_trigger_disabled": ("ALTER TABLE ql3.run_events DISABLE TRIGGER run_events_immutable",
                                      {"immutability_triggers"}),
    "table_select_granted_to_runtime": ("GRANT SELECT ON ql3.runs TO ql3_runtime",
                                        {"no_table_privileges", "grants_golden_file"}),
    "extra_execute_grant": ("GRANT EXECUTE ON FUNCTION {run_cancel_request} TO ql3_runtime", {"grants_golden_file"}),
    "internal_helper_executable_by_public": ("GRANT EXECUTE ON FUNCTION {now_ms} TO PUBLIC",
                                             {"function_security", "grants_golden_file"}),
    "grant_revoked": ("REVOKE EXECUTE ON FUNCTION {lease_acquire} FROM ql3_worker_ingress", {"grants_golden_file"}),
    "synchronous_commit_off": ("ALTER DATABASE {db} SET synchronous_commit = off", {"synchronous_commit"}),
}
# checks that may fail too for a case (a second check looking at the same setting)
ALSO = {"synchronous_commit_off": {"durability"}}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_doctor_fails_when_something_is_wrong(qlpg_db, golden, case, capsys):
    stmt, expected = BREAKAGES[case]
    # what already fails before the breakage (nothing, unless sql/functions changed since the session's
    # template was migrated — functions_deployed — which the exit-0 tests report)
    _, rows = doctor(qlpg_db.conninfo, capsys)
    baseline = failing(rows)
    assert baseline <= {"functions_deployed"}, rows
    with psycopg.connect(qlpg_db.conninfo, autocommit=True) as c:
        names = {n: _regprocedure(c, n) for n in ("run_inspect", "run_cancel_request", "now_ms", "lease_acquire")}
        c.execute(stmt.format(db=f'"{qlpg_db.dbname}"', **names))
    rc, rows = doctor(qlpg_db.conninfo, capsys)
    assert rc == 1, rows
    got = failing(rows) - baseline
    assert expected <= got <= expected | ALSO.get(case, set()), [r for r in rows if not r["ok"]]


def test_doctor_cli_exit_status_when_broken(qlpg_db, golden):
    """The installed `qlpg` script itself exits non-zero and names the failing check."""
    with psycopg.connect(qlpg_db.conninfo, autocommit=True) as c:
        c.execute("ALTER TABLE ql3.step_run_mutations DISABLE TRIGGER step_run_mutations_immutable")
    rc, rows, err = doctor_subprocess(qlpg_db.conninfo)
    assert rc == 1, err
    bad = {r["check"]: r for r in rows if not r["ok"] and r["check"] != "functions_deployed"}
    assert list(bad) == ["immutability_triggers"], bad
    assert "step_run_mutations" in bad["immutability_triggers"]["detail"]


def test_doctor_reports_golden_file_differences(qlpg_db, golden, capsys):
    """A changed grant is named in the detail, so the operator sees what differs."""
    with psycopg.connect(qlpg_db.conninfo, autocommit=True) as c:
        sig = _regprocedure(c, "run_cancel_request")
        c.execute(f"GRANT EXECUTE ON FUNCTION {sig} TO ql3_worker_ingress")
    rc, rows = doctor(qlpg_db.conninfo, capsys)
    row = next(r for r in rows if r["check"] == "grants_golden_file")
    assert rc == 1 and not row["ok"] and "run_cancel_request" in row["detail"], row
    golden.unlink()
    rc, rows = doctor(qlpg_db.conninfo, capsys)
    row = next(r for r in rows if r["check"] == "grants_golden_file")
    assert rc == 1 and not row["ok"] and "not found" in row["detail"], row


def test_doctor_flags_statistics_taken_while_a_table_was_empty(qlpg_db, golden, capsys):
    """The planner-statistics trap (docs/operations.md "Planner statistics"): ANALYZE while a table
    is empty, then the table grows. doctor fails with the table named; ANALYZE clears it."""
    with psycopg.connect(qlpg_db.conninfo, autocommit=True) as c:
        # autovacuum would analyze the table on its own after 50 changed rows: keep it out of the test
        c.execute("ALTER TABLE ql3.security_boundaries SET (autovacuum_enabled = off)")
        c.execute("VACUUM ANALYZE ql3.security_boundaries")
        rc, rows = doctor(qlpg_db.conninfo, capsys)
        by = {r["check"]: r for r in rows}
        assert by["planner_statistics"]["ok"], by["planner_statistics"]  # empty and known empty: fine
        c.execute("INSERT INTO ql3.security_boundaries (kind, id, version, changed_at_ms)"
                  " SELECT 'publisher', 'stale-' || g, 1, 0 FROM generate_series(1, 2000) g")
        c.execute("SELECT pg_stat_force_next_flush()")  # flushed when this backend goes idle next
        rc, rows = doctor(qlpg_db.conninfo, capsys)
        by = {r["check"]: r for r in rows}
        assert rc != 0 and failing(rows) == {"planner_statistics"}, rows
        assert "ql3.security_boundaries (statistics 0 rows, live ~2,000)" in by["planner_statistics"]["detail"]
        c.execute("ANALYZE ql3.security_boundaries")
        rc, rows = doctor(qlpg_db.conninfo, capsys)
        assert rc == 0, [r for r in rows if not r["ok"]]
