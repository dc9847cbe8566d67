"""Dump and restore (issue 7 §4): ``pg_dump`` a database holding finished and in-flight Runs,
restore it into a fresh database of the same cluster (the cluster-wide roles exist), and show that
everything still verifies: ``qlpg doctor`` exits 0 (readiness, grants golden file, deployed
functions, every immutable digest), ``verify_digests`` finds nothing, the grants and the schema are
those of the source, every table holds the same rows, the audit invariants hold, and the restored
database takes new work. This is the procedure docs/operations.md ("Backups") prescribes.

In flight at dump time: a Run whose first step is running under a worker holding its lease (the
step blocks on a gate file) and a Run whose first attempt is admitted (``claimed``) but not leased;
the restored database runs the latter to the end.

Needs ``pg_dump``/``pg_restore`` of at least the server's major version on PATH (for PostgreSQL 18.4,
``scripts/pg-cluster run --version 18.4`` puts them there); skips with the reason otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import psycopg
import pytest
from psycopg.rows import dict_row

from helpers import ROOT, check_audit_invariants
from ops_helpers import (catalog_shape, drive_to_end, pg_tool, run_status, scratch_database, shape_differences,
                         table_counts, wait_for, write_gate_package)
from qlpg import doctor, install, security
from qlpg.runtime import Runtime
from qlpg.verify import verify_digests
from qlpg.worker import Worker


def _tools(conn) -> tuple[str, str]:
    server_major = conn.info.server_version // 10000
    found = {}
    for name in ("pg_dump", "pg_restore"):
        path = pg_tool(name)
        if path is None:
            pytest.skip(f"{name} is not on PATH")
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        major = int(out.strip().rsplit(" ", 1)[-1].split(".")[0])
        if major < server_major:
            pytest.skip(f"{path} is PostgreSQL {major}, older than the server ({server_major}); "
                        "put a matching pg_dump first on PATH (scripts/pg-cluster run does for 18.4)")
        found[name] = path
    return found["pg_dump"], found["pg_restore"]


def _doctor(dsn: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "pyshell"))
    return subprocess.run([sys.executable, "-m", "qlpg", "doctor", "--dsn", dsn], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)


@pytest.mark.slow
def test_dump_and_restore_keep_every_record_verifiable(qlpg_db, as_role, tmp_path):
    owner = psycopg.connect(qlpg_db.conninfo, autocommit=True, row_factory=dict_row)
    pg_dump, pg_restore = _tools(owner)
    gate = tmp_path / "gate"
    pkg = write_gate_package(tmp_path / "pkgs", gate)
    install.install_package(as_role("ql3_package_manager"), pkg)
    pe = as_role("ql3_package_executor")
    rt = Runtime(qlpg_db.conninfo_as("ql3_runtime"))
    w1 = Worker(qlpg_db.conninfo_as("ql3_worker_ingress"), "dump-w1", tmp_path / "w1")
    w2 = Worker(qlpg_db.conninfo_as("ql3_worker_ingress"), "dump-w2", tmp_path / "w2", lease_ms=60000)
    holder = None
    try:
        # finished: one quick Run
        done = install.start_workflow(pe, "default", "opsdemo", "quick").run_id
        drive_to_end(rt, w1, owner, [done])
        assert run_status(owner, done) == "succeeded"
        # in flight: a running attempt under a held lease ...
        live = install.start_workflow(pe, "default", "opsdemo", "gated").run_id
        rt.run_once()
        holder = threading.Thread(target=w2.run_once, name="lease-holder", daemon=True)
        holder.start()
        wait_for(lambda: owner.execute(
            "SELECT 1 FROM ql3.run_attempts a JOIN ql3.step_runs s ON s.id = a.step_run_id"
            " JOIN ql3.run_dispatch_leases l ON l.attempt_id = a.id"
            " WHERE s.run_id = %s AND a.status = 'running' AND l.status = 'leased'", (live,)).fetchone(),
            60, "the worker to hold the lease of step 'wait'")
        # ... and an admitted attempt nobody leased yet
        queued = install.start_workflow(pe, "default", "opsdemo", "gated").run_id
        rt.run_once()
        assert owner.execute("SELECT a.status FROM ql3.run_attempts a JOIN ql3.step_runs s ON s.id = a.step_run_id"
                             " WHERE s.run_id = %s", (queued,)).fetchone()["status"] == "claimed"

        dump = tmp_path / "qlpg.dump"
        p = subprocess.run([pg_dump, "--format=custom", "--file", str(dump), "--dbname", qlpg_db.conninfo],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        src_counts, src_shape = table_counts(owner), catalog_shape(owner)
        src_grants = security.privilege_matrix(owner)
        gate.write_text("open\n")  # the source's worker finishes; the dump still shows it in flight
        holder.join(timeout=60)

        with scratch_database(qlpg_db.conninfo, f"{qlpg_db.dbname}_rst") as rst:
            p = subprocess.run([pg_restore, "--exit-on-error", "--dbname", rst, str(dump)],
                               capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, p.stderr
            doc = _doctor(rst)
            assert doc.returncode == 0, f"qlpg doctor on the restored database:\n{doc.stdout}\n{doc.stderr}"
            assert "grants_golden_file" in doc.stdout and "immutable_digests" in doc.stdout, doc.stdout
            with psycopg.connect(rst, autocommit=True, row_factory=dict_row) as r:
                assert verify_digests(r) == []
                assert table_counts(r) == src_counts
                assert shape_differences(catalog_shape(r), src_shape) == []
                grants = security.privilege_matrix(r)
                assert grants == src_grants
                golden = doctor._golden_path(r.info.server_version)  # the file `qlpg doctor` compares
                assert security.render_markdown(grants) == golden.read_text(encoding="utf-8")
                check_audit_invariants(r)
                for run_id, status in ((done, "succeeded"), (live, "running"), (queued, "running")):
                    assert run_status(r, run_id) == status
                # the restored database takes new work under the same logins, and the admitted
                # attempt nobody had leased at dump time runs to the end there
                rdb = psycopg.conninfo.conninfo_to_dict(rst)["dbname"]

                def dsn(role):
                    return psycopg.conninfo.make_conninfo(qlpg_db.conninfo_as(role), dbname=rdb)

                from qlpg import db as qdb

                with qdb.connect(dsn("ql3_package_executor")) as rpe:
                    again = install.start_workflow(rpe, "default", "opsdemo", "quick").run_id
                rrt = Runtime(dsn("ql3_runtime"))
                rw = Worker(dsn("ql3_worker_ingress"), "restored-w", tmp_path / "w3")
                try:
                    drive_to_end(rrt, rw, r, [again, queued])
                finally:
                    rrt.close()
                    rw.close()
                assert run_status(r, again) == run_status(r, queued) == "succeeded"
                assert verify_digests(r) == []
    finally:
        gate.write_text("open\n")
        if holder is not None:
            holder.join(timeout=60)
        rt.close()
        w1.close()
        w2.close()
        owner.close()
