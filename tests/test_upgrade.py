"""Upgrade path (issue 7 §3): the previous release with live data, then `qlpg migrate` to head while
a worker of the previous release holds a lease.

The previous release is the newest ``v*`` tag reachable from HEAD; while there is none, commit
97d173e — the first commit where the walking skeleton (migrate, install, admit, runtime, workers)
worked end to end (docs/operations.md "Releases and upgrades" records why 3ee3078, the first commit
with a ``qlpg migrate``, is not a release). ``QLPG_UPGRADE_FROM=<ref>`` overrides the choice. The
test exports that commit's ``sql/`` and ``pyshell/`` with ``git archive`` and runs the previous
release's own CLI (``python -m qlpg`` with its ``pyshell`` first on ``PYTHONPATH``) to deploy it
and to create the live data: one finished Run and one Run whose first step is running under a
worker that holds its lease (the step blocks on a gate file). Then head's ``migrate`` runs, the
gate opens, the *old* worker reports its completion to the upgraded database, and head's runtime
and worker finish the Run. Checks: the completion landed, every receipt/plan/revision digest
verifies (``qlpg.verify.verify_digests``), the audit invariants hold, and the upgraded schema is
exactly a fresh head install (tables, columns, constraints, indexes, triggers, functions, grants).

``test_released_migrations_are_unchanged`` guards the rule the upgrade depends on: yoyo records a
migration by its id only, so a released migration file edited in place never runs on upgraded
databases — a change belongs in a new ``sql/migrations/NNNN_*.sql``.

Skips (with the reason) when git, the work tree's history or the commit is not available.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row

from helpers import ROOT, check_audit_invariants
from ops_helpers import (catalog_shape, drive_to_end, run_status, scratch_database, shape_differences,
                         snapshot_sql, wait_for, write_gate_package)
from qlpg import migrate, security
from qlpg.paths import sql_dir
from qlpg.runtime import Runtime
from qlpg.verify import verify_digests
from qlpg.worker import Worker

#: The previous release while no ``v*`` tag exists (suggested tag: v0.1.0).
FALLBACK_RELEASE = "97d173e"


def _git(*args: str, binary: bool = False):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=not binary, timeout=120)


def previous_release() -> tuple[str, str]:
    """``(ref, commit sha)`` of the previous release; ``pytest.skip`` when it cannot be resolved."""
    try:
        if _git("rev-parse", "--is-inside-work-tree").returncode != 0:
            pytest.skip(f"{ROOT} is not a git work tree: the upgrade test needs the project's history")
    except FileNotFoundError:
        pytest.skip("git is not installed: the upgrade test needs the project's history")
    ref = os.environ.get("QLPG_UPGRADE_FROM")
    if not ref:
        tag = _git("describe", "--tags", "--abbrev=0", "--match", "v[0-9]*", "HEAD")
        ref = tag.stdout.strip() if tag.returncode == 0 and tag.stdout.strip() else FALLBACK_RELEASE
    sha = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if sha.returncode != 0:
        pytest.skip(f"previous release {ref!r} is not reachable in this clone (shallow clone?); "
                    "fetch the full history or set QLPG_UPGRADE_FROM")
    return ref, sha.stdout.strip()


def export_tree(sha: str, dest: Path, *paths: str) -> Path:
    out = _git("archive", "--format=tar", sha, *paths, binary=True)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tf:
        try:
            tf.extractall(dest, filter="data")
        except TypeError:  # pragma: no cover - Python < 3.11.4
            tf.extractall(dest)
    return dest


def test_released_migrations_are_unchanged():
    ref, sha = previous_release()
    listed = _git("ls-tree", "-r", "--name-only", sha, "--", "sql/migrations")
    assert listed.returncode == 0, listed.stderr
    changed = []
    for path in listed.stdout.split():
        old = _git("show", f"{sha}:{path}", binary=True).stdout
        cur = sql_dir() / "migrations" / Path(path).name  # the SQL being deployed ($QLPG_SQL_DIR aware)
        if not cur.exists():
            changed.append(f"{path} (deleted)")
        elif cur.read_bytes() != old:
            changed.append(path)
    assert not changed, (
        f"released migrations were edited after {ref} ({sha[:12]}): {', '.join(changed)}. yoyo records a "
        "migration by its id, so databases deployed from that release never see the edit. Revert it and put "
        "the change into a new sql/migrations/NNNN_<name>.sql (idempotent: IF NOT EXISTS ...). See "
        "docs/operations.md, 'Releases and upgrades'.")


def _old_cli(old_root: Path, *args: str, dsn: str, timeout: float = 120, check: bool = True, **popen):
    env = {k: v for k, v in os.environ.items() if k not in ("QLPG_SQL_DIR", "PYTHONPATH")}
    env["PYTHONPATH"] = str(old_root / "pyshell")
    argv = [sys.executable, "-m", "qlpg", *args, "--dsn", dsn]
    if popen:
        return subprocess.Popen(argv, env=env, cwd=str(old_root), **popen)
    p = subprocess.run(argv, env=env, cwd=str(old_root), capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, f"previous release: qlpg {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}"
    return p


def _start(old_root: Path, pe_dsn: str, workflow: str) -> str:
    import json

    p = _old_cli(old_root, "workflow", "start", "opsdemo", workflow, "--json", dsn=pe_dsn)
    return json.loads(p.stdout)["run_id"]


@pytest.mark.slow
def test_upgrade_from_previous_release_with_a_lease_held(qlpg_db, tmp_path, monkeypatch):
    ref, sha = previous_release()
    snapshot_sql(tmp_path, monkeypatch)  # head = these files for both head migrations below
    old_root = export_tree(sha, tmp_path / "previous", "sql", "pyshell")
    gate = tmp_path / "gate"
    pkg = write_gate_package(tmp_path / "pkgs", gate)

    with scratch_database(qlpg_db.conninfo, f"{qlpg_db.dbname}_upg") as su:
        db = psycopg.conninfo.conninfo_to_dict(su)["dbname"]

        def as_login(role: str) -> str:
            # service logins connect like the rest of the suite's service connections (through the
            # pooler when the run has one); the deploying superuser always goes direct
            return psycopg.conninfo.make_conninfo(qlpg_db.conninfo_as(role), dbname=db)

        # ---- the previous release, deployed by its own CLI, with live data
        _old_cli(old_root, "migrate", dsn=su)
        _old_cli(old_root, "package", "install", str(pkg), dsn=as_login("ql3_package_manager"))
        done_run = _start(old_root, as_login("ql3_package_executor"), "quick")
        _old_cli(old_root, "runtime", "--once", dsn=as_login("ql3_runtime"))
        _old_cli(old_root, "worker", "--once", "--worker-id", "old-w1", "--state-dir", str(tmp_path / "w1"),
                 dsn=as_login("ql3_worker_ingress"))
        live_run = _start(old_root, as_login("ql3_package_executor"), "gated")
        _old_cli(old_root, "runtime", "--once", dsn=as_login("ql3_runtime"))
        old_worker = _old_cli(old_root, "worker", "--once", "--worker-id", "old-w2", "--lease-ms", "60000",
                              "--state-dir", str(tmp_path / "w2"), dsn=as_login("ql3_worker_ingress"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            with psycopg.connect(su, autocommit=True, row_factory=dict_row) as owner:
                assert run_status(owner, done_run) == "succeeded"
                held = """SELECT a.id, a.status, l.status AS lease FROM ql3.run_attempts a
                            JOIN ql3.step_runs s ON s.id = a.step_run_id
                            JOIN ql3.run_dispatch_leases l ON l.attempt_id = a.id
                           WHERE s.run_id = %s AND s.step_key = 'wait'"""
                row = wait_for(lambda: owner.execute(held + " AND a.status = 'running' AND l.status = 'leased'",
                                                     (live_run,)).fetchone(),
                               60, "the previous release's worker to hold the lease of step 'wait'")
                attempt_id = row["id"]
                before = {r["k"] for r in owner.execute(
                    "SELECT attempt_id AS k FROM ql3.task_attempt_admissions")}

                # ---- upgrade to head while the lease is held
                migrate.migrate(su)  # changes nothing when head's SQL equals the release's: still a valid run

                # ---- the old worker's completion lands on the upgraded database
                gate.write_text("open\n")
                out, _ = old_worker.communicate(timeout=120)
                assert old_worker.returncode == 0, f"previous release's worker failed after the upgrade:\n{out}"
                row = owner.execute(held, (live_run,)).fetchone()
                assert (row["status"], row["lease"]) == ("succeeded", "completed"), row
                assert owner.execute("SELECT outcome FROM ql3.run_attempt_completions WHERE attempt_id = %s",
                                     (attempt_id,)).fetchone()["outcome"] == "succeeded"

                # ---- head drives the rest of the Run
                rt = Runtime(as_login("ql3_runtime"))
                w = Worker(as_login("ql3_worker_ingress"), "head-w", tmp_path / "w3", lease_ms=30000)
                try:
                    drive_to_end(rt, w, owner, [live_run])
                finally:
                    rt.close()
                    w.close()
                assert run_status(owner, live_run) == "succeeded"
                assert before <= {r["k"] for r in owner.execute(
                    "SELECT attempt_id AS k FROM ql3.task_attempt_admissions")}

                # ---- every record, old and new, verifies; the audit trail is whole
                assert verify_digests(owner) == []
                check_audit_invariants(owner)

                # ---- and the upgraded database is a head install (one made now, from the same files)
                with scratch_database(qlpg_db.conninfo, f"{db}_fresh") as fresh_dsn:
                    migrate.migrate(fresh_dsn)
                    with psycopg.connect(fresh_dsn, autocommit=True) as fresh:
                        want_shape, want_grants = catalog_shape(fresh), security.privilege_matrix(fresh)
                diffs = shape_differences(catalog_shape(owner), want_shape)
                assert not diffs, (f"a database upgraded from {ref} ({sha[:12]}) differs from a fresh install:\n  "
                                   + "\n  ".join(diffs[:40]))
                assert security.privilege_matrix(owner) == want_grants
        finally:
            if old_worker.poll() is None:
                gate.write_text("open\n")
                try:
                    old_worker.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    old_worker.kill()
                    old_worker.wait()
