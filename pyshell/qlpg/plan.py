"""Package documents and Workflow plans, built in Python and checked again in SQL (ADR-0223).

Shapes:

* :func:`materialized_document` → ``qinglong/package-materialized-revision@v1`` document for
  ``ql3.package_revision_materialize``; :func:`revision_digest` gives the digest SQL must answer.
* :func:`build_plan` → ``qinglong/plugin-package-workflow-execution-plan@v1`` plan from the
  snapshot of ``ql3.workflow_admission_snapshot``; :func:`plan_digest` its domain-separated
  canonical SHA-256 (steps sorted by ``step_key``, ``needs`` sorted, ``plan_digest`` excluded).

Every digest is lowercase hex SHA-256 of ``domain || 0x00 || RFC 8785 canonical JSON`` (DESIGN §6),
byte-identical to ``ql3.domain_digest(domain, ql3.canonical_json(...))``.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, Mapping

from .canonical import domain_digest
from .errors import InvalidInput, LimitExceeded
from .manifest import PackageManifest
from .revision import normalize_execution_template

REVISION_SCHEMA = "qinglong/package-materialized-revision@v1"
PLAN_SCHEMA = "qinglong/plugin-package-workflow-execution-plan@v1"
ADMISSION_RECEIPT_DOMAIN = "qinglong/plugin-package-workflow-admission-receipt@v1"
ATTEMPT_RECEIPT_DOMAIN = "qinglong/plugin-package-workflow-task-attempt-receipt@v1"
COMPLETION_RECEIPT_DOMAIN = "qinglong/plugin-package-workflow-task-completion-receipt@v1"
ATTEMPT_ID_DOMAIN = "qinglong/plugin-package-workflow-task-attempt-id@v1"
MAX_STEPS = 128
MAX_PLAN_BYTES = 256 * 1024


def installation_id(project_id: str, package_id: str) -> str:
    """Stable installation identity of a package in a project: ``inst:`` + 24 hex (≤ 36 bytes)."""
    return "inst:" + hashlib.sha256(f"{project_id}\0{package_id}".encode()).hexdigest()[:24]


def materialized_document(manifest: PackageManifest, project_id: str = "default") -> dict[str, Any]:
    """The materialized revision document of ``manifest`` (normalised like SQL does).

    Tasks carry ``enabled``, ``executor_type`` (``local_process``) and the normalised
    ExecutionSpec template; workflow steps carry ``task`` and sorted ``needs``.
    """
    tasks = {
        name: {
            "enabled": t.enabled,
            "executor_type": "local_process",
            "execution_template": normalize_execution_template(t.execution_template()),
        }
        for name, t in manifest.tasks.items()
    }
    workflows = {
        name: {
            "enabled": w.enabled,
            "steps": {k: {"task": s.task, "needs": sorted(s.needs)} for k, s in w.steps.items()},
        }
        for name, w in manifest.workflows.items()
    }
    return {
        "schema": REVISION_SCHEMA,
        "project_id": project_id,
        "package_id": manifest.package,
        "package_version": manifest.version,
        "publisher_id": manifest.publisher,
        "installation_id": installation_id(project_id, manifest.package),
        "tasks": tasks,
        "workflows": workflows,
    }


def revision_digest(document: Mapping[str, Any]) -> str:
    """Digest of a materialized revision document (domain ``qinglong/package-materialized-revision@v1``)."""
    return domain_digest(REVISION_SCHEMA, document)


def step_run_id(run_id: str, step_key: str) -> str:
    """Deterministic StepRun id of a step in a Run: ``sr:`` + 32 hex of SHA-256(run_id 0x00 step_key)."""
    return "sr:" + hashlib.sha256(f"{run_id}\0{step_key}".encode()).hexdigest()[:32]


def new_run_id() -> str:
    """A fresh portable Run id: ``run:`` + 32 hex (36 bytes)."""
    return "run:" + uuid.uuid4().hex


def build_plan(snapshot: Mapping[str, Any], run_id: str | None = None) -> dict[str, Any]:
    """Build the immutable plan from an admission snapshot (``ql3.workflow_admission_snapshot``).

    Binds project, package, installation, lock, generation, materialized revision, publication,
    Workflow definition, the Run id and every StepRun id; roots are ``ready``, the rest ``pending``.
    Raises :class:`LimitExceeded` over 128 steps or 256 KiB canonical, :class:`InvalidInput` for a
    disabled task in the snapshot.
    """
    run_id = run_id or new_run_id()
    steps_in = snapshot["steps"]
    if len(steps_in) > MAX_STEPS:
        raise LimitExceeded(f"plan.steps: {len(steps_in)} steps, at most {MAX_STEPS}")
    steps = []
    for key in sorted(steps_in):
        s = steps_in[key]
        needs = sorted(s["needs"])
        steps.append(
            {
                "step_key": key,
                "step_run_id": step_run_id(run_id, key),
                "task_key": s["task_key"],
                "task_reference": s["task_reference"],
                "source_digest": s["source_digest"],
                "needs": needs,
                "initial_status": "pending" if needs else "ready",
            }
        )
    plan = {
        "schema": PLAN_SCHEMA,
        "project_id": snapshot["project_id"],
        "package_id": snapshot["package_id"],
        "installation_id": snapshot["installation_id"],
        "lock_digest": snapshot["lock_digest"],
        "generation": snapshot["generation"],
        "revision_digest": snapshot["revision_digest"],
        "publication_id": snapshot["publication_id"],
        "publication_digest": snapshot["publication_digest"],
        "workflow_key": snapshot["workflow_key"],
        "workflow_semantic_digest": snapshot["workflow_semantic_digest"],
        "run_id": run_id,
        "steps": steps,
    }
    from .canonical import canonical_bytes

    if len(canonical_bytes(plan)) > MAX_PLAN_BYTES:
        raise LimitExceeded("plan: canonical form larger than 256 KiB")
    return plan


def plan_digest(plan: Mapping[str, Any]) -> str:
    """Domain-separated canonical digest of a plan (``plan_digest`` field excluded)."""
    body = {k: v for k, v in plan.items() if k != "plan_digest"}
    return domain_digest(PLAN_SCHEMA, body)


def attempt_ids(plan_digest_hex: str, step_run_id_: str, step_run_version: int) -> tuple[str, str]:
    """Deterministic ``(wta:…, wte:…)`` ids of a ready epoch (DESIGN §6)."""
    h = hashlib.sha256(
        ATTEMPT_ID_DOMAIN.encode() + b"\0" + plan_digest_hex.encode() + b"\0"
        + step_run_id_.encode() + b"\0" + str(step_run_version).encode()
    ).hexdigest()[:32]
    return "wta:" + h, "wte:" + h


def verify_receipt(receipt: Mapping[str, Any], receipt_digest_hex: str, domain: str) -> None:
    """Raise :class:`qlpg.errors.IntegrityFailure` unless ``receipt`` hashes to ``receipt_digest_hex``."""
    from .errors import IntegrityFailure

    got = domain_digest(domain, receipt)
    if got != receipt_digest_hex:
        raise IntegrityFailure(f"receipt digest mismatch under {domain}: stored {receipt_digest_hex}, computed {got}")


__all__ = [
    "materialized_document", "revision_digest", "build_plan", "plan_digest", "step_run_id",
    "new_run_id", "installation_id", "attempt_ids", "verify_receipt", "InvalidInput",
]
