"""ADR-0023 §2 under concurrency (issue 3 §5): 16 writers on 16 separate connections, released
together by a barrier, through the real Python API (SERIALIZABLE transactions, 40001 retried) and
through plain READ COMMITTED statements.

* same new identity, same content  -> exactly one ``inserted``, 15 ``idempotent``, one row, and
  every caller gets the winner's ``created_at_ms``;
* same new identity, 16 different contents -> exactly one wins, the 15 others get QL201, and the
  stored row is the winner's — in every one of 20 rounds.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from qlpg import api, db, errors
from qlpg.revision import execution_revision_digest

WRITERS = 16
ROUNDS = 20
P = "proj-c"
TABLE = "ql3.task_execution_revisions"


@pytest.fixture(scope="module")
def mdb(postgresql_noproc, test_logins):
    from security import support

    yield from support.module_db(postgresql_noproc, test_logins, "taskrevc")


@pytest.fixture(scope="module")
def owner(mdb):
    conn = psycopg.connect(mdb.conninfo, autocommit=True)
    yield conn
    conn.close()


@pytest.fixture(scope="module")
def writer_conns(mdb):
    """16 separate admin connections (separate backends)."""
    conns = [db.connect(mdb.conninfo_as("ql3_admin"), application_name=f"rev-writer-{i}") for i in range(WRITERS)]
    pids = {c.info.backend_pid for c in conns}
    assert len(pids) == WRITERS
    yield conns
    for c in conns:
        c.close()


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(max_workers=WRITERS) as ex:
        yield ex


def template(i: int) -> dict:
    return {"command": ["bash", "-c", f"echo writer {i}"], "timeout_ms": 1000 + i, "labels": {"writer": i}}


def race(pool, conns, fn):
    """Run ``fn(i, conn)`` for every connection at the same moment; return results/exceptions by index."""
    # Every connection must be idle in autocommit with no transaction left open by an earlier call
    # (a raw statement on such a connection would silently join that transaction).
    for c in conns:
        assert c.autocommit and c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE, c
    barrier = threading.Barrier(len(conns), timeout=30)

    def one(i):
        barrier.wait()
        try:
            return fn(i, conns[i])
        except Exception as exc:  # collected, not raised: every outcome is checked
            return exc

    return list(pool.map(one, range(len(conns))))


def rows_of(owner, task_id):
    return owner.execute(f"SELECT task_revision, content_digest, created_at_ms FROM {TABLE} WHERE task_id = %s",
                         (task_id,)).fetchall()


@pytest.mark.parametrize("path", ["api-serializable", "sql-read-committed"])
def test_same_content_one_inserted_rest_idempotent(owner, writer_conns, pool, path):
    same = template(0)
    for rnd in range(5):
        task_id = f"pkg:c:{uuid.uuid4().hex[:10]}"
        rev = f"rev-{rnd}"

        def write(i, conn):
            if path == "api-serializable":
                return api.task_revision_insert(conn, P, task_id, rev, "local_process", same, "ctx:1")
            row = conn.execute("SELECT current_setting('transaction_isolation') AS iso,"
                               " * FROM ql3.task_revision_insert(%s, %s, %s, 'local_process', %s::jsonb, 'ctx:1')",
                               (P, task_id, rev, json.dumps(same))).fetchone()
            assert row["iso"] == "read committed", row
            return row

        results = race(pool, writer_conns, write)
        errs = [r for r in results if isinstance(r, Exception)]
        assert not errs, errs
        outcomes = sorted(r["outcome"] for r in results)
        assert outcomes == ["idempotent"] * (WRITERS - 1) + ["inserted"], outcomes
        rows = rows_of(owner, task_id)
        assert len(rows) == 1
        _, digest, created = rows[0]
        assert digest == execution_revision_digest(P, task_id, rev, "local_process", same, "ctx:1")
        # Everybody got the first (only) write's timestamp and digest.
        assert {(r["content_digest"], r["created_at_ms"]) for r in results} == {(digest, created)}


@pytest.mark.parametrize("path", ["api-serializable", "sql-read-committed"])
def test_different_content_exactly_one_wins_every_round(owner, writer_conns, pool, path):
    rounds = ROUNDS if path == "api-serializable" else ROUNDS // 2
    for rnd in range(rounds):
        task_id = f"pkg:c:{uuid.uuid4().hex[:10]}"
        rev = "rev-x"

        def write(i, conn):
            if path == "api-serializable":
                return api.task_revision_insert(conn, P, task_id, rev, "local_process", template(i), None)
            return conn.execute("SELECT * FROM ql3.task_revision_insert(%s, %s, %s, 'local_process', %s::jsonb, NULL)",
                                (P, task_id, rev, json.dumps(template(i)))).fetchone()

        results = race(pool, writer_conns, write)
        winners = [i for i, r in enumerate(results) if not isinstance(r, Exception)]
        losers = [r for r in results if isinstance(r, Exception)]
        assert len(winners) == 1, (rnd, results)
        assert results[winners[0]]["outcome"] == "inserted"
        for exc in losers:
            state = exc.sqlstate if isinstance(exc, (psycopg.Error, errors.QlpgError)) else None
            assert state == "QL201", (rnd, repr(exc))
            if isinstance(exc, errors.QlpgError):
                assert isinstance(exc, errors.ImmutableConflict)
        rows = rows_of(owner, task_id)
        assert len(rows) == 1
        w = winners[0]
        assert rows[0][1] == results[w]["content_digest"] == execution_revision_digest(
            P, task_id, rev, "local_process", template(w), None)
        assert rows[0][2] == results[w]["created_at_ms"]


@pytest.mark.parametrize("level", ["SERIALIZABLE", "REPEATABLE READ", "READ COMMITTED"])
def test_writer_with_older_snapshot_retries_never_duplicates(mdb, owner, level):
    """A transaction whose snapshot predates a concurrent winner gets 40001 (retryable) under
    snapshot isolation -- never 23505 and never an overwrite -- and idempotent under READ COMMITTED."""
    task_id = f"pkg:c:{uuid.uuid4().hex[:10]}"
    body = json.dumps(template(1))
    late = psycopg.connect(mdb.conninfo_as("ql3_admin"))
    first = db.connect(mdb.conninfo_as("ql3_admin"))
    try:
        late.execute(f"BEGIN ISOLATION LEVEL {level}")
        late.execute("SELECT count(*) FROM pg_class")  # the snapshot is taken here
        won = first.execute("SELECT * FROM ql3.task_revision_insert(%s, %s, 'r', 'local_process', %s::jsonb, NULL)",
                            (P, task_id, body)).fetchone()
        assert won["outcome"] == "inserted"
        if level == "READ COMMITTED":
            row = late.execute("SELECT * FROM ql3.task_revision_insert(%s, %s, 'r', 'local_process', %s::jsonb, NULL)",
                               (P, task_id, body)).fetchone()
            assert row[0] == "idempotent" and row[2] == won["created_at_ms"]
        else:
            with pytest.raises(psycopg.errors.SerializationFailure):
                late.execute("SELECT * FROM ql3.task_revision_insert(%s, %s, 'r', 'local_process', %s::jsonb, NULL)",
                             (P, task_id, body))
        late.rollback()
        assert len(rows_of(owner, task_id)) == 1
    finally:
        late.close()
        first.close()


def test_api_retry_converges_when_winner_commits_during_the_call(mdb, owner, pool):
    """Deterministic race through the Python API (SERIALIZABLE): the winner holds the identity's
    lock in an open transaction; our call takes its snapshot, blocks on the lock, then the winner
    commits. The call must answer idempotent with the winner's time (40001 retried inside
    qlpg.db), and only one row exists."""
    task_id = f"pkg:c:{uuid.uuid4().hex[:10]}"
    winner = psycopg.connect(mdb.conninfo_as("ql3_admin"))
    waiter = db.connect(mdb.conninfo_as("ql3_admin"))
    try:
        won = winner.execute("SELECT * FROM ql3.task_revision_insert(%s, %s, 'r', 'local_process', %s::jsonb, NULL)",
                             (P, task_id, json.dumps(template(2)))).fetchone()
        assert won[0] == "inserted"  # not committed yet: the advisory lock is held
        fut = pool.submit(api.task_revision_insert, waiter, P, task_id, "r", "local_process", template(2), None)
        pid = waiter.info.backend_pid
        deadline = time.monotonic() + 20
        while owner.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0] != "Lock":
            assert time.monotonic() < deadline and not fut.done(), "the waiter never blocked on the identity lock"
            time.sleep(0.01)
        winner.commit()
        out = fut.result(timeout=20)
        assert out["outcome"] == "idempotent" and out["created_at_ms"] == won[2] and out["content_digest"] == won[1]
        assert len(rows_of(owner, task_id)) == 1
    finally:
        winner.close()
        waiter.close()
