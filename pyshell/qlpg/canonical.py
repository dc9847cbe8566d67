"""Canonical JSON and domain-separated digests, byte-identical to ``ql3.canonical_json`` and
``ql3.domain_digest`` (DESIGN §6).

Canonical JSON is RFC 8785 (JCS) restricted to objects with unique keys, arrays, strings,
booleans, null and integers within ±(2^53−1); containers nest at most 32 levels (top-level
container = level 1). Floats (even ``1.0``/``1e2``), NaN/Infinity, out-of-range integers,
duplicate keys, ``\\u0000`` and lone surrogates are rejected with
:class:`qlpg.errors.InvalidInput` (QL001); nesting deeper than 32 levels raises
:class:`qlpg.errors.LimitExceeded` (QL002). Messages name the JSON path the way the SQL side does
(``$.steps[3].needs: duplicate object key``). ``-0`` canonicalises to ``0``.

Digest = lowercase hex SHA-256 of ``UTF-8(domain) || 0x00 || canonical_bytes``.
``tests/vectors/canonical.json`` binds this module to the SQL functions.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

import rfc8785

from .errors import InvalidInput, LimitExceeded

__all__ = [
    "MAX_DEPTH",
    "MAX_SAFE_INT",
    "loads_strict",
    "validate",
    "canonical_bytes",
    "canonical_text",
    "canonicalize_text",
    "domain_digest",
    "domain_digest_bytes",
    "json_path_key",
]

MAX_DEPTH = 32
MAX_SAFE_INT = 2**53 - 1

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INT_TEXT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_DOMAIN = re.compile(r"[a-z0-9][a-z0-9._/-]*@v[0-9]+")
_BAD_CHARS = re.compile("[\x00\ud800-\udfff]")


class _BadNumber:
    """Placeholder left by the parser for a number the canonical form rejects."""

    __slots__ = ("text", "rule")

    def __init__(self, text: str, rule: str) -> None:
        self.text = text
        self.rule = rule


class _DupDict(dict):
    """A parsed object that had a duplicate key (first duplicate kept in ``dup_key``)."""

    dup_key: str = ""


def _parse_int(text: str) -> Any:
    digits = text[1:] if text.startswith("-") else text
    if len(digits) > 16 or int(digits) > MAX_SAFE_INT:
        return _BadNumber(text, f"integer out of range +-(2^53-1) (got {text[:40]})")
    return int(text)  # "-0" -> 0


def _parse_float(text: str) -> Any:
    return _BadNumber(
        text, f"number must be an integer without fraction or exponent (got {text[:40]})"
    )


def _parse_constant(text: str) -> Any:
    return _BadNumber(text, f"number must be an integer without fraction or exponent (got {text})")


def _pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    dup = None
    for k, v in pairs:
        if k in out and dup is None:
            dup = k
        out[k] = v
    if dup is None:
        return out
    bad = _DupDict(out)
    bad.dup_key = dup
    return bad


def _jcs_string(s: str) -> str:
    return rfc8785.dumps(s).decode("utf-8")


def json_path_key(path: str, key: str) -> str:
    """Extend a JSON path display with an object key: ``$.name`` or ``$["odd key"]``."""
    if _IDENT.fullmatch(key):
        return f"{path}.{key}"
    try:
        return f"{path}[{_jcs_string(key)}]"
    except Exception:  # lone surrogates: show them escaped
        return f"{path}[{json.dumps(key)}]"


def _walk(obj: Any, path: str, depth: int, found: dict[str, tuple[str, type]]) -> None:
    """Collect the first violation of each kind (the SQL side applies the same precedence)."""
    if isinstance(obj, str):
        if _BAD_CHARS.search(obj):
            found.setdefault(
                "string",
                (f"{path}: string is not valid unicode text (\\u0000 or lone surrogate)", InvalidInput),
            )
        return
    if obj is None or isinstance(obj, bool):
        return
    if isinstance(obj, int):
        if obj < -MAX_SAFE_INT or obj > MAX_SAFE_INT:
            found.setdefault(
                "number",
                (f"{path}: integer out of range +-(2^53-1) (got {str(obj)[:40]})", InvalidInput),
            )
        return
    if isinstance(obj, _BadNumber):
        found.setdefault("number", (f"{path}: {obj.rule}", InvalidInput))
        return
    if isinstance(obj, float):
        found.setdefault(
            "number",
            (f"{path}: number must be an integer without fraction or exponent (got {obj!r})",
             InvalidInput),
        )
        return
    if isinstance(obj, Mapping):
        if depth > MAX_DEPTH:
            found.setdefault("depth", (f"{path}: nesting depth exceeds 32 levels", LimitExceeded))
            return
        if isinstance(obj, _DupDict):
            found.setdefault(
                "dup", (f"{json_path_key(path, obj.dup_key)}: duplicate object key", InvalidInput)
            )
        for k, v in obj.items():
            if not isinstance(k, str):
                found.setdefault("type", (f"{path}: object key {k!r} is not a string", InvalidInput))
                continue
            kp = json_path_key(path, k)
            if _BAD_CHARS.search(k):
                found.setdefault(
                    "string",
                    (f"{path}: object key is not valid unicode text (\\u0000 or lone surrogate)",
                     InvalidInput),
                )
            _walk(v, kp, depth + 1, found)
        return
    if isinstance(obj, (list, tuple)):
        if depth > MAX_DEPTH:
            found.setdefault("depth", (f"{path}: nesting depth exceeds 32 levels", LimitExceeded))
            return
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", depth + 1, found)
        return
    found.setdefault("type", (f"{path}: unsupported type {type(obj).__name__}", InvalidInput))


def validate(obj: Any) -> None:
    """Check that ``obj`` (dict/Mapping, list/tuple, str, int, bool, None) is canonicalisable.

    Raises InvalidInput (QL001) or LimitExceeded (QL002); when several rules are violated the
    precedence is: undecodable string > depth > number > duplicate key > type.
    """
    found: dict[str, tuple[str, type]] = {}
    try:
        _walk(obj, "$", 1, found)
    except RecursionError:
        raise LimitExceeded("$: document too large or too deeply nested") from None
    for kind in ("string", "depth", "number", "dup", "type"):
        if kind in found:
            msg, cls = found[kind]
            raise cls(msg)


def loads_strict(text: str | bytes | bytearray) -> Any:
    """Parse JSON text for canonicalisation (the Python twin of casting to ``json``).

    ``text`` is a str or UTF-8 bytes. Returns plain dict/list/str/int/bool/None values.
    Raises InvalidInput (QL001) for malformed JSON or UTF-8, duplicate keys, floats, NaN,
    Infinity, integers outside ±(2^53−1), ``\\u0000`` and lone surrogates; LimitExceeded (QL002)
    for nesting deeper than 32 levels.
    """
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"$: JSON text is not valid UTF-8 ({exc.reason})") from None
    if not isinstance(text, str):
        raise InvalidInput(f"$: JSON text must be str or bytes, not {type(text).__name__}")
    try:
        obj = json.loads(
            text,
            object_pairs_hook=_pairs,
            parse_float=_parse_float,
            parse_int=_parse_int,
            parse_constant=_parse_constant,
        )
    except RecursionError:
        raise LimitExceeded("$: document too large or too deeply nested") from None
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"$: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    validate(obj)
    return obj


def _thaw(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _thaw(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_thaw(v) for v in obj]
    return obj


def canonical_bytes(obj: Any) -> bytes:
    """RFC 8785 canonical UTF-8 bytes of ``obj`` (validated first; Mappings and tuples allowed).

    Raises InvalidInput (QL001) / LimitExceeded (QL002) as :func:`validate`.
    """
    validate(obj)
    return rfc8785.dumps(_thaw(obj))


def canonical_text(obj: Any) -> str:
    """:func:`canonical_bytes` decoded as str (what ``ql3.canonical_json`` returns)."""
    return canonical_bytes(obj).decode("utf-8")


def canonicalize_text(text: str | bytes) -> bytes:
    """Canonical bytes of JSON text: ``canonical_bytes(loads_strict(text))``."""
    return canonical_bytes(loads_strict(text))


def _check_domain(domain: str) -> bytes:
    if not isinstance(domain, str) or not _DOMAIN.fullmatch(domain):
        raise InvalidInput(
            f"domain_digest: domain {domain!r} must match ^[a-z0-9][a-z0-9._/-]*@v[0-9]+$ "
            "(at most 128 bytes)"
        )
    raw = domain.encode("utf-8")
    if len(raw) > 128:
        raise InvalidInput("domain_digest: domain longer than 128 bytes")
    return raw


def domain_digest_bytes(domain: str, canonical: bytes) -> str:
    """Lowercase hex SHA-256 of ``UTF-8(domain) || 0x00 || canonical`` (no re-validation)."""
    return hashlib.sha256(_check_domain(domain) + b"\x00" + bytes(canonical)).hexdigest()


def domain_digest(domain: str, obj: Any) -> str:
    """Digest of ``obj`` under ``domain`` (e.g. ``'qinglong/task-execution-revision@v1'``).

    Same value as ``ql3.domain_digest(domain, ql3.canonical_json(obj))``: 64 lowercase hex
    chars. Raises InvalidInput (QL001) for a malformed domain or a non-canonicalisable ``obj``,
    LimitExceeded (QL002) for depth.
    """
    raw = _check_domain(domain)
    return hashlib.sha256(raw + b"\x00" + canonical_bytes(obj)).hexdigest()
