"""The start barrier and a lost answer: a replayed attempt_start is answered after the lease expired,
but a first start on an expired lease is refused (found by the HA gate; ADR-0227 §4)."""

from __future__ import annotations

import time

import pytest

from qlpg import api, errors

from helpers import EXAMPLES, admit_all, check_audit_invariants, install_and_start


def _expire(owner, attempt_id: str) -> None:
    """Wait until database time is past the attempt's lease expiry."""
    exp = owner.execute("SELECT lease_expires_at_ms FROM ql3.run_attempts WHERE id = %s", (attempt_id,)).fetchone()[0]
    while owner.execute("SELECT ql3.now_ms() > %s", (exp,)).fetchone()[0] is not True:
        time.sleep(0.1)


def test_start_replay_after_lease_expiry_and_refusal_of_late_first_start(qlpg_db, as_role, ql3_owner):
    _, rec = install_and_start(qlpg_db, as_role, EXAMPLES / "fanout", "fanout")
    rt, wk = as_role("ql3_runtime"), as_role("ql3_worker_ingress")
    admit_all(rt)
    leases = api.lease_acquire(wk, "w-replay", "local_process", 2, 1000)
    assert len(leases) == 2
    first, late = leases
    started = api.attempt_start(wk, first.attempt_id, first.lease_token)
    _expire(ql3_owner, first.attempt_id)
    _expire(ql3_owner, late.attempt_id)
    version = ql3_owner.execute("SELECT version FROM ql3.runs WHERE id = %s", (rec.run_id,)).fetchone()[0]
    again = api.attempt_start(wk, first.attempt_id, first.lease_token)  # the lost answer, replayed
    assert again == started
    with pytest.raises(errors.LeaseInvalid):
        api.attempt_start(wk, late.attempt_id, late.lease_token)  # never crossed the barrier: refused
    with pytest.raises(errors.LeaseInvalid):
        api.attempt_start(wk, first.attempt_id, late.lease_token)  # another attempt's token
    assert ql3_owner.execute("SELECT version FROM ql3.runs WHERE id = %s", (rec.run_id,)).fetchone()[0] == version
    assert ql3_owner.execute("SELECT status FROM ql3.run_attempts WHERE id = %s", (late.attempt_id,)).fetchone()[0] == "claimed"
    check_audit_invariants(ql3_owner, rec.run_id)
