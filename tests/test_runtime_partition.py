"""Admission shared by several runtime loops: ``Runtime(partition=(k, n))`` / ``qlpg runtime
--partition K/N`` (docs/operations.md "Scaling admission").

Two partitioned loops race over the same candidate pages: together they admit every epoch, each
only the Runs of its own share, and neither spends a call on the other's epochs (no replays). An
unpartitioned loop racing the same way is still safe, and the ledger shows why partitions help:
its losers are answered with replays. Bad partitions are refused before any call.
"""

from __future__ import annotations

import threading
import zlib

import pytest

from qlpg import cli
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
    """One admission pass per loop, all released at once; returns each loop's counts."""
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

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(loops))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errs:
        raise errs[0]
    return out


def _admitted_runs(owner) -> dict[str, int]:
    return {r[0]: r[1] for r in owner.execute(
        "SELECT run_id, count(*) FROM ql3.task_attempt_admissions GROUP BY run_id").fetchall()}


def test_partitioned_loops_admit_disjoint_shares_without_replays(qlpg_db, runs, ql3_owner):
    loops = [Runtime(qlpg_db.conninfo_as(RUNTIME), recovery=False, partition=(k, 3)) for k in range(3)]
    try:
        stats = _race(loops)
    finally:
        for rt in loops:
            rt.close()
    share = {k: {r for r in runs if zlib.crc32(r.encode()) % 3 == k} for k in range(3)}
    assert [s.admitted for s in stats] == [len(share[k]) for k in range(3)], (stats, share)
    assert sum(s.admitted for s in stats) == RUNS
    assert [s.replayed for s in stats] == [0, 0, 0]
    assert [s.skipped for s in stats] == [0, 0, 0]
    # each loop admitted exactly its share: the ledger has one admission per Run, and every Run of
    # share k was admitted by loop k (its attempt ids are in that loop's count; the ledger cannot
    # say who called, so the counts above and the disjoint shares below pin it together)
    assert _admitted_runs(ql3_owner) == {r: 1 for r in runs}
    assert all(share[a].isdisjoint(share[b]) for a in range(3) for b in range(3) if a != b)
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
    # every loop saw every candidate on its pages, so whatever it did not win was a replay or a
    # skip (an epoch admitted between its page read and its call)
    for s in stats:
        assert s.admitted + s.replayed + s.skipped == RUNS, stats
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
    assert "--partition" in capsys.readouterr().out
