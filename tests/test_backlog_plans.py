"""``lease_acquire``'s cost does not grow with the backlog of claimed attempts (ADR-0227 §3:
bounded leases), whichever join strategy the planner prefers.

In the step-cycle benchmark (32-wide fan-out, statistics taken with an empty attempt queue), the
lease query -- then a join of the partial index ``run_attempts_dispatch_idx`` with ``ql3.runs``
and ``ql3.step_runs`` -- was planned as a hash join plus a sort of the *whole* backlog on about
half the runs: ~4 buffers per queued attempt, 2.4 ms per lease with 230 queued, O(N²) to drain N.
It now reaches the Run and the StepRun through LATERAL subqueries that ``OFFSET 0`` keeps out of
the join order, so the only plan is the ordered scan of the partial index that stops after
``p_max`` rows with two primary-key probes per row.

The test calls the real function as the worker login, reads the buffers the call touched from
``EXPLAIN (ANALYZE, BUFFERS)`` of the call (nested statements included), with the generic plan
(``plan_cache_mode = force_generic_plan``, what PL/pgSQL settles on) and once more with nested
loops disabled (``enable_nestloop = off``: the planner is pushed to the hash join that the
benchmark's statistics produced). The backlog grows from 128 to 512 queued attempts; the buffers
must not follow.
"""

from __future__ import annotations

import pytest

from qlpg import api

from test_attempt_support import install_pkg, start, write_pkg

RUNTIME, WORKER = "ql3_runtime", "ql3_worker_ingress"


def _buffers(conn, call: str, args: tuple) -> int:
    conn.execute("SET plan_cache_mode = force_generic_plan")
    row = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) {call}", args).fetchone()
    (plan,) = row["QUERY PLAN"] if isinstance(row, dict) else row[0]
    conn.execute("RESET plan_cache_mode")
    p = plan["Plan"]
    return p["Shared Hit Blocks"] + p["Shared Read Blocks"]


def _lease_cost(wk) -> int:
    """Buffers of one lease of one attempt (the second of two calls: the first may plan the
    statement and visit index entries of rows that died since the last vacuum)."""
    _buffers(wk, "SELECT * FROM ql3.lease_acquire('w-backlog', 'local_process', 1, 60000)", ())
    return _buffers(wk, "SELECT * FROM ql3.lease_acquire('w-backlog', 'local_process', 1, 60000)", ())


FAN = 32


@pytest.fixture
def pkg(as_role, tmp_path):
    p = write_pkg(tmp_path, "backlog", {"fan": {"root": [], **{f"c{i:02d}": ["root"] for i in range(FAN)}}})
    install_pkg(as_role, p)
    return p


def _complete_all(rt, wk, worker: str = "w-history") -> int:
    """Admit every candidate and run every attempt to success, until nothing is left."""
    n = 0
    while True:
        while api.task_attempt_candidates(rt, None, 64):
            api.task_attempt_admit_page(rt, None, 64)
        ls = api.lease_acquire_start(wk, worker, "local_process", 32, 60000)
        if not ls:
            return n
        api.attempt_running_batch(wk, [(l.attempt_id, l.lease_token) for l in ls])
        api.attempt_complete_batch(wk, [(l.attempt_id, l.lease_token, "succeeded", 0, None) for l in ls])
        n += len(ls)


def _complete_roots(rt, wk) -> None:
    """Admit and complete the ready roots: each Run's 32 children become ready epochs."""
    while api.task_attempt_candidates(rt, None, 64):
        api.task_attempt_admit_page(rt, None, 64)
    while ls := api.lease_acquire_start(wk, "w-roots", "local_process", 32, 60000):
        api.attempt_running_batch(wk, [(l.attempt_id, l.lease_token) for l in ls])
        api.attempt_complete_batch(wk, [(l.attempt_id, l.lease_token, "succeeded", 0, None) for l in ls])


def test_dispatch_costs_do_not_grow_with_the_backlog(qlpg_db, as_role, ql3_owner, pkg):
    rt, wk = as_role(RUNTIME), as_role(WORKER)
    wk_hash = as_role(WORKER)  # plans cached in this session avoid nested loops where they can
    wk_hash.execute("SET enable_nestloop = off")
    # a short history (8 fan-out Runs, 264 steps) and 20 Runs waiting with their roots ready, then
    # statistics taken while the attempt queue is empty -- the state in which the benchmark's
    # lease_acquire hashed and sorted its whole backlog on every call
    start(as_role, pkg, "fan", 8)
    assert _complete_all(rt, wk) == 8 * (FAN + 1)
    runs = start(as_role, pkg, "fan", 20)
    for t in ("runs", "step_runs", "run_attempts", "task_attempt_admissions"):
        ql3_owner.execute(f"VACUUM ANALYZE ql3.{t}")
    _complete_roots(rt, wk)  # 640 ready children

    costs = {}
    for pages in (2, None):  # 2 pages (128 attempts) queued for a lease, then all the rest (512)
        n = 0
        while (pages is None or n < pages) and api.task_attempt_candidates(rt, None, 64):
            api.task_attempt_admit_page(rt, None, 64)
            n += 1
        queued = ql3_owner.execute("SELECT count(*) FROM ql3.run_attempts WHERE status = 'claimed'"
                                   " AND NOT lease_active").fetchone()[0]
        costs[pages] = (queued, _lease_cost(wk), _lease_cost(wk_hash))
        while api.lease_acquire_start(wk, "w-drain", "local_process", 64, 600000):
            pass

    (q1, g1, h1), (q2, g2, h2) = costs[2], costs[None]
    assert (q1, q2) == (128, 512), costs
    # a B-tree may gain a level between the two sizes: a few buffers, not a per-attempt cost
    assert g2 <= g1 + 8, costs
    assert h2 <= h1 + 8, costs
