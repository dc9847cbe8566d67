"""One runtime pass (`Runtime.run_once`) is not held up by a Run that cannot be admitted.

A StepRun whose stored digest no longer verifies is refused by ``task_attempt_admit`` with QL501
on every pass. The Runs paged after it must still be admitted, and the same pass must still
converge cancellations; the refusal is counted (``PassStats.failed``) and logged for the operator.
The batch path falls back to the same per-candidate admission when SQL refuses a page as a whole.
"""

from __future__ import annotations

import logging

import pytest

from qlpg import api
from qlpg.runtime import Runtime

from helpers import check_audit_invariants
from lifecycle_helpers import ADMIN, RUNTIME, start_run, task, write_package


@pytest.fixture
def pkg(tmp_path):
    return write_package(tmp_path, "passpkg", {"quick": task("true")}, {"one": {"a": {"task": "quick"}}})


@pytest.mark.parametrize("batch", [False, True])
def test_a_run_that_fails_verification_does_not_hold_up_the_pass(qlpg_db, as_role, ql3_owner, pkg, batch, caplog):
    # keyset order is (run_id, step_run_id): the poisoned Run sorts first, the others after it
    bad = start_run(as_role, pkg, "one", run_id="pass-a-poisoned")
    good = start_run(as_role, pkg, "one", run_id="pass-b-healthy", install_first=False)
    doomed = start_run(as_role, pkg, "one", run_id="pass-c-cancel", install_first=False)
    ql3_owner.execute("UPDATE ql3.step_runs SET digest = repeat('0', 64) WHERE run_id = %s", (bad,))
    api.run_cancel_request(as_role(ADMIN), doomed, "user", "qlpg-tests")

    rt = Runtime(qlpg_db.conninfo_as(RUNTIME), recovery=False, batch=batch)
    try:
        with caplog.at_level(logging.ERROR, logger="qlpg.runtime"):
            stats = rt.run_once()
    finally:
        rt.close()
    assert (stats.admitted, stats.failed) == (1, 1), stats
    assert stats.cancels_converged == 1, stats
    assert any("QL501" in r.getMessage() and bad in r.getMessage() for r in caplog.records), caplog.text
    admitted = {r[0] for r in ql3_owner.execute("SELECT run_id FROM ql3.task_attempt_admissions").fetchall()}
    assert admitted == {good}
    status = dict(ql3_owner.execute("SELECT id, status FROM ql3.runs").fetchall())
    assert status == {bad: "running", good: "running", doomed: "cancelled"}, status
    check_audit_invariants(ql3_owner, good)
    check_audit_invariants(ql3_owner, doomed)
