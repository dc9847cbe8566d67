"""qlpg.ha: ambiguous-COMMIT resolution by the runtime and the worker, the receipt journal, and the
durability row of `qlpg doctor` (docs/ha.md). The failover behaviour itself is proven by
scripts/ha-gate on a real pg_auto_failover formation."""

from __future__ import annotations

import json
import os
import stat

import psycopg
import pytest

from helpers import EXAMPLES, install_and_start
from qlpg import api, ha
from qlpg.runtime import PassStats, Runtime
from qlpg.worker import Worker


def _journal(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _lose_answer_once(monkeypatch, name: str) -> list[int]:
    """Make ``api.<name>`` commit for real, then raise the error a lost COMMIT answer gives."""
    real = getattr(api, name)
    calls = [0]

    def flaky(conn, *args, **kw):
        calls[0] += 1
        out = real(conn, *args, **kw)
        if calls[0] == 1:
            conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly (simulated)")
        return out

    flaky.__name__ = name
    monkeypatch.setattr(api, name, flaky)
    return calls


def test_runtime_resolves_lost_admission_commit_by_inspect(qlpg_db, as_role, monkeypatch, tmp_path):
    journal = tmp_path / "runtime.jsonl"
    monkeypatch.setenv(ha.RECEIPT_LOG_ENV, str(journal))
    _, rec = install_and_start(qlpg_db, as_role, EXAMPLES / "fanout", "fanout")
    calls = _lose_answer_once(monkeypatch, "task_attempt_admit")
    rt = Runtime(qlpg_db.conninfo_as("ql3_runtime"))
    try:
        stats = PassStats()
        rt.admit_page(None, stats)
    finally:
        rt.close()
    lines = _journal(journal)
    amb = [x for x in lines if x["kind"] == "ambiguous"]
    adm = [x for x in lines if x["kind"] == "attempt_admission"]
    # The first admission's answer was lost: task_attempt_inspect found it committed (no second
    # admission of that epoch); the other roots of the page were admitted normally.
    assert [(x["call"], x["resolution"]) for x in amb] == [("task_attempt_admit", "committed")]
    assert adm[0]["resolution"] == "inspect" and adm[0]["attempt_id"] == amb[0]["key"]
    assert all(x["resolution"] == "direct" for x in adm[1:]) and calls[0] == len(adm)
    assert stats.replayed == 1 and stats.admitted == len(adm) - 1
    assert {x["run_id"] for x in adm} == {rec.run_id}
    with qlpg_db.connect() as owner:
        rows = owner.execute("SELECT attempt_id, receipt_digest FROM ql3.task_attempt_admissions").fetchall()
    assert sorted((r["attempt_id"], r["receipt_digest"]) for r in rows) == \
        sorted((x["attempt_id"], x["receipt_digest"]) for x in adm)
    assert stat.S_IMODE(os.stat(journal).st_mode) == 0o600


def test_worker_replays_lost_completion_commit(qlpg_db, as_role, monkeypatch, tmp_path):
    journal = tmp_path / "worker.jsonl"
    monkeypatch.setenv(ha.RECEIPT_LOG_ENV, str(journal))
    install_and_start(qlpg_db, as_role, EXAMPLES / "fanout", "fanout")
    rt = Runtime(qlpg_db.conninfo_as("ql3_runtime"))
    rt.run_once()
    rt.close()
    calls = _lose_answer_once(monkeypatch, "attempt_complete")
    w = Worker(qlpg_db.conninfo_as("ql3_worker_ingress"), "ha-test-w", tmp_path / "state", lease_ms=30000)
    try:
        assert w.run_once()
    finally:
        w.close()
    assert calls[0] == 2  # the exact replay with the same token and report
    lines = _journal(journal)
    amb = [x for x in lines if x["kind"] == "ambiguous"]
    done = [x for x in lines if x["kind"] == "completion"]
    assert [(x["call"], x["resolution"]) for x in amb] == [("attempt_complete", "committed")]
    assert len(done) == 1 and done[0]["replayed"] is True and done[0]["outcome"] == "succeeded"
    with qlpg_db.connect() as owner:
        r = owner.execute("SELECT receipt_digest FROM ql3.run_attempt_completions WHERE attempt_id = %s",
                          (done[0]["attempt_id"],)).fetchone()
    assert r["receipt_digest"] == done[0]["receipt_digest"]


def test_journal_off_by_default_and_skips_read_only_calls(monkeypatch, tmp_path):
    monkeypatch.delenv(ha.RECEIPT_LOG_ENV, raising=False)
    ha.record("x", a=1)  # no file, no error
    path = tmp_path / "j.jsonl"
    monkeypatch.setenv(ha.RECEIPT_LOG_ENV, str(path))
    ha.record_ambiguous("runtime", "task_attempt_candidates", ("r",), [])
    ha.record_ambiguous("worker", "lease_acquire", ("w",), [])
    ha.record_ambiguous("worker", "attempt_complete", ("a",), {"replayed": False})
    got = [(x["call"], x["key"], x["resolution"]) for x in _journal(path)]
    assert got == [("lease_acquire", "w", "expires_if_committed"), ("attempt_complete", "a", "not_committed")]


def test_durability_row(qlpg_db, as_role):
    admin = as_role("ql3_admin")
    row = ha.durability_check(admin)
    assert row["check"] == "durability" and row["ok"], row
    assert "synchronous_commit=on" in row["detail"]
    admin.execute("SET synchronous_commit = remote_write")
    row = ha.durability_check(admin)
    assert not row["ok"] and "NOT DURABLE" in row["detail"]
    admin.execute("RESET synchronous_commit")
    login = qlpg_db.logins["ql3_worker_ingress"]
    with qlpg_db.connect() as su:
        su.execute(f'ALTER ROLE "{login}" IN DATABASE "{qlpg_db.dbname}" SET synchronous_commit = off')
        try:
            row = ha.durability_check(admin)
        finally:
            su.execute(f'ALTER ROLE "{login}" IN DATABASE "{qlpg_db.dbname}" RESET synchronous_commit')
    assert not row["ok"] and login in row["detail"], row


@pytest.mark.parametrize("setting", ["on", "remote_apply"])
def test_durability_row_accepts(qlpg_db, as_role, setting):
    admin = as_role("ql3_admin")
    admin.execute(f"SET synchronous_commit = {setting}")
    assert ha.durability_check(admin)["ok"]
