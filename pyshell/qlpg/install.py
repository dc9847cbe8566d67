"""`qlpg package install` and `qlpg workflow start`: the package-facing flows (ADR-0223).

``install_package`` runs as ``ql3_package_manager``: materialize → reconcile → publish; the
revision digest computed here must equal the one SQL answers (canonical digest check).
``start_workflow`` runs as ``ql3_package_executor``: snapshot → plan → admit; an ambiguous
COMMIT is resolved with ``workflow_admission_inspect``, never by building a new plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psycopg

from . import api, errors, plan as planmod
from .manifest import PackageManifest, load_package


@dataclass(frozen=True)
class InstallResult:
    """What an install did: ``outcome`` inserted (new generation) or idempotent."""

    manifest: PackageManifest
    project_id: str
    outcome: str
    generation: int
    revision_digest: str
    reconciliation_receipt_digest: str
    publication_id: str
    publication_digest: str


def install_package(conn: psycopg.Connection, directory: str | Path, project_id: str = "default") -> InstallResult:
    """Install the package in ``directory`` (``qinglong-package.yaml``) as ``ql3_package_manager``.

    Raises :class:`qlpg.manifest.ManifestError` (file, field, rule), :class:`qlpg.errors.IntegrityFailure`
    when SQL's revision digest differs from Python's, or the SQL errors of the three calls.
    """
    manifest = load_package(directory)
    doc = planmod.materialized_document(manifest, project_id)
    expected = planmod.revision_digest(doc)
    m = api.package_revision_materialize(conn, doc)
    if m["revision_digest"] != expected:
        raise errors.IntegrityFailure(
            f"revision digest mismatch: Python computed {expected}, SQL recorded {m['revision_digest']}")
    rec = api.task_reconciliation_record(conn, project_id, manifest.package, m["generation"])
    pub = api.automation_publish(conn, project_id, manifest.package, m["generation"])
    return InstallResult(manifest, project_id, m["outcome"], m["generation"], m["revision_digest"],
                         rec["receipt_digest"], pub["publication_id"], pub["publication_digest"])


def prepare_plan(conn: psycopg.Connection, project_id: str, package_id: str, workflow_key: str,
                 run_id: str | None = None) -> tuple[dict, str]:
    """Snapshot the current publication and build the plan; returns ``(plan, plan_digest)``."""
    snap = api.workflow_admission_snapshot(conn, project_id, package_id, workflow_key)
    for key, s in snap["steps"].items():
        if not s.get("task_enabled", True):
            raise errors.StartGuardDenied(f"task {s['task_key']} of step {key} is disabled")
    plan = planmod.build_plan(snap, run_id)
    return plan, planmod.plan_digest(plan)


# Workflow admission runs at READ COMMITTED: ql3.workflow_plan_admit holds every invariant by a
# lock (package/publisher boundaries and their rows, the Run lock), a unique constraint or
# INSERT ... ON CONFLICT, so SSI adds nothing but false positives — its existence probes (replay by
# plan digest, run and StepRun ids) sit on the same index pages that concurrent admissions insert
# into, and at SERIALIZABLE four concurrent starters spent most of their time retrying 40001
# (docs/benchmarks.md "Workflow admission"). $QLPG_ADMISSION_ISOLATION may say otherwise.
ADMISSION_ISOLATION = {"serializable": psycopg.IsolationLevel.SERIALIZABLE,
                       "repeatable read": psycopg.IsolationLevel.REPEATABLE_READ,
                       "read committed": psycopg.IsolationLevel.READ_COMMITTED}


def admission_isolation() -> psycopg.IsolationLevel:
    """Isolation of the admission call (``$QLPG_ADMISSION_ISOLATION``, default READ COMMITTED)."""
    import os

    v = os.environ.get("QLPG_ADMISSION_ISOLATION", "read committed").lower().replace("_", " ")
    return ADMISSION_ISOLATION.get(v, psycopg.IsolationLevel.READ_COMMITTED)


def admit_plan(conn: psycopg.Connection, plan: dict, digest: str, reconnect=None) -> api.AdmissionReceipt:
    """Admit ``plan``; on a lost COMMIT response (connection error) reconnect via ``reconnect()`` and
    inspect the durable receipt, re-sending the *same* plan only when nothing committed.
    Verifies the receipt's plan digest and receipt digest."""
    body = dict(plan, plan_digest=digest)
    level = admission_isolation()
    try:
        rec = api.workflow_plan_admit(conn, body, isolation=level)
    except psycopg.OperationalError:
        if reconnect is None:
            raise
        conn = reconnect()
        try:
            rec = api.workflow_admission_inspect(conn, plan_digest=digest)
        except errors.Unavailable:
            rec = api.workflow_plan_admit(conn, body, isolation=level)
    if rec.plan_digest != digest:
        raise errors.IntegrityFailure(f"admission receipt binds plan {rec.plan_digest}, expected {digest}")
    planmod.verify_receipt(rec.receipt, rec.receipt_digest, planmod.ADMISSION_RECEIPT_DOMAIN)
    return rec


def start_workflow(conn: psycopg.Connection, project_id: str, package_id: str, workflow_key: str,
                   run_id: str | None = None, reconnect=None) -> api.AdmissionReceipt:
    """Build and admit one Workflow Run as ``ql3_package_executor``; returns the durable receipt.
    ``reconnect`` (a callable returning a new connection): resolve a lost COMMIT response, see
    :func:`admit_plan`."""
    plan, digest = prepare_plan(conn, project_id, package_id, workflow_key, run_id)
    return admit_plan(conn, plan, digest, reconnect=reconnect)
