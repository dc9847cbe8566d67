"""Admission races on the real server (issue 8 item 7): 32 sessions admit the same ready epoch at
the same instant: exactly one attempt per epoch, every other session the identical receipt.

1,000 races at READ COMMITTED, the shell's isolation for step-cycle calls (the losers wait for the
Run lock, then their next statement sees the winner's receipt and replays it), and 100 at
SERIALIZABLE (``QLPG_STEP_ISOLATION``: a loser whose snapshot predates the winner's COMMIT gets
40001, is retried by the shell and then replays)."""

from __future__ import annotations

import collections
import os

import pytest

from qlpg import api

from helpers import check_audit_invariants
from test_attempt_support import candidates, install_pkg, roots, run_threads, start, write_pkg

SESSIONS = 32
RACES = int(os.environ.get("QLPG_TEST_RACES", "1000"))


@pytest.mark.parametrize("isolation, races", [("read committed", RACES), ("serializable", max(RACES // 20, 10))])
def test_32_sessions_race_to_admit_the_same_epoch(qlpg_db, as_role, ql3_owner, tmp_path, monkeypatch, isolation, races):
    RACES = races
    monkeypatch.setenv("QLPG_STEP_ISOLATION", isolation)
    per_run = 125
    pkg = write_pkg(tmp_path, "races", {"wide": roots(per_run)})
    install_pkg(as_role, pkg)
    start(as_role, pkg, "wide", -(-RACES // per_run))
    rt = as_role("ql3_runtime")
    cands = candidates(rt)[:RACES]
    assert len(cands) == RACES
    claim = api.task_attempt_snapshot(rt, cands[0]["run_id"], cands[0]["step_run_id"], 1)["execution_revision"]
    conns = [as_role("ql3_runtime") for _ in range(SESSIONS)]

    def racer(i, barrier):
        out = []
        for c in cands:
            barrier.wait()  # every session sends the same epoch at once
            out.append(api.task_attempt_admit(conns[i], c["run_id"], c["step_run_id"], c["step_run_version"],
                                              c["step_run_digest"], claim))
        return out

    results = run_threads(SESSIONS, racer, timeout=600)
    errs = [r for r in results if isinstance(r, BaseException)]
    assert not errs, errs[:3]
    winners = collections.Counter()
    for k, c in enumerate(cands):
        recs = [results[i][k] for i in range(SESSIONS)]
        fresh = [r for r in recs if not r.replayed]
        assert len(fresh) == 1, (c, [r.replayed for r in recs])
        assert len({(r.attempt_id, r.receipt_digest) for r in recs}) == 1
        assert all(r.receipt == fresh[0].receipt for r in recs)
        winners[recs.index(fresh[0])] += 1
    assert len(winners) > 1  # different sessions won different races
    rows = ql3_owner.execute("SELECT count(*), count(DISTINCT step_run_id), count(DISTINCT (run_id, attempt))"
                             " FROM ql3.run_attempts").fetchone()
    assert rows == (RACES, RACES, RACES)
    per_run_attempts = ql3_owner.execute("SELECT run_id, array_agg(attempt ORDER BY attempt) FROM ql3.run_attempts"
                                         " GROUP BY run_id").fetchall()
    for _, nums in per_run_attempts:
        assert nums == list(range(1, len(nums) + 1))  # Run-global, gapless: no loser burned a number
    check_audit_invariants(ql3_owner)
