"""The main job end to end (issue 2): `qlpg run` on both examples against a fresh database.

Runs the real CLI in a subprocess (as a user would), with the deploying login pointed at the
test database; every role-bound step inside runs under its own throwaway login.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg
import pytest
from psycopg.rows import dict_row

from helpers import EXAMPLES, ROOT, check_audit_invariants


def run_cli(qlpg_db, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "pyshell"))
    return subprocess.run([sys.executable, "-m", "qlpg", *args, "--dsn", qlpg_db.conninfo],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def final_states(qlpg_db) -> tuple[str, dict[str, str], list[dict]]:
    with psycopg.connect(qlpg_db.conninfo, row_factory=dict_row) as c:
        run = c.execute("SELECT * FROM ql3.runs").fetchone()
        steps = {r["step_key"]: r["status"] for r in c.execute("SELECT step_key, status FROM ql3.step_runs")}
        attempts = c.execute("SELECT a.*, s.step_key, x.exit_code FROM ql3.run_attempts a JOIN ql3.step_runs s ON s.id = a.step_run_id"
                             " LEFT JOIN ql3.run_attempt_completions x ON x.attempt_id = a.id").fetchall()
    return run["status"], steps, attempts


@pytest.mark.parametrize("example, code", [("pg-backup", 0), ("fanout", 1)])
def test_main_job(qlpg_db, tmp_path, example, code):
    expected = json.loads((EXAMPLES / example / "expected.json").read_text())
    p = run_cli(qlpg_db, "run", str(EXAMPLES / example), "--workers", "3", "--state-dir", str(tmp_path))
    assert p.returncode == code, p.stdout + p.stderr
    assert f"ended {expected['run']}" in p.stdout
    assert "throwaway login users" in p.stdout
    status, steps, attempts = final_states(qlpg_db)
    assert status == expected["run"]
    assert steps == expected["steps"]
    for a in attempts:  # one attempt per executed step, exit codes as the states say
        assert a["status"] == steps[a["step_key"]]
        assert (a["exit_code"] == 0) == (a["status"] == "succeeded")
    # the demo logins are gone again
    import re

    prefix = re.search(r"(qlpg_demo_\d+_)\*", p.stdout).group(1)
    with psycopg.connect(qlpg_db.conninfo) as c:
        assert c.execute("SELECT count(*) FROM pg_roles WHERE starts_with(rolname, %s)", (prefix,)).fetchone()[0] == 0
    with psycopg.connect(qlpg_db.conninfo, row_factory=dict_row) as c:
        check_audit_invariants(c)
        from qlpg.verify import verify_digests

        assert verify_digests(c) == []


def test_second_run_reuses_install(qlpg_db, tmp_path):
    """Running the main job twice: the second install is idempotent (same generation), a new Run."""
    for _ in range(2):
        p = run_cli(qlpg_db, "run", str(EXAMPLES / "pg-backup"), "--state-dir", str(tmp_path))
        assert p.returncode == 0, p.stdout + p.stderr
    assert "generation 1 (idempotent)" in p.stdout
    with psycopg.connect(qlpg_db.conninfo) as c:
        assert c.execute("SELECT count(*) FROM ql3.runs WHERE status = 'succeeded'").fetchone()[0] == 2
        assert c.execute("SELECT count(*) FROM ql3.package_materialized_revisions").fetchone()[0] == 1


def test_connection_error_names_address(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "pyshell"))
    p = subprocess.run([sys.executable, "-m", "qlpg", "run", str(EXAMPLES / "pg-backup"),
                        "--dsn", "host=127.0.0.1 port=1 dbname=x user=x connect_timeout=2"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2
    assert "host=127.0.0.1 port=1" in p.stderr
    assert "--temp-cluster" in p.stderr and "DATABASE_URL" in p.stderr


def test_usage_error_exit_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "pyshell"))
    bad = tmp_path / "pkg"
    bad.mkdir()
    (bad / "qinglong-package.yaml").write_text("package: x\nversion: '1'\ntasks: {}\nworkflows: {}\n")
    p = subprocess.run([sys.executable, "-m", "qlpg", "run", str(bad), "--dsn", "dbname=postgres"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2, p.stderr
    assert "qinglong-package.yaml" in p.stderr


def test_temp_cluster_main_job(tmp_path):
    """`qlpg run --temp-cluster` starts a private cluster, runs the job and removes the cluster."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "pyshell"))
    for k in ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "DATABASE_URL"):
        env.pop(k, None)
    before = set(os.listdir("/tmp"))
    p = subprocess.run([sys.executable, "-m", "qlpg", "run", str(EXAMPLES / "pg-backup"), "--temp-cluster",
                        "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "temp cluster" in p.stdout and "ended succeeded" in p.stdout
    leftovers = [d for d in set(os.listdir("/tmp")) - before if d.startswith("qlpg-pg-")]
    assert leftovers == []
