"""Exceptions of qlpg, mapped 1:1 to the custom SQLSTATEs of DESIGN §8.

Every ``ql3`` function raises ``QLxxx`` SQLSTATEs with a message naming the object and the rule;
:func:`translate` turns such a :class:`psycopg.Error` into the matching :class:`QlpgError`
subclass, keeping the server message as ``str(exc)`` and the original error as ``__cause__``.
Python-side validation (``qlpg.canonical``, ``qlpg.revision``) raises the same classes, so a
caller sees one exception type per rule whichever side detected it.

==========  ======================  ==========================================================
SQLSTATE    class                   meaning
==========  ======================  ==========================================================
QL001       InvalidInput            invalid input (shape, type, format, canonical JSON rules)
QL002       LimitExceeded           a size, count or depth limit exceeded
QL101       Unavailable             not found / unavailable
QL201       ImmutableConflict       same identity, different content
QL202       StaleFence              stale version, epoch or lease fence
QL203       IllegalTransition       illegal state transition
QL301       StartGuardDenied        start guard denied (withdrawn, quarantined, revoked, not current)
QL401       LeaseInvalid            lease token invalid or expired
QL501       IntegrityFailure        stored digest / content mismatch
QL601       NotInRole               caller is not a member of the required role
==========  ======================  ==========================================================
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "QlpgError",
    "InvalidInput",
    "LimitExceeded",
    "Unavailable",
    "ImmutableConflict",
    "StaleFence",
    "IllegalTransition",
    "StartGuardDenied",
    "LeaseInvalid",
    "IntegrityFailure",
    "NotInRole",
    "ConnectError",
    "SQLSTATE_CLASSES",
    "from_sqlstate",
    "translate",
]


class QlpgError(Exception):
    """Base class of every qlpg error.

    ``sqlstate`` is the DESIGN §8 code (``None`` for errors that have none, e.g.
    :class:`ConnectError`); ``diag`` is the psycopg diagnostic of the server error when the
    exception was produced by :func:`translate`, else ``None``.
    """

    sqlstate: str | None = None

    def __init__(self, message: str = "", *, diag: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.diag = diag


class InvalidInput(QlpgError):
    """QL001: invalid input (wrong shape, type, format; non-canonical JSON, float, duplicate key)."""

    sqlstate = "QL001"


class LimitExceeded(QlpgError):
    """QL002: a size, count or nesting-depth limit was exceeded."""

    sqlstate = "QL002"


class Unavailable(QlpgError):
    """QL101: the object does not exist or is not available to this call."""

    sqlstate = "QL101"


class ImmutableConflict(QlpgError):
    """QL201: the identity already exists with different canonical content."""

    sqlstate = "QL201"


class StaleFence(QlpgError):
    """QL202: a version, epoch or lease fence is stale."""

    sqlstate = "QL202"


class IllegalTransition(QlpgError):
    """QL203: the requested state transition is not allowed."""

    sqlstate = "QL203"


class StartGuardDenied(QlpgError):
    """QL301: the start guard denied the start (withdrawn, quarantined, revoked, not current)."""

    sqlstate = "QL301"


class LeaseInvalid(QlpgError):
    """QL401: the lease token is invalid or expired."""

    sqlstate = "QL401"


class IntegrityFailure(QlpgError):
    """QL501: stored content failed its integrity check (digest or canonical form mismatch)."""

    sqlstate = "QL501"


class NotInRole(QlpgError):
    """QL601: the caller (session_user) is not a member of the function's role."""

    sqlstate = "QL601"


class ConnectError(QlpgError):
    """The database could not be reached (no SQLSTATE: the server never answered)."""

    sqlstate = None


SQLSTATE_CLASSES: dict[str, type[QlpgError]] = {
    cls.sqlstate: cls  # type: ignore[misc]
    for cls in (
        InvalidInput,
        LimitExceeded,
        Unavailable,
        ImmutableConflict,
        StaleFence,
        IllegalTransition,
        StartGuardDenied,
        LeaseInvalid,
        IntegrityFailure,
        NotInRole,
    )
}


def from_sqlstate(code: str | None) -> type[QlpgError] | None:
    """The exception class for a DESIGN §8 SQLSTATE (``'QL001'`` → :class:`InvalidInput`).

    Returns ``None`` for any other code (standard PostgreSQL SQLSTATEs are not mapped).
    """
    if code is None:
        return None
    return SQLSTATE_CLASSES.get(code.upper())


def translate(exc: BaseException) -> BaseException:
    """Map a :class:`psycopg.Error` carrying a ``QLxxx`` SQLSTATE to its :class:`QlpgError`.

    The result's message is the server's primary message (e.g. ``"$.steps[3].needs: duplicate
    object key"``), ``diag`` is the psycopg diagnostic and ``__cause__`` is the original error.
    Errors with any other SQLSTATE (or none) are returned unchanged, so callers can write
    ``raise errors.translate(exc) from exc``.
    """
    state = getattr(exc, "sqlstate", None)
    cls = from_sqlstate(state)
    if cls is None:
        return exc
    diag = getattr(exc, "diag", None)
    message = getattr(diag, "message_primary", None) or str(exc).strip()
    out = cls(message, diag=diag)
    out.__cause__ = exc
    return out
