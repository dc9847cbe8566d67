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
import json
import re
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


PLAN_FIELDS = ("schema", "project_id", "package_id", "installation_id", "lock_digest", "generation",
               "revision_digest", "publication_id", "publication_digest", "workflow_key",
               "workflow_semantic_digest", "run_id", "steps")
STEP_FIELDS = ("step_key", "step_run_id", "task_key", "task_reference", "source_digest", "needs", "initial_status")
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _text(obj: Mapping[str, Any], key: str, field: str, max_bytes: int) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise InvalidInput(f"{field}.{key}: must be a string")
    if not 1 <= len(v.encode("utf-8")) <= max_bytes:
        raise InvalidInput(f"{field}.{key}: must be 1..{max_bytes} bytes")
    return v


def _ident(obj: Mapping[str, Any], key: str, field: str, max_bytes: int = 36) -> str:
    v = _text(obj, key, field, max_bytes)
    if not _ID_RE.fullmatch(v) or not v.isascii():
        raise InvalidInput(f"{field}.{key}: {v[:80]!r} is not a portable id (^[A-Za-z0-9][A-Za-z0-9._:-]*$)")
    return v


def _keys(obj: Any, field: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise InvalidInput(f"{field}: must be an object")
    for k in obj:
        if k not in required and k not in optional:
            raise InvalidInput(f"{field}: unknown field {str(k)[:64]!r}")
    for k in required:
        if obj.get(k) is None:
            raise InvalidInput(f"{field}.{k}: required")
    return obj


def _check_dag(needs: Mapping[str, list[str]], field: str) -> None:
    for k in sorted(needs, key=lambda x: x.encode("utf-8")):
        n = needs[k]
        if any(x not in needs for x in n):
            raise InvalidInput(f"{field}.{k}.needs: names a step that does not exist")
        if k in n:
            raise InvalidInput(f"{field}.{k}.needs: a step cannot need itself")
    done: set[str] = set()
    left = dict(needs)
    progress = True
    while progress and left:
        progress = False
        for k in sorted(left):
            if all(x in done for x in left[k]):
                done.add(k)
                del left[k]
                progress = True
    if left:
        raise InvalidInput(f"{field}: needs form a cycle among steps "
                           f"{', '.join(sorted(left, key=lambda x: x.encode('utf-8')))}")


def normalize_plan(plan: Any) -> tuple[dict[str, Any], str]:
    """Strict normalisation of a plan — the Python twin of ``ql3.workflow_plan_normalize``.

    Returns ``(normalised plan without plan_digest, plan digest)``: steps sorted by ``step_key`` and
    every ``needs`` sorted (byte order, like SQL's ``COLLATE "C"``). Rejects, with the SQLSTATE SQL
    uses: unknown or missing fields, wrong types, non-portable ids, bad digests, a generation outside
    1..2147483647, duplicate step keys or StepRun ids, needs naming unknown steps, self-needs, cycles,
    a ready step with needs or a pending root (:class:`InvalidInput`, QL001); no steps or more than
    128 steps, or a canonical form over 256 KiB (:class:`LimitExceeded`, QL002 — zero steps is
    QL001); a given ``plan_digest`` other than the recomputed one (:class:`IntegrityFailure`, QL501).
    """
    from .canonical import domain_digest_bytes, validate
    from .errors import IntegrityFailure

    if plan is None:
        raise InvalidInput("plan: must not be null")
    validate(plan)
    d = _keys(plan, "plan", PLAN_FIELDS, ("plan_digest",))
    if d["schema"] != PLAN_SCHEMA:
        raise InvalidInput(f"plan.schema: must be {PLAN_SCHEMA}")
    for k in ("project_id", "package_id", "installation_id", "publication_id", "workflow_key", "run_id"):
        _ident(d, k, "plan")
    for k in ("lock_digest", "revision_digest", "publication_digest", "workflow_semantic_digest"):
        if not _HEX64.fullmatch(_text(d, k, "plan", 64)):
            raise InvalidInput(f"plan.{k}: must be 64 lowercase hex")
    g = d["generation"]
    if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= 2147483647:
        raise InvalidInput("plan.generation: must be an integer 1..2147483647")
    steps_in = d["steps"]
    if not isinstance(steps_in, list) or not steps_in:
        raise InvalidInput("plan.steps: must be a non-empty array")
    if len(steps_in) > MAX_STEPS:
        raise LimitExceeded(f"plan.steps: more than {MAX_STEPS} steps")
    steps, dag, ids = [], {}, set()
    for i, s in enumerate(steps_in):
        field = f"plan.steps[{i}]"
        _keys(s, field, STEP_FIELDS)
        key = _ident(s, "step_key", field, 64)
        srid = _ident(s, "step_run_id", field, 128)
        _ident(s, "task_key", field)
        _text(s, "task_reference", field, 256)
        if not _HEX64.fullmatch(_text(s, "source_digest", field, 64)):
            raise InvalidInput(f"{field}.source_digest: must be 64 lowercase hex")
        if key in dag:
            raise InvalidInput(f"{field}.step_key: duplicate step {key}")
        if srid in ids:
            raise InvalidInput(f"{field}.step_run_id: duplicate StepRun id {srid}")
        ids.add(srid)
        needs = s["needs"]
        if not isinstance(needs, list) or any(not isinstance(x, str) for x in needs) or len(set(needs)) != len(needs):
            raise InvalidInput(f"{field}.needs: must be an array of distinct step keys")
        needs = sorted(needs, key=lambda x: x.encode("utf-8"))
        if s["initial_status"] not in ("pending", "ready"):
            raise InvalidInput(f"{field}.initial_status: must be pending or ready")
        if (s["initial_status"] == "ready") != (not needs):
            raise InvalidInput(f"{field}.initial_status: only root steps (no needs) are ready; steps with needs are pending")
        dag[key] = needs
        steps.append({**s, "needs": needs})
    _check_dag(dag, "plan.steps")
    steps.sort(key=lambda x: x["step_key"].encode("utf-8"))
    out = {k: v for k, v in d.items() if k != "plan_digest"}
    out["steps"] = steps
    # Every value is now a validated string, integer or list of strings and every key fixed ASCII,
    # so json.dumps with sorted keys writes exactly the RFC 8785 bytes (same escapes: \b \f \n \r \t,
    # other controls as lowercase \u00xx, nothing else) -- ~10x faster than the generic canonicaliser
    # on a 128-step plan; tests/test_plan_vectors.py binds both to the same vectors.
    canon = json.dumps(out, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(canon) > MAX_PLAN_BYTES:
        raise LimitExceeded("plan: canonical form larger than 256 KiB")
    digest = domain_digest_bytes(PLAN_SCHEMA, canon)
    if "plan_digest" in d and d["plan_digest"] != digest:
        raise IntegrityFailure(f"plan.plan_digest: {str(d['plan_digest'])[:80]} does not match the recomputed "
                               f"canonical digest {digest}")
    return out, digest


def build_plan(snapshot: Mapping[str, Any], run_id: str | None = None) -> dict[str, Any]:
    """Build the immutable plan from an admission snapshot (``ql3.workflow_admission_snapshot``).

    Binds project, package, installation, lock, generation, materialized revision, publication,
    Workflow definition, the Run id and every StepRun id; roots are ``ready``, the rest ``pending``.
    The result is normalised (steps sorted by ``step_key``, ``needs`` sorted) and checked by
    :func:`normalize_plan`: raises :class:`LimitExceeded` over 128 steps or 256 KiB canonical,
    :class:`InvalidInput` for any other rule.
    """
    run_id = run_id or new_run_id()
    steps_in = snapshot["steps"]
    if len(steps_in) > MAX_STEPS:
        raise LimitExceeded(f"plan.steps: {len(steps_in)} steps, at most {MAX_STEPS}")
    steps = []
    for key in sorted(steps_in, key=lambda k: k.encode("utf-8")):
        s = steps_in[key]
        needs = sorted(s["needs"], key=lambda x: x.encode("utf-8"))
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
    return normalize_plan(plan)[0]


def plan_digest(plan: Mapping[str, Any]) -> str:
    """Domain-separated canonical digest of a plan after :func:`normalize_plan` (``plan_digest``
    field excluded; a given ``plan_digest`` is not checked here)."""
    body = {k: v for k, v in plan.items() if k != "plan_digest"}
    return normalize_plan(body)[1]


def attempt_ids(plan_digest_hex: str, step_run_id_: str, step_run_version: int) -> tuple[str, str]:
    """Deterministic ``(wta:…, wte:…)`` ids of a ready epoch (DESIGN §6)."""
    h = hashlib.sha256(
        ATTEMPT_ID_DOMAIN.encode() + b"\0" + plan_digest_hex.encode() + b"\0"
        + step_run_id_.encode() + b"\0" + str(step_run_version).encode()
    ).hexdigest()[:32]
    return "wta:" + h, "wte:" + h


def _ascii_keys(obj: Any) -> bool:
    if isinstance(obj, Mapping):
        return all(isinstance(k, str) and k.isascii() and _ascii_keys(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_ascii_keys(v) for v in obj)
    return not isinstance(obj, float)


def fast_canonical_bytes(obj: Any) -> bytes:
    """RFC 8785 bytes of ``obj``: ``json.dumps`` with sorted keys when that is provably the same
    (validated document, every key ASCII — so code-point order is UTF-16 order — and no float),
    else the generic canonicaliser. Raises like :func:`qlpg.canonical.canonical_bytes`."""
    from .canonical import canonical_bytes, validate

    validate(obj)
    if _ascii_keys(obj):
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return canonical_bytes(obj)


def verify_receipt(receipt: Mapping[str, Any], receipt_digest_hex: str, domain: str) -> None:
    """Raise :class:`qlpg.errors.IntegrityFailure` unless ``receipt`` hashes to ``receipt_digest_hex``."""
    from .canonical import domain_digest_bytes
    from .errors import IntegrityFailure

    got = domain_digest_bytes(domain, fast_canonical_bytes(receipt))
    if got != receipt_digest_hex:
        raise IntegrityFailure(f"receipt digest mismatch under {domain}: stored {receipt_digest_hex}, computed {got}")


__all__ = [
    "materialized_document", "revision_digest", "build_plan", "normalize_plan", "plan_digest", "step_run_id",
    "new_run_id", "installation_id", "attempt_ids", "verify_receipt", "fast_canonical_bytes", "InvalidInput",
]
