"""Task Execution Revisions: the ExecutionSpec boundary check and the content digest
(ADR-0023 §3), byte-identical to ``ql3.execution_template_normalize`` and
``ql3.execution_revision_digest``.

Template shape (unknown top-level fields are dropped; optional fields given as null are absent;
no defaults are inserted; array order is kept)::

    {
      "command":           [str, ...],     # required, 1..256 non-empty strings, each <= 4096 UTF-8 bytes
      "working_directory": str,            # optional, non-empty, <= 4096 bytes
      "timeout_ms":        int,            # required, 1..86400000 milliseconds
      "env_names":         [str, ...],     # optional, <= 128 unique ^[A-Za-z_][A-Za-z0-9_]{0,127}$ names
      "resource_policy":   {str: int},     # optional, <= 16 keys ^[a-z][a-z0-9_]{0,63}$, values 0..2^53-1
    }

Secrets never enter a template: ``env_names`` holds names only (``NAME=value`` is rejected) and a
non-null top-level ``env``/``environment`` field is rejected rather than silently dropped.
Errors: :class:`qlpg.errors.InvalidInput` (QL001) for type/format/range, :class:`LimitExceeded`
(QL002) for count/byte-length bounds; messages name the field (``execution_template.command[2]``).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .canonical import MAX_SAFE_INT, _BAD_CHARS, canonical_bytes, domain_digest_bytes, _thaw
from .errors import IntegrityFailure, InvalidInput, LimitExceeded, QlpgError

__all__ = [
    "DOMAIN",
    "EXECUTOR_TYPES",
    "normalize_execution_template",
    "execution_revision_document",
    "execution_revision_digest",
    "ExecutionRevision",
]

DOMAIN = "qinglong/task-execution-revision@v1"
EXECUTOR_TYPES = ("local_process", "remote_worker")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_POLICY_KEY = re.compile(r"[a-z][a-z0-9_]{0,63}")
_P = "execution_template"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _text(v: Any, path: str) -> str:
    """A str free of NUL and lone surrogates (which PostgreSQL text cannot hold)."""
    if _BAD_CHARS.search(v):
        raise InvalidInput(f"{path}: string is not valid unicode text (\\u0000 or lone surrogate)")
    return v


def _nbytes(v: str) -> int:
    return len(v.encode("utf-8"))


def _present(t: Mapping, key: str) -> bool:
    return key in t and t[key] is not None


def normalize_execution_template(obj: Any) -> dict:
    """Validate an execution template and return a new plain dict of the known, present fields.

    See the module docstring for the shape. The result shares nothing with ``obj``.
    Raises InvalidInput (QL001) / LimitExceeded (QL002) naming the field. Source: ADR-0023 §3.
    """
    if not isinstance(obj, Mapping):
        raise InvalidInput(f"{_P}: must be a JSON object")
    for k in ("env", "environment"):
        if _present(obj, k):
            raise InvalidInput(f"{_P}.{k}: environment values are not allowed; use env_names")
    out: dict[str, Any] = {}

    if not _present(obj, "command"):
        raise InvalidInput(f"{_P}.command: is required")
    cmd = obj["command"]
    if not isinstance(cmd, (list, tuple)) or len(cmd) == 0:
        raise InvalidInput(f"{_P}.command: must be a non-empty array of strings")
    if len(cmd) > 256:
        raise LimitExceeded(f"{_P}.command: more than 256 entries")
    for i, arg in enumerate(cmd):
        path = f"{_P}.command[{i}]"
        if not isinstance(arg, str) or arg == "":
            raise InvalidInput(f"{path}: must be a non-empty string")
        _text(arg, path)
        if _nbytes(arg) > 4096:
            raise LimitExceeded(f"{path}: longer than 4096 bytes")
    out["command"] = [str(a) for a in cmd]

    if _present(obj, "working_directory"):
        wd = obj["working_directory"]
        path = f"{_P}.working_directory"
        if not isinstance(wd, str) or wd == "":
            raise InvalidInput(f"{path}: must be a non-empty string")
        _text(wd, path)
        if _nbytes(wd) > 4096:
            raise LimitExceeded(f"{path}: longer than 4096 bytes")
        out["working_directory"] = str(wd)

    if not _present(obj, "timeout_ms"):
        raise InvalidInput(f"{_P}.timeout_ms: is required")
    t = obj["timeout_ms"]
    if not _is_int(t) or not 1 <= t <= 86_400_000:
        raise InvalidInput(f"{_P}.timeout_ms: must be an integer from 1 to 86400000 (milliseconds)")
    out["timeout_ms"] = int(t)

    if _present(obj, "env_names"):
        names = obj["env_names"]
        if not isinstance(names, (list, tuple)):
            raise InvalidInput(f"{_P}.env_names: must be an array of variable names")
        if len(names) > 128:
            raise LimitExceeded(f"{_P}.env_names: more than 128 entries")
        seen: set[str] = set()
        for i, n in enumerate(names):
            path = f"{_P}.env_names[{i}]"
            if not isinstance(n, str):
                raise InvalidInput(f"{path}: must be a string")
            if "=" in n:
                raise InvalidInput(
                    f"{path}: must be a bare variable name; NAME=value pairs are not allowed "
                    "(secrets never enter the template)"
                )
            if not _ENV_NAME.fullmatch(n):
                raise InvalidInput(f"{path}: must match ^[A-Za-z_][A-Za-z0-9_]{{0,127}}$")
            if n in seen:
                raise InvalidInput(f"{path}: duplicate name {n}")
            seen.add(n)
        out["env_names"] = [str(n) for n in names]

    if _present(obj, "resource_policy"):
        pol = obj["resource_policy"]
        if not isinstance(pol, Mapping):
            raise InvalidInput(f"{_P}.resource_policy: must be a JSON object")
        if len(pol) > 16:
            raise LimitExceeded(f"{_P}.resource_policy: more than 16 keys")
        for k in sorted(pol, key=lambda s: s.encode("utf-8", "surrogatepass") if isinstance(s, str) else b""):
            if not isinstance(k, str) or not _POLICY_KEY.fullmatch(k):
                shown = json.dumps(k, ensure_ascii=False) if isinstance(k, str) else repr(k)
                raise InvalidInput(
                    f"{_P}.resource_policy[{shown}]: key must match ^[a-z][a-z0-9_]{{0,63}}$"
                )
            v = pol[k]
            if not _is_int(v) or not 0 <= v <= MAX_SAFE_INT:
                raise InvalidInput(
                    f"{_P}.resource_policy.{k}: must be an integer from 0 to 9007199254740991"
                )
        out["resource_policy"] = {str(k): int(v) for k, v in pol.items()}
    return out


def _nonempty(name: str, v: Any) -> str:
    if not isinstance(v, str) or v == "":
        raise InvalidInput(f"{name}: must be a non-empty string")
    return _text(v, name)


def execution_revision_document(
    project_id: str,
    task_id: str,
    task_revision: str,
    executor_type: str,
    template: Any,
    context_ref: str | None,
) -> dict:
    """The digested document: identity, executor, normalized template and context_ref (or None).

    Validation order and messages match ``ql3.execution_revision_digest``.
    """
    _nonempty("project_id", project_id)
    _nonempty("task_id", task_id)
    _nonempty("task_revision", task_revision)
    if executor_type not in EXECUTOR_TYPES:
        raise InvalidInput("executor_type: must be local_process or remote_worker")
    if template is None:
        raise InvalidInput(f"{_P}: is required")
    if context_ref is not None:
        if not isinstance(context_ref, str) or context_ref == "":
            raise InvalidInput("context_ref: must be a non-empty string or null")
        _text(context_ref, "context_ref")
    return {
        "project_id": project_id,
        "task_id": task_id,
        "task_revision": task_revision,
        "executor_type": executor_type,
        "execution_template": normalize_execution_template(template),
        "context_ref": context_ref,
    }


def execution_revision_digest(
    project_id: str,
    task_id: str,
    task_revision: str,
    executor_type: str,
    template: Any,
    context_ref: str | None,
) -> str:
    """content_digest of a Task Execution Revision: 64 lowercase hex chars.

    ``domain_digest('qinglong/task-execution-revision@v1', canonical({project_id, task_id,
    task_revision, executor_type, execution_template: normalized, context_ref}))``.
    Raises InvalidInput (QL001) / LimitExceeded (QL002). Source: ADR-0023 §3.
    """
    doc = execution_revision_document(
        project_id, task_id, task_revision, executor_type, template, context_ref
    )
    return domain_digest_bytes(DOMAIN, canonical_bytes(doc))


def _freeze(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return tuple(_freeze(v) for v in obj)
    return obj


def _field(row: Any, name: str, index: int) -> Any:
    if isinstance(row, Mapping):
        return row[name]
    return row[index]


_ROW_FIELDS = (
    "project_id",
    "task_id",
    "task_revision",
    "executor_type",
    "execution_template",
    "context_ref",
    "content_digest",
    "created_at_ms",
)


@dataclass(frozen=True)
class ExecutionRevision:
    """An immutable, verified Task Execution Revision (ADR-0023 §1, §3).

    ``execution_template`` is deeply frozen (MappingProxyType / tuples); ``content_digest`` is 64
    lowercase hex chars; ``created_at_ms`` is database time of the first successful insert, in
    milliseconds since the Unix epoch.
    """

    project_id: str
    task_id: str
    task_revision: str
    executor_type: str
    execution_template: Mapping[str, Any]
    context_ref: str | None
    content_digest: str
    created_at_ms: int

    @classmethod
    def from_row(cls, row: Any) -> "ExecutionRevision":
        """Build from a database row (mapping with the column names, or a sequence in the order
        project_id, task_id, task_revision, executor_type, execution_template, context_ref,
        content_digest, created_at_ms) and verify it, failing closed.

        The stored template must already be normalized and the digest must match the recomputed
        one; otherwise (or for any invalid field, bad timestamp) raises
        :class:`qlpg.errors.IntegrityFailure` (QL501) with the cause attached.
        """
        vals = {n: _field(row, n, i) for i, n in enumerate(_ROW_FIELDS)}
        tmpl = vals["execution_template"]
        if isinstance(tmpl, (str, bytes, bytearray)):
            from .canonical import loads_strict

            try:
                tmpl = loads_strict(tmpl)
            except QlpgError as exc:
                raise IntegrityFailure(f"execution_template: stored JSON is invalid: {exc}") from exc
        created = vals["created_at_ms"]
        if not _is_int(created) or created < 0:
            raise IntegrityFailure(f"created_at_ms: corrupt value {created!r}")
        try:
            doc = execution_revision_document(
                vals["project_id"], vals["task_id"], vals["task_revision"],
                vals["executor_type"], tmpl, vals["context_ref"],
            )
            digest = domain_digest_bytes(DOMAIN, canonical_bytes(doc))
            stored_canonical = canonical_bytes(_thaw(tmpl))
        except QlpgError as exc:
            raise IntegrityFailure(f"task execution revision fails validation: {exc}") from exc
        if stored_canonical != canonical_bytes(doc["execution_template"]):
            raise IntegrityFailure("execution_template: stored template is not normalized")
        if vals["content_digest"] != digest:
            raise IntegrityFailure(
                f"content_digest: stored {vals['content_digest']!r} != recomputed {digest}"
            )
        return cls(
            project_id=doc["project_id"],
            task_id=doc["task_id"],
            task_revision=doc["task_revision"],
            executor_type=doc["executor_type"],
            execution_template=_freeze(doc["execution_template"]),
            context_ref=doc["context_ref"],
            content_digest=digest,
            created_at_ms=int(created),
        )

    def to_json(self) -> dict:
        """A plain, independent dict (deep copy) with the same field names."""
        return {
            "project_id": self.project_id,
            "task_id": self.task_id,
            "task_revision": self.task_revision,
            "executor_type": self.executor_type,
            "execution_template": copy.deepcopy(_thaw(self.execution_template)),
            "context_ref": self.context_ref,
            "content_digest": self.content_digest,
            "created_at_ms": self.created_at_ms,
        }
