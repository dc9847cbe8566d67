"""ADR-0023 wired into the main job (issue 3 §7): a worker executes only the immutable execution
revision pinned for its attempt, never a mutable definition.

A tiny package is written to tmp_path, installed, started and admitted; the attempt is leased;
then the package is edited and reinstalled (new generation, new revisions). The leased attempt
still carries -- and a real :class:`qlpg.worker.Worker` still executes -- the old command, while a
Run started after the reinstall executes the new one. A pinned revision damaged in storage makes
``lease_acquire`` fail closed (QL501): nothing is leased, nothing runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import admit_all
from qlpg import api, errors, install
from qlpg.revision import execution_revision_digest
from qlpg.worker import Worker

PKG = "revdemo"
TASK_ID = f"pkg:{PKG}:hello"


def write_package(d: Path, word: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "qinglong-package.yaml").write_text(
        f"""package: {PKG}
version: 1.0.0
tasks:
  hello:
    command: ["bash", "-c", "echo command-{word}"]
    timeout_ms: 30000
workflows:
  main:
    steps:
      hello: {{task: hello}}
""")
    return d


def start_and_lease(as_role, worker_id: str) -> api.Lease:
    install.start_workflow(as_role("ql3_package_executor"), "default", PKG, "main")
    admitted = admit_all(as_role("ql3_runtime"))
    assert len(admitted) == 1
    leases = api.lease_acquire(as_role("ql3_worker_ingress"), worker_id, "local_process", 8, 60000)
    assert len(leases) == 1
    return leases[0]


def revisions(owner) -> dict[str, dict]:
    cur = owner.execute("SELECT task_revision, execution_template, content_digest FROM ql3.task_execution_revisions"
                        " WHERE project_id = 'default' AND task_id = %s", (TASK_ID,))
    return {r[0]: {"template": r[1], "digest": r[2]} for r in cur.fetchall()}


def test_running_attempt_keeps_its_pinned_revision_across_reinstall(qlpg_db, ql3_owner, as_role, tmp_path):
    pkg = write_package(tmp_path / "pkg", "old")
    pm = as_role("ql3_package_manager")
    first = install.install_package(pm, pkg)
    assert (first.outcome, first.generation) == ("inserted", 1)
    old_revs = revisions(ql3_owner)
    assert len(old_revs) == 1
    (old_rev, old), = old_revs.items()
    assert old_rev.startswith("qltd:v1:1:") and old["template"]["command"] == ["bash", "-c", "echo command-old"]

    lease = start_and_lease(as_role, "wire-w1")
    pinned = lease.execution_revision
    assert pinned["task_revision"] == old_rev and pinned["content_digest"] == old["digest"]
    assert pinned["execution_template"]["command"] == ["bash", "-c", "echo command-old"]

    # Edit the package and reinstall: a new generation with new revisions; the old one stays.
    write_package(pkg, "new")
    second = install.install_package(pm, pkg)
    assert (second.outcome, second.generation) == ("inserted", 2)
    revs = revisions(ql3_owner)
    assert len(revs) == 2 and revs[old_rev] == old
    (new_rev, new), = ((k, v) for k, v in revs.items() if k != old_rev)
    assert new_rev.startswith("qltd:v1:2:") and new["template"]["command"] == ["bash", "-c", "echo command-new"]
    assert new["digest"] == execution_revision_digest("default", TASK_ID, new_rev, "local_process", new["template"],
                                                      f"qlpkg:default/{PKG}@2")

    # The attempt is pinned to the old revision in the database, too.
    row = ql3_owner.execute("SELECT task_revision, execution_digest, status FROM ql3.run_attempts WHERE id = %s",
                            (lease.attempt_id,)).fetchone()
    assert row == (old_rev, old["digest"], "claimed")
    admin = as_role("ql3_admin")
    assert api.task_revision_resolve(admin, "default", TASK_ID, old_rev).execution_template["command"] == (
        "bash", "-c", "echo command-old")

    # A real worker executes the lease it holds: the old command runs.
    worker = Worker(qlpg_db.conninfo_as("ql3_worker_ingress"), "wire-w1", tmp_path / "state", lease_ms=60000)
    try:
        out = worker.execute(lease)
    finally:
        worker.close()
    assert out is not None and out.outcome == "succeeded" and out.exit_code == 0
    assert Path(out.stdout_path).read_text().strip() == "command-old"
    done = ql3_owner.execute("SELECT a.status, a.task_revision, s.status FROM ql3.run_attempts a"
                             " JOIN ql3.step_runs s ON s.id = a.step_run_id WHERE a.id = %s",
                             (lease.attempt_id,)).fetchone()
    assert done == ("succeeded", old_rev, "succeeded")

    # A Run started after the reinstall gets the new revision and runs the new command.
    lease2 = start_and_lease(as_role, "wire-w2")
    assert lease2.execution_revision["task_revision"] == new_rev
    worker2 = Worker(qlpg_db.conninfo_as("ql3_worker_ingress"), "wire-w2", tmp_path / "state", lease_ms=60000)
    try:
        out2 = worker2.execute(lease2)
    finally:
        worker2.close()
    assert out2.outcome == "succeeded"
    assert Path(out2.stdout_path).read_text().strip() == "command-new"
    assert ql3_owner.execute("SELECT task_revision FROM ql3.run_attempts WHERE id = %s",
                             (lease2.attempt_id,)).fetchone()[0] == new_rev


def test_lease_acquire_fails_closed_on_damaged_pinned_revision(ql3_owner, as_role, tmp_path):
    pkg = write_package(tmp_path / "pkg", "old")
    install.install_package(as_role("ql3_package_manager"), pkg)
    install.start_workflow(as_role("ql3_package_executor"), "default", PKG, "main")
    assert len(admit_all(as_role("ql3_runtime"))) == 1
    (rev, good), = revisions(ql3_owner).items()

    def set_command(cmd: str) -> None:
        with ql3_owner.transaction():
            ql3_owner.execute("ALTER TABLE ql3.task_execution_revisions DISABLE TRIGGER task_execution_revisions_immutable")
            ql3_owner.execute("UPDATE ql3.task_execution_revisions SET execution_template ="
                              " jsonb_set(execution_template, '{command,2}', to_jsonb(%s::text))"
                              " WHERE task_id = %s AND task_revision = %s", (cmd, TASK_ID, rev))
            ql3_owner.execute("ALTER TABLE ql3.task_execution_revisions ENABLE TRIGGER task_execution_revisions_immutable")

    set_command("echo forged")  # digest no longer matches
    wk = as_role("ql3_worker_ingress")
    with pytest.raises(errors.IntegrityFailure):
        api.lease_acquire(wk, "wire-w3", "local_process", 8, 60000)
    assert ql3_owner.execute("SELECT count(*) FROM ql3.run_dispatch_leases").fetchone()[0] == 0
    assert ql3_owner.execute("SELECT bool_and(NOT lease_active) FROM ql3.run_attempts").fetchone()[0] is True
    set_command("echo command-old")  # repaired: the same lease call now succeeds
    leases = api.lease_acquire(wk, "wire-w3", "local_process", 8, 60000)
    assert [lz.execution_revision["content_digest"] for lz in leases] == [good["digest"]]
