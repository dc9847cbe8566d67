"""Dispatch leases (ADR-0227 §4, issue 8 items 3 and 7): tokens returned once and stored only as
SHA-256, release before the start barrier, and 8 workers racing for the same attempts."""

from __future__ import annotations

import collections
import hashlib
import random

import pytest

from qlpg import api, errors

from helpers import check_audit_invariants
from test_attempt_support import footprint, install_pkg, roots, run_threads, start, write_pkg

W = "ql3_worker_ingress"


def test_token_returned_once_only_sha256_stored(qlpg_db, as_role, ql3_owner, tmp_path):
    pkg = write_pkg(tmp_path, "tok", {"two": roots(2)})
    install_pkg(as_role, pkg)
    (run_id,) = start(as_role, pkg, "two")
    api.task_attempt_admit_page(as_role("ql3_runtime"), None, 64)
    wk = as_role(W)
    leases = api.lease_acquire(wk, "w-tok", "local_process", 5, 30000)
    assert len(leases) == 2 and len({l.lease_token for l in leases}) == 2
    assert api.lease_acquire(wk, "w-tok2", "local_process", 5, 30000) == []  # nobody gets them again
    assert api.lease_acquire(wk, "w-tok2", "remote_worker", 5, 30000) == []  # other executor type: none
    for l in leases:
        assert len(l.lease_token) >= 32
        rev = l.execution_revision
        assert rev["task_id"] == "pkg:tok:t" and rev["executor_type"] == "local_process" and len(rev["content_digest"]) == 64
        row = ql3_owner.execute("SELECT to_jsonb(l)::text, token_sha256, worker_id, holder_login, status"
                                " FROM ql3.run_dispatch_leases l WHERE attempt_id = %s", (l.attempt_id,)).fetchone()
        assert row[1] == hashlib.sha256(l.lease_token.encode()).hexdigest()
        assert row[2:] == ("w-tok", qlpg_db.logins[W], "leased")
        # the token itself is nowhere in the database
        dump = ql3_owner.execute("SELECT string_agg(to_jsonb(x)::text, '') FROM ql3.run_attempts x").fetchone()[0]
        assert l.lease_token not in row[0] and l.lease_token not in dump
    # the parent Run is not touched by leasing
    assert ql3_owner.execute("SELECT count(*) FROM ql3.run_events WHERE run_id = %s AND type LIKE '%%lease%%'",
                             (run_id,)).fetchone()[0] == 0
    check_audit_invariants(ql3_owner)


def test_release_gives_work_back_before_the_start_barrier(qlpg_db, as_role, ql3_owner, tmp_path):
    pkg = write_pkg(tmp_path, "rel", {"one": {"a": []}})
    install_pkg(as_role, pkg)
    start(as_role, pkg, "one")
    api.task_attempt_admit_page(as_role("ql3_runtime"), None, 64)
    w1, w2 = as_role(W), as_role(W)
    (l1,) = api.lease_acquire(w1, "w1", "local_process", 1, 30000)
    version0 = ql3_owner.execute("SELECT version FROM ql3.runs").fetchone()[0]
    out = api.lease_release(w1, l1.attempt_id, l1.lease_token, "shutdown")
    assert out["status"] == "claimed"
    a = ql3_owner.execute("SELECT status, lease_active, worker_id FROM ql3.run_attempts").fetchone()
    assert a == ("claimed", False, None)
    assert ql3_owner.execute("SELECT status, end_reason FROM ql3.run_dispatch_leases").fetchone() == ("released", "shutdown")
    assert ql3_owner.execute("SELECT version FROM ql3.runs").fetchone()[0] == version0  # no Run write
    (l2,) = api.lease_acquire(w2, "w2", "local_process", 1, 30000)  # another worker gets it back
    assert l2.attempt_id == l1.attempt_id and l2.lease_token != l1.lease_token
    before = footprint(ql3_owner)
    for call in (lambda: api.attempt_start(w1, l1.attempt_id, l1.lease_token),
                 lambda: api.lease_release(w1, l1.attempt_id, l1.lease_token),
                 lambda: api.lease_control(w1, l1.attempt_id, l1.lease_token, 30000)):
        with pytest.raises(errors.LeaseInvalid):  # the old token is dead
            call()
    assert footprint(ql3_owner) == before
    api.attempt_start(w2, l2.attempt_id, l2.lease_token)
    before = footprint(ql3_owner)
    with pytest.raises(errors.IllegalTransition):  # past the start barrier nothing is given back
        api.lease_release(w2, l2.attempt_id, l2.lease_token)
    assert footprint(ql3_owner) == before
    nos = ql3_owner.execute("SELECT lease_no, status FROM ql3.run_dispatch_leases ORDER BY lease_no").fetchall()
    assert nos == [(1, "released"), (2, "leased")]
    check_audit_invariants(ql3_owner)


def test_eight_workers_never_lease_an_attempt_twice(qlpg_db, as_role, ql3_owner, tmp_path):
    """8 workers on their own connections race lease_acquire (random batch sizes) over 300 claimed
    attempts, 5 rounds: every round each attempt is leased by exactly one worker; between rounds
    all leases are released, so the next round races for the same attempts again."""
    pkg = write_pkg(tmp_path, "race8", {"wide": roots(100)})
    install_pkg(as_role, pkg)
    start(as_role, pkg, "wide", 3)
    rt = as_role("ql3_runtime")
    after = None
    while True:
        rows = api.task_attempt_admit_page(rt, after, 64)
        if len(rows) < 64:
            break
        after = (rows[-1]["run_id"], rows[-1]["step_run_id"])
    all_ids = {r[0] for r in ql3_owner.execute("SELECT id FROM ql3.run_attempts").fetchall()}
    assert len(all_ids) == 300
    conns = [as_role(W) for _ in range(8)]
    for rnd in range(5):
        def work(i, barrier):
            rng = random.Random(rnd * 100 + i)
            got = []
            barrier.wait()
            while True:
                ls = api.lease_acquire(conns[i], f"w{i}", "local_process", rng.randint(1, 6), 30000)
                if not ls:
                    return got
                got += ls

        results = run_threads(8, work)
        errs = [r for r in results if isinstance(r, BaseException)]
        assert not errs, errs
        leased = [l for r in results for l in r]
        counts = collections.Counter(l.attempt_id for l in leased)
        assert set(counts) == all_ids and max(counts.values()) == 1, counts.most_common(3)
        assert sum(1 for r in results if r) >= 2  # the workers really raced
        live = ql3_owner.execute("SELECT attempt_id, count(*) FROM ql3.run_dispatch_leases WHERE status = 'leased'"
                                 " GROUP BY 1 HAVING count(*) > 1").fetchall()
        assert live == []
        for i, r in enumerate(results):
            for l in r:
                api.lease_release(conns[i], l.attempt_id, l.lease_token, "round over")
    per_attempt = ql3_owner.execute("SELECT count(*), count(DISTINCT token_sha256) FROM ql3.run_dispatch_leases"
                                    " GROUP BY attempt_id").fetchall()
    assert per_attempt == [(5, 5)] * 300
    check_audit_invariants(ql3_owner)
