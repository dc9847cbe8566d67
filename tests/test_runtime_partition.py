"""Admission shared by several runtime loops: ``Runtime(partition=(k, n))`` / ``qlpg runtime
--partition K/N`` (docs/operations.md "Scaling admission").

Three partitioned loops race over the same candidate pages: together they admit every epoch, each
calls only for the Runs of its own share, and none spends a call on another's epochs (no
replays). Unpartitioned loops racing the same way are still safe (every epoch admitted once).
Bad partitions are refused before any call.
"""

from __future__ import annotations

import threading
import zlib

import pytest

from qlpg import api, cli
from qlpg.runtime import PassStats, Runtime

from helpers import check_audit_invariants
from lifecycle_helpers import RUNTIME, start_run, task, write_package

RUNS = 24


@pytest.fixture
def runs(as_role, tmp_path) -> list[str]:
    pkg = write_package(tmp_path, "partpkg", {"quick": task("true")}, {"one": {"a": {"task": "quick"}}})
    ids = [start_run(as_role, pkg, "one", install_first=(i == 0)) for i in range(RUNS)]
    return ids


def _race(loops: list[Runtime]) -> list[PassStats]:
    """One admission pass per loop (thread ``loop-<i>``), all released at once; returns each
    loop's counts."""
    out = [PassStats() for _ in loops]
    go = threading.Barrier(len(loops))
    errs: list[BaseException] = []

    def one(i: int) -> None:
        try:
            loops[i]._connection()
            go.wait()
            after = None
            while True:
                after = loops[i].admit_page(after, out[i])
                if after is None:
                    return
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errs.append(exc)

    ts = [threading.Thread(target=one, args=(i,), name=f"loop-{i}") for i in range(len(loops))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "an admission loop hung"
    if errs:
        raise errs[0]
    return out


def _admitted_runs(owner) -> dict[str, int]:
    return {r[0]: r[1] for r in owner.execute(
        "SELECT run_id, count(*) FROM ql3.task_attempt_admissions GROUP BY run_id").fetchall()}


@pytest.fixture
def calls(monkeypatch) -> dict[str, list[str]]:
    """Every ``task_attempt_admit`` call the loops make: thread name -> Run ids."""
    seen: dict[str, list[str]] = {}
    real = api.task_attempt_admit

    def spy(conn, run_id, *args, **kw):
        seen.setdefault(threading.current_thread().name, []).append(run_id)
        return real(conn, run_id, *args, **kw)

    monkeypatch.setattr(api, "task_attempt_admit", spy)
    return seen


def test_partitioned_loops_admit_disjoint_shares_without_replays(qlpg_db, runs, ql3_owner, calls):
    loops = [Runtime(qlpg_db.conninfo_as(RUNTIME), recovery=False, partition=(k, 3)) for k in range(3)]
    try:
        stats = _race(loops)
    finally:
        for rt in loops:
            rt.close()
    share = {k: {r for r in runs if zlib.crc32(r.encode()) % 3 == k} for k in range(3)}
    # loop k called for exactly the Runs of share k, once each, and admitted all of them
    assert {k: sorted(calls.get(f"loop-{k}", [])) for k in range(3)} == {k: sorted(share[k]) for k in range(3)}
    assert [s.admitted for s in stats] == [len(share[k]) for k in range(3)], (stats, share)
    assert [(s.replayed, s.skipped, s.failed) for s in stats] == [(0, 0, 0)] * 3
    assert _admitted_runs(ql3_owner) == {r: 1 for r in runs}
    for r in runs:
        check_audit_invariants(ql3_owner, r)


def test_unpartitioned_loops_racing_are_safe_but_replay(qlpg_db, runs, ql3_owner):
    loops = [Runtime(qlpg_db.conninfo_as(RUNTIME), recovery=False) for _ in range(3)]
    try:
        stats = _race(loops)
    finally:
        for rt in loops:
            rt.close()
    assert sum(s.admitted for s in stats) == RUNS
    assert _admitted_runs(ql3_owner) == {r: 1 for r in runs}
    # a loop's page holds only epochs not yet admitted when it was read, so a late loop may see
    # fewer than RUNS; whatever it saw and did not win was a replay or a skip, never a second attempt
    for s in stats:
        assert s.admitted + s.replayed + s.skipped <= RUNS and s.failed == 0, stats
    for r in runs:
        check_audit_invariants(ql3_owner, r)


@pytest.mark.parametrize("partition", [(2, 2), (-1, 2), (0, 0), (1, 1), ("0", 2)])
def test_bad_partitions_are_refused(partition):
    with pytest.raises(ValueError):
        Runtime("dbname=unused", partition=partition)


def test_partition_and_batch_are_exclusive():
    with pytest.raises(ValueError):
        Runtime("dbname=unused", partition=(0, 2), batch=True)


def test_cli_partition_argument(capsys):
    assert cli._partition("1/3") == (1, 3)
    assert cli._partition("0/1") == (0, 1)
    for bad in ("3/3", "1", "a/b", "-1/2", "0/0"):
        with pytest.raises(Exception):
            cli._partition(bad)
    assert cli.main(["runtime", "--batch", "--partition", "0/2", "--once", "--dsn", "dbname=unused"]) == 2
    assert "--partition" in capsys.readouterr().err
