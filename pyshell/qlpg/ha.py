"""Client-side support for running qlpg under an HA manager (docs/ha.md).

Two small pieces the runtime and worker loops use:

* :func:`is_connection_loss` / :func:`is_ambiguous` classify an exception raised by a call: a
  connection that could not be opened (``ConnectError``) wrote nothing; a connection that broke
  *after* the request was sent (``psycopg.OperationalError``: server closed the connection,
  ``57P01`` admin shutdown, ``57P02`` crash shutdown) leaves the COMMIT **ambiguous** — it may
  have committed. qlpg resolves an ambiguous COMMIT only through the replay rules: worker calls
  are exact replays (the same token and report return the stored answer), an attempt admission is
  answered by ``task_attempt_inspect`` (or the exact replay of the same epoch), a Workflow start by
  ``workflow_admission_inspect`` (or the same plan again) — never by creating new ids.
* The **receipt journal**: when ``$QLPG_RECEIPT_LOG`` names a file, every receipt a client saw
  acknowledged (attempt admissions by the runtime, completions by workers) and every ambiguous
  call it resolved is appended to it as one JSON line. The HA gate (``scripts/ha-gate``) uses the
  journals to prove that no acknowledged receipt was lost across failovers. Completion lines carry
  the lease token so that the gate can issue exact replays; the file is created mode 0600, and a
  token of an ended attempt can only replay that attempt's stored answer. Unset (the default),
  nothing is written.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import psycopg

from . import errors

RECEIPT_LOG_ENV = "QLPG_RECEIPT_LOG"

#: How long a worker call keeps reconnecting (backoff 0.2 s doubling to 2 s) before it gives up:
#: longer than any failover of the HA manager (pg_auto_failover: ~16 s fast settings, ~50 s defaults).
RECONNECT_WINDOW_S = float(os.environ.get("QLPG_RECONNECT_WINDOW_S", "300"))

_lock = threading.Lock()
_files: dict[str, Any] = {}


def is_ambiguous(exc: BaseException) -> bool:
    """True when ``exc`` means the request may have committed (the connection broke mid-call)."""
    return isinstance(exc, psycopg.OperationalError)


def is_connection_loss(exc: BaseException) -> bool:
    """True for errors that a reconnect (with the multi-host DSN) can cure."""
    return isinstance(exc, (psycopg.OperationalError, errors.ConnectError))


def journal_enabled() -> bool:
    return bool(os.environ.get(RECEIPT_LOG_ENV))


def record(kind: str, **fields: Any) -> None:
    """Append one JSON line ``{t, kind, pid, **fields}`` to ``$QLPG_RECEIPT_LOG`` (no-op when unset)."""
    path = os.environ.get(RECEIPT_LOG_ENV)
    if not path:
        return
    line = json.dumps({"t": time.time(), "kind": kind, "pid": os.getpid(), **fields},
                      separators=(",", ":"), sort_keys=True, default=str)
    with _lock:
        f = _files.get(path)
        if f is None:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            f = _files[path] = os.fdopen(fd, "a", buffering=1)
        f.write(line + "\n")
        f.flush()


def _field(result: Any, name: str) -> Any:
    if isinstance(result, dict):
        return result.get(name)
    return getattr(result, name, None)


#: Calls that write nothing: a broken connection during one of them is not an ambiguous COMMIT.
READ_ONLY_CALLS = frozenset({"task_attempt_candidates", "task_attempt_snapshot", "task_attempt_inspect",
                             "cancel_pending_runs", "run_inspect", "run_events_page", "readiness",
                             "workflow_admission_snapshot", "workflow_admission_inspect"})


#: Calls whose lost answer carried a one-time secret (a lease or claim token): a repeat takes other
#: work, and what the lost call took, if it committed, expires and is recovered (a new epoch).
#: (``lease_acquire_start`` leaves the attempt ``starting``: it needs not_running evidence.)
UNRESOLVABLE_CALLS = {"lease_acquire": "expires_if_committed", "recovery_claim": "expires_if_committed",
                      "lease_acquire_start": "needs_evidence_if_committed"}


def record_ambiguous(client: str, call: str, key: Any, result: Any) -> None:
    """Journal one ambiguous call resolved by a replay: ``committed`` when the replay answered the
    stored receipt (``replayed`` true), ``not_committed`` when the replay wrote it, ``replayed``
    when the answer does not say (idempotent calls such as ``attempt_start``)."""
    if not journal_enabled() or call in READ_ONLY_CALLS:
        return
    if isinstance(key, (tuple, list)) and len(key) == 1:
        key = key[0]
    replayed = _field(result, "replayed")
    if call in UNRESOLVABLE_CALLS:
        resolution = UNRESOLVABLE_CALLS[call]
    else:
        resolution = "replayed" if replayed is None else ("committed" if replayed else "not_committed")
    record("ambiguous", client=client, call=call, key=key, resolution=resolution)


def record_completion(worker_id: str, lease: Any, call: str, reported: str | None, exit_code: int | None,
                      result: dict) -> None:
    """Journal an acknowledged attempt completion (``attempt_complete`` / ``attempt_start_failed``)."""
    if not journal_enabled():
        return
    record("completion", client="worker", worker_id=worker_id, attempt_id=lease.attempt_id,
           run_id=lease.run_id, lease_token=lease.lease_token, call=call, reported=reported,
           exit_code=exit_code, outcome=result.get("outcome"), receipt_digest=result.get("receipt_digest"),
           replayed=result.get("replayed"))


def record_attempt_admission(candidate: dict, execution_revision: Any, receipt: Any, resolution: str) -> None:
    """Journal an acknowledged Task Attempt admission. ``resolution``: ``direct`` (the COMMIT was
    acknowledged), ``inspect`` (ambiguous, found committed by ``task_attempt_inspect``) or
    ``readmit`` (ambiguous, nothing committed, the same epoch admitted again)."""
    if not journal_enabled():
        return
    record("attempt_admission", client="runtime", run_id=candidate["run_id"], step_run_id=candidate["step_run_id"],
           step_run_version=candidate["step_run_version"], step_run_digest=candidate["step_run_digest"],
           attempt_id=receipt.attempt_id, attempt=receipt.attempt, receipt_digest=receipt.receipt_digest,
           replayed=receipt.replayed, resolution=resolution, execution_revision=execution_revision)


# ----------------------------------------------------------------------------- durability (qlpg doctor)
#: synchronous_commit values under which an acknowledged authority transaction is on disk on the
#: primary and, when a synchronous standby is configured, flushed (on) or applied (remote_apply)
#: on it before the COMMIT returns. remote_write (standby's OS cache only), local and off are refused.
DURABLE_COMMIT = ("on", "remote_apply")


def durability_check(conn: psycopg.Connection) -> dict:
    """The ``durability`` row of ``qlpg doctor`` (docs/ha.md, docs/operations.md "Durability").

    ``ok`` when this session's effective ``synchronous_commit`` is ``on`` or ``remote_apply`` and no
    database-level setting, nor one of a login in a ``ql3_*`` role (``pg_db_role_setting``), weakens
    it for this database. The
    detail says what an acknowledged COMMIT survives: with ``synchronous_standby_names`` empty only
    a crash of this server (not its loss, nor promotion of an asynchronous standby); with a
    synchronous standby (e.g. pg_auto_failover's ``ANY 1 (...)``) also the loss of the primary.
    """
    rows = conn.execute(
        """SELECT pg_catalog.current_setting('synchronous_commit') AS sc,
                  pg_catalog.current_setting('synchronous_standby_names') AS ssn,
                  pg_catalog.pg_is_in_recovery() AS standby,
                  (SELECT pg_catalog.count(*) FROM pg_catalog.pg_stat_replication) AS walsenders,
                  ARRAY(SELECT COALESCE(r.rolname, 'every role') || ' in ' || COALESCE(d.datname, 'every database')
                               || ': ' || c
                          FROM pg_catalog.pg_db_role_setting s
                          LEFT JOIN pg_catalog.pg_roles r ON r.oid = s.setrole
                          LEFT JOIN pg_catalog.pg_database d ON d.oid = s.setdatabase,
                               LATERAL pg_catalog.unnest(s.setconfig) c
                         WHERE c LIKE 'synchronous\\_commit=%%'
                           AND pg_catalog.split_part(c, '=', 2) NOT IN ('on', 'remote_apply')
                           AND (s.setdatabase = 0 OR d.datname = pg_catalog.current_database())
                           AND (s.setrole = 0 OR EXISTS (
                                 SELECT 1 FROM pg_catalog.pg_auth_members m
                                   JOIN pg_catalog.pg_roles g ON g.oid = m.roleid
                                  WHERE m.member = s.setrole AND g.rolname LIKE 'ql3\\_%%'))
                         ORDER BY 1) AS weaker""").fetchone()
    r = rows if isinstance(rows, dict) else dict(zip(("sc", "ssn", "standby", "walsenders", "weaker"), rows))
    sc, ssn = r["sc"], (r["ssn"] or "").strip()
    ok = sc in DURABLE_COMMIT and not r["weaker"]
    parts = [f"synchronous_commit={sc}", f"synchronous_standby_names={ssn or chr(39) * 2}",
             f"{r['walsenders']} walsender(s)"]
    if r["standby"]:
        parts.append("this server is a standby (qlpg writes only to the primary: use target_session_attrs=read-write)")
    if sc not in DURABLE_COMMIT:
        parts.append(f"NOT DURABLE: qlpg needs on or remote_apply for its authority transactions ({sc} can lose "
                     "an acknowledged receipt on a crash or failover)")
    if r["weaker"]:
        parts.append("NOT DURABLE for some logins: weaker settings " + "; ".join(r["weaker"]))
    if ok and not ssn:
        parts.append("no synchronous standby: an acknowledged COMMIT survives a crash of this server, not its loss; "
                     "an HA manager must never promote an asynchronous standby")
    elif ok:
        parts.append("acknowledged COMMITs are " + ("applied" if sc == "remote_apply" else "flushed")
                     + " on a synchronous standby before they return (survive the loss of the primary)")
        if not r["walsenders"] and not r["standby"]:
            parts.append("WARNING: no standby is connected: commits wait until one is, or until the HA manager "
                         "clears synchronous_standby_names")
    return {"check": "durability", "ok": ok, "detail": "; ".join(parts) + " (docs/ha.md)"}
