"""Typed calls of the ``ql3`` SECURITY DEFINER functions (DESIGN §5), one per function.

Each call takes an open psycopg connection (autocommit; the login must be a member of the role
named in the call's docstring), runs the function in one short transaction through
:func:`qlpg.db.call` (SERIALIZABLE by default, 40001/40P01 retried) and returns plain frozen
dataclasses or dicts. ``QLxxx`` SQLSTATEs surface as :mod:`qlpg.errors` exceptions
(``QL601``/``42501`` when the login is in the wrong role).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import psycopg
from psycopg.types.json import Json, Jsonb

from . import db


def _step_isolation() -> psycopg.IsolationLevel:
    """Isolation of the step-cycle calls (admission, leases, worker reports): READ COMMITTED unless
    ``$QLPG_STEP_ISOLATION`` says otherwise. Each of these functions takes the Run advisory lock (and
    the attempt's) before it reads what it decides on, so READ COMMITTED's per-statement snapshots
    see every committed change of that Run (DESIGN §7: every invariant is a lock, a unique
    constraint or a version CAS); SERIALIZABLE only added predicate-lock conflicts between
    *different* Runs that, with a few workers, failed every retry (docs/api-notes.md)."""
    v = os.environ.get("QLPG_STEP_ISOLATION", "read committed").lower().replace("_", " ")
    return {"serializable": psycopg.IsolationLevel.SERIALIZABLE,
            "repeatable read": psycopg.IsolationLevel.REPEATABLE_READ}.get(v, psycopg.IsolationLevel.READ_COMMITTED)


def _json_text(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# ------------------------------------------------------------------ admin
def task_revision_insert(conn, project_id, task_id, task_revision, executor_type, execution_template,
                         context_ref=None):
    """``ql3.task_revision_insert`` (ql3_admin, ADR-0023 §2): returns ``{outcome, content_digest, created_at_ms}``.

    ``execution_template`` is a mapping (see :mod:`qlpg.revision`). It is checked in Python first
    (same rules and messages as SQL, so a bad template costs no round trip), then sent as a
    serialized copy (later changes to the caller's dict cannot reach the stored fact); SQL
    re-checks everything and is the authority. The digest SQL answers must equal the one Python
    computes, else :class:`IntegrityFailure`. Raises InvalidInput (QL001), LimitExceeded (QL002),
    ImmutableConflict (QL201), NotInRole (QL601) or psycopg's InsufficientPrivilege.
    """
    from .canonical import _thaw, canonical_bytes, domain_digest_bytes
    from .errors import IntegrityFailure, InvalidInput
    from .revision import DOMAIN, execution_revision_document

    doc = execution_revision_document(project_id, task_id, task_revision, executor_type,
                                      execution_template, context_ref)
    expected = domain_digest_bytes(DOMAIN, canonical_bytes(doc))
    try:  # the caller's whole template goes to SQL (which drops unknown fields itself)
        payload = json.dumps(_thaw(execution_template), ensure_ascii=False, separators=(",", ":"),
                             allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"execution_template: not representable as JSON ({exc})") from None
    rows = db.call(conn, "SELECT * FROM ql3.task_revision_insert(%s, %s, %s, %s, %s::jsonb, %s)",
                   (project_id, task_id, task_revision, executor_type, payload, context_ref))
    row = rows[0]
    if row["content_digest"] != expected:
        raise IntegrityFailure(f"task execution revision ({project_id}, {task_id}, {task_revision}): SQL answered "
                               f"content_digest {row['content_digest']}, Python computed {expected}")
    return row


def task_revision_insert_json(conn, project_id, task_id, task_revision, executor_type, template_json_text,
                              context_ref=None):
    """:func:`task_revision_insert` for a template given as JSON text (str or UTF-8 bytes).

    The SQL argument is ``jsonb``, where PostgreSQL has already collapsed duplicate keys; so the
    text is parsed here with :func:`qlpg.canonical.loads_strict` (DESIGN §6) before anything is
    sent: duplicate keys, floats (``1.5``, ``1.0``, ``1e3``), NaN, out-of-range integers, ``\\u0000``
    and lone surrogates anywhere in the document raise InvalidInput (QL001) naming the path
    (``execution_template.command: duplicate object key``); nesting deeper than 32 raises
    LimitExceeded (QL002). Nothing is written then.
    """
    from .canonical import loads_strict
    from .errors import QlpgError

    try:
        template = loads_strict(template_json_text)
    except QlpgError as exc:
        msg = str(exc)
        if msg.startswith("$"):
            msg = "execution_template" + msg[1:]
        raise type(exc)(msg) from exc
    return task_revision_insert(conn, project_id, task_id, task_revision, executor_type, template, context_ref)


def task_revision_resolve(conn, project_id, task_id, task_revision):
    """``ql3.task_revision_resolve`` (ql3_admin): the verified record as a deeply frozen
    :class:`qlpg.revision.ExecutionRevision` (verified again in Python, failing closed).
    Raises InvalidInput (QL001), Unavailable (QL101), IntegrityFailure (QL501), NotInRole (QL601)."""
    from . import errors
    from .revision import ExecutionRevision

    query = "SELECT * FROM ql3.task_revision_resolve(%s, %s, %s)"
    args = (project_id, task_id, task_revision)
    if conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        # One read-only statement: run it alone (one round trip, no BEGIN/COMMIT).
        try:
            rows = conn.execute(query, args).fetchall()
        except psycopg.Error as exc:
            raise errors.translate(exc) from exc
    else:
        rows = db.call(conn, query, args, isolation=psycopg.IsolationLevel.READ_COMMITTED)
    return ExecutionRevision.from_row(rows[0])


def run_cancel_request(conn, run_id: str, reason: str, actor: str) -> dict:
    """``ql3.run_cancel_request`` (ql3_admin, ADR-0228): ``{outcome, cancel_requested_at_ms, run_status}``."""
    return db.call(conn, "SELECT * FROM ql3.run_cancel_request(%s, %s, %s)", (run_id, reason, actor))[0]


def run_inspect(conn, run_id: str) -> dict:
    """``ql3.run_inspect`` (ql3_admin or ql3_runtime): ``{run, steps[], attempts[]}`` (times in ms)."""
    return db.call(conn, "SELECT ql3.run_inspect(%s) AS r", (run_id,), isolation=psycopg.IsolationLevel.READ_COMMITTED)[0]["r"]


def run_events_page(conn, run_id: str, after_sequence: int | None = None, limit: int = 1000) -> list[dict]:
    """``ql3.run_events_page`` (ql3_admin): up to ``limit`` events after ``after_sequence``."""
    return db.call(conn, "SELECT * FROM ql3.run_events_page(%s, %s, %s)", (run_id, after_sequence, limit),
                   isolation=psycopg.IsolationLevel.READ_COMMITTED)


def readiness(conn) -> list[dict]:
    """``ql3.readiness()`` (every role): rows ``{check, ok, detail}``."""
    return db.call(conn, "SELECT * FROM ql3.readiness()", isolation=psycopg.IsolationLevel.READ_COMMITTED)


def recovery_evidence_record(conn, attempt_id: str, evidence: str, actor: str) -> dict:
    """``ql3.recovery_evidence_record`` (ql3_admin): operator evidence ``not_running``/``unknown``."""
    return db.call(conn, "SELECT * FROM ql3.recovery_evidence_record(%s, %s, %s)", (attempt_id, evidence, actor))[0]


# ------------------------------------------------------------------ package manager
def package_revision_materialize(conn, document: Mapping[str, Any]) -> dict:
    """``ql3.package_revision_materialize`` (ql3_package_manager): ``{outcome, generation, revision_digest, …}``.

    The document is sent as ``json`` text so duplicate keys would be seen by SQL.
    """
    return db.call(conn, "SELECT * FROM ql3.package_revision_materialize(%s::json)", (_json_text(document),))[0]


def task_reconciliation_record(conn, project_id: str, package_id: str, generation: int) -> dict:
    """``ql3.task_reconciliation_record`` (ql3_package_manager): ``{outcome, receipt_digest, items}``."""
    return db.call(conn, "SELECT * FROM ql3.task_reconciliation_record(%s, %s, %s)", (project_id, package_id, generation))[0]


def automation_publish(conn, project_id: str, package_id: str, generation: int) -> dict:
    """``ql3.automation_publish`` (ql3_package_manager): ``{outcome, publication_id, publication_digest, generation}``."""
    return db.call(conn, "SELECT * FROM ql3.automation_publish(%s, %s, %s)", (project_id, package_id, generation))[0]


def automation_withdraw(conn, publication_id: str, reason: str) -> dict:
    """``ql3.automation_withdraw`` (ql3_package_manager)."""
    return db.call(conn, "SELECT * FROM ql3.automation_withdraw(%s, %s)", (publication_id, reason))[0]


def package_quarantine(conn, project_id: str, package_id: str, reason: str, actor: str) -> dict:
    """``ql3.package_quarantine`` (ql3_package_manager)."""
    return db.call(conn, "SELECT * FROM ql3.package_quarantine(%s, %s, %s, %s)", (project_id, package_id, reason, actor))[0]


def publisher_revoke(conn, publisher_id: str, reason: str, actor: str) -> dict:
    """``ql3.publisher_revoke`` (ql3_package_manager)."""
    return db.call(conn, "SELECT * FROM ql3.publisher_revoke(%s, %s, %s)", (publisher_id, reason, actor))[0]


# ------------------------------------------------------------------ package executor
@dataclass(frozen=True)
class AdmissionReceipt:
    """Durable receipt of a Workflow admission (``workflow_plan_admit`` / ``_inspect``)."""

    run_id: str
    plan_digest: str
    receipt: dict
    receipt_digest: str
    replayed: bool


def workflow_admission_snapshot(conn, project_id: str, package_id: str, workflow_key: str) -> dict:
    """``ql3.workflow_admission_snapshot`` (ql3_package_executor): facts to build the plan."""
    return db.call(conn, "SELECT ql3.workflow_admission_snapshot(%s, %s, %s) AS s",
                   (project_id, package_id, workflow_key))[0]["s"]


def workflow_plan_admit(conn, plan: Mapping[str, Any], isolation: psycopg.IsolationLevel | None = None) -> AdmissionReceipt:
    """``ql3.workflow_plan_admit`` (ql3_package_executor): admit a plan in one transaction
    (``isolation``: default the shell's, see :func:`qlpg.db.isolation_level`).

    Raises InvalidInput, LimitExceeded, ImmutableConflict, StaleFence, StartGuardDenied,
    IntegrityFailure, NotInRole.
    """
    row = db.call(conn, "SELECT * FROM ql3.workflow_plan_admit(%s::json)", (_json_text(plan),),
                  isolation=isolation)[0]
    return AdmissionReceipt(**row)


def workflow_admission_inspect(conn, run_id: str | None = None, plan_digest: str | None = None) -> AdmissionReceipt:
    """``ql3.workflow_admission_inspect`` (ql3_package_executor); Unavailable (QL101) if nothing committed."""
    row = db.call(conn, "SELECT * FROM ql3.workflow_admission_inspect(%s, %s)", (run_id, plan_digest))[0]
    return AdmissionReceipt(**row)


# ------------------------------------------------------------------ runtime
@dataclass(frozen=True)
class AttemptReceipt:
    """Durable receipt of a Task Attempt admission (``task_attempt_admit`` / ``_inspect``)."""

    attempt_id: str
    attempt: int
    event_id: str
    receipt: dict
    receipt_digest: str
    replayed: bool


def task_attempt_candidates(conn, after: tuple[str, str] | None = None, limit: int = 64) -> list[dict]:
    """``ql3.task_attempt_candidates`` (ql3_runtime): keyset page of ready epochs without a winner."""
    a_run, a_step = after if after else (None, None)
    return db.call(conn, "SELECT * FROM ql3.task_attempt_candidates(%s, %s, %s)", (a_run, a_step, limit),
                   isolation=psycopg.IsolationLevel.READ_COMMITTED)


def task_attempt_snapshot(conn, run_id: str, step_run_id: str, step_run_version: int) -> dict:
    """``ql3.task_attempt_snapshot`` (ql3_runtime): the generation-bound execution revision."""
    return db.call(conn, "SELECT ql3.task_attempt_snapshot(%s, %s, %s) AS s",
                   (run_id, step_run_id, step_run_version), isolation=psycopg.IsolationLevel.READ_COMMITTED)[0]["s"]


def task_attempt_admit(conn, run_id: str, step_run_id: str, step_run_version: int, step_run_digest: str,
                       execution_revision: Mapping[str, Any]) -> AttemptReceipt:
    """``ql3.task_attempt_admit`` (ql3_runtime): admit one ready epoch (ADR-0227 §1-3)."""
    row = db.call(conn, "SELECT * FROM ql3.task_attempt_admit(%s, %s, %s, %s, %s)",
                  (run_id, step_run_id, step_run_version, step_run_digest, Jsonb(dict(execution_revision))), isolation=_step_isolation())[0]
    return AttemptReceipt(**row)


def task_attempt_inspect(conn, run_id: str, step_run_id: str, step_run_version: int) -> AttemptReceipt:
    """``ql3.task_attempt_inspect`` (ql3_runtime); Unavailable (QL101) when nothing committed."""
    row = db.call(conn, "SELECT * FROM ql3.task_attempt_inspect(%s, %s, %s)", (run_id, step_run_id, step_run_version))[0]
    return AttemptReceipt(**row)


def task_attempt_admit_page(conn, after: tuple[str, str] | None = None, limit: int = 64) -> list[dict]:
    """``ql3.task_attempt_admit_page`` (ql3_runtime): admit a whole candidate page in one transaction.

    Rows ``{run_id, step_run_id, step_run_version, outcome admitted|replayed|skipped:<reason>,
    attempt_id, attempt, event_id, receipt, receipt_digest}`` in keyset order; the last row is the
    cursor of the next page. Any refusal but a moved epoch aborts the page (nothing written).
    """
    a_run, a_step = after if after else (None, None)
    return db.call(conn, "SELECT * FROM ql3.task_attempt_admit_page(%s, %s, %s)", (a_run, a_step, limit), isolation=_step_isolation())


def run_cancel_converge(conn, run_id: str, limit: int = 64) -> dict:
    """``ql3.run_cancel_converge`` (ql3_runtime, ADR-0228)."""
    return db.call(conn, "SELECT * FROM ql3.run_cancel_converge(%s, %s)", (run_id, limit))[0]


def cancel_pending_runs(conn, after_run_id: str | None = None, limit: int = 64) -> list[dict]:
    """``ql3.run_cancel_candidates`` (ql3_runtime): Runs with a cancel request still running."""
    return db.call(conn, "SELECT * FROM ql3.run_cancel_candidates(%s, %s)", (after_run_id, limit),
                   isolation=psycopg.IsolationLevel.READ_COMMITTED)


def recovery_claim(conn, claimer_id: str, limit: int = 16, claim_ms: int = 30000) -> list[dict]:
    """``ql3.recovery_claim`` (ql3_runtime): claim expired-lease recovery controls.

    Runs at READ COMMITTED: it is a ``FOR UPDATE SKIP LOCKED`` queue whose invariants are held by
    row locks and the primary key (under SERIALIZABLE concurrent loops mostly abort each other)."""
    return db.call(conn, "SELECT * FROM ql3.recovery_claim(%s, %s, %s)", (claimer_id, limit, claim_ms),
                   isolation=psycopg.IsolationLevel.READ_COMMITTED)


def recovery_resolve(conn, attempt_id: str, claim_token: str) -> dict:
    """``ql3.recovery_resolve`` (ql3_runtime): resolve one claimed control with evidence."""
    return db.call(conn, "SELECT * FROM ql3.recovery_resolve(%s, %s)", (attempt_id, claim_token))[0]


# ------------------------------------------------------------------ worker ingress
@dataclass(frozen=True)
class Lease:
    """One leased attempt: the token is returned once; ``execution_revision`` is the pinned revision."""

    attempt_id: str
    lease_token: str
    lease_expires_at_ms: int
    run_id: str
    step_run_id: str
    step_key: str
    attempt: int
    execution_revision: dict


def lease_acquire(conn, worker_id: str, executor_type: str = "local_process", max_: int = 1,
                  lease_ms: int = 30000) -> list[Lease]:
    """``ql3.lease_acquire`` (ql3_worker_ingress): lease up to ``max_`` claimed attempts."""
    # READ COMMITTED (_step_isolation): FOR UPDATE SKIP LOCKED claiming is a READ COMMITTED idiom;
    # the invariants are row locks and the one-live-lease unique index (docs/api-notes.md).
    rows = db.call(conn, "SELECT * FROM ql3.lease_acquire(%s, %s, %s, %s)", (worker_id, executor_type, max_, lease_ms),
                   isolation=_step_isolation())
    return [Lease(**r) for r in rows]


@dataclass(frozen=True)
class StartedLease(Lease):
    """A lease from ``lease_acquire_start``: ``status`` is ``starting`` (start barrier crossed,
    ``deadline_at_ms`` set) or ``claimed`` (locks were busy: call ``attempt_start`` yourself)."""

    status: str = "claimed"
    deadline_at_ms: int | None = None
    started_at_ms: int | None = None


def lease_acquire_start(conn, worker_id: str, executor_type: str = "local_process", max_: int = 1,
                        lease_ms: int = 30000) -> list[StartedLease]:
    """``ql3.lease_acquire_start`` (ql3_worker_ingress): lease and start up to ``max_`` attempts in one
    transaction (the start barrier re-checks Run and StepRun under the Run lock). Spawn the process right after: a started attempt is past the start barrier."""
    rows = db.call(conn, "SELECT * FROM ql3.lease_acquire_start(%s, %s, %s, %s)",
                   (worker_id, executor_type, max_, lease_ms), isolation=_step_isolation())
    return [StartedLease(**r) for r in rows]


def attempt_running_batch(conn, leases: list[tuple[str, str]]) -> list[dict]:
    """``ql3.attempt_running_batch``: ``attempt_running`` for ``[(attempt_id, token), ...]`` (1..64)
    in one transaction; all or nothing."""
    return db.call(conn, "SELECT * FROM ql3.attempt_running_batch(%s, %s)",
                   ([a for a, _ in leases], [t for _, t in leases]), isolation=_step_isolation())


def attempt_complete_batch(conn, reports: list[tuple[str, str, str, int | None, Mapping[str, Any] | None]]) -> list[dict]:
    """``ql3.attempt_complete_batch``: ``attempt_complete`` for ``[(attempt_id, token, outcome, exit_code,
    detail), ...]`` (1..64) in one transaction; all or nothing. Rows ``{attempt_id, outcome, receipt,
    receipt_digest, replayed}``."""
    details = [Jsonb(dict(d)) if d is not None else None for *_, d in reports]
    return db.call(conn, "SELECT * FROM ql3.attempt_complete_batch(%s, %s, %s, %s::integer[], %s::jsonb[])",
                   ([r[0] for r in reports], [r[1] for r in reports], [r[2] for r in reports],
                    [r[3] for r in reports], details if any(d is not None for d in details) else None), isolation=_step_isolation())


def lease_control(conn, attempt_id: str, token: str, extend_ms: int = 30000) -> dict:
    """``ql3.lease_control``: ``{decision continue|stop_requested, reason, lease_expires_at_ms, deadline_at_ms}``."""
    return db.call(conn, "SELECT * FROM ql3.lease_control(%s, %s, %s)", (attempt_id, token, extend_ms), isolation=_step_isolation())[0]


def attempt_start(conn, attempt_id: str, token: str) -> dict:
    """``ql3.attempt_start``: claimed → starting; ``{deadline_at_ms, started_at_ms, …}``."""
    return db.call(conn, "SELECT * FROM ql3.attempt_start(%s, %s)", (attempt_id, token), isolation=_step_isolation())[0]


def attempt_running(conn, attempt_id: str, token: str) -> dict:
    """``ql3.attempt_running``: starting → running, StepRun ready → running."""
    return db.call(conn, "SELECT * FROM ql3.attempt_running(%s, %s)", (attempt_id, token), isolation=_step_isolation())[0]


def attempt_complete(conn, attempt_id: str, token: str, outcome: str, exit_code: int | None,
                     detail: Mapping[str, Any] | None = None) -> dict:
    """``ql3.attempt_complete``: ``{outcome, receipt, receipt_digest, replayed}``."""
    return db.call(conn, "SELECT * FROM ql3.attempt_complete(%s, %s, %s, %s, %s)",
                   (attempt_id, token, outcome, exit_code, Jsonb(dict(detail)) if detail is not None else None), isolation=_step_isolation())[0]


def attempt_start_failed(conn, attempt_id: str, token: str, detail: Mapping[str, Any] | None = None) -> dict:
    """``ql3.attempt_start_failed``: ``{outcome, receipt, receipt_digest, replayed}``."""
    return db.call(conn, "SELECT * FROM ql3.attempt_start_failed(%s, %s, %s)",
                   (attempt_id, token, Jsonb(dict(detail)) if detail is not None else None), isolation=_step_isolation())[0]


def lease_release(conn, attempt_id: str, token: str, reason: str = "released") -> dict:
    """``ql3.lease_release``: give a lease back before the start barrier."""
    return db.call(conn, "SELECT * FROM ql3.lease_release(%s, %s, %s)", (attempt_id, token, reason), isolation=_step_isolation())[0]


def worker_session_reset(conn, worker_id: str) -> list[dict]:
    """``ql3.worker_session_reset`` (ql3_worker_ingress): a restarting worker declares its old leases dead."""
    return db.call(conn, "SELECT * FROM ql3.worker_session_reset(%s)", (worker_id,))


__all__ = [n for n in dir() if not n.startswith("_") and n not in {"annotations", "json", "psycopg", "db"}]
_ = Json  # re-export convenience
