"""Build the environment of a Task Attempt's process.

The child gets an *allow-listed* environment, never the worker's whole one
(which may hold database credentials, tokens, ...):

1. the baseline names in :data:`BASELINE_NAMES` (PATH, HOME, LANG, LC_ALL,
   TZ, TMPDIR) when present in the worker environment;
2. each name the Task declares in ``env_names`` when present in the worker
   environment (absent names are simply not set — the manifest carries names
   only, never values);
3. ``extra`` — values supplied by the worker itself (QLPG_RUN_ID,
   QLPG_RUN_DIR, QLPG_STEP_KEY, QLPG_ATTEMPT_ID, QLPG_ATTEMPT); these win
   over 1 and 2.

If PATH ends up unset, :data:`DEFAULT_PATH` is used so ``argv[0]`` lookup
works predictably.
"""

from __future__ import annotations

import os
import re
from typing import Iterable, Mapping

__all__ = ["BASELINE_NAMES", "DEFAULT_PATH", "build_task_env"]

BASELINE_NAMES: tuple[str, ...] = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def build_task_env(
    env_names: Iterable[str] | None,
    *,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Return the complete environment dict for a Task process.

    ``env_names``: names declared by the Task (``None`` or empty for none).
    ``base``: the worker environment to copy from (default ``os.environ``).
    ``extra``: worker-provided variables, applied last; values must be str.
    Raises ``ValueError`` for an invalid variable name or a non-str value.
    """
    src = os.environ if base is None else base
    env: dict[str, str] = {}
    for name in BASELINE_NAMES:
        if name in src:
            env[name] = src[name]
    for name in env_names or ():
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"invalid environment variable name: {name!r}")
        if name in src:
            env[name] = src[name]
    for name, value in (extra or {}).items():
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"invalid environment variable name: {name!r}")
        if not isinstance(value, str) or "\x00" in value:
            raise ValueError(f"environment value for {name} must be a str without NUL")
        env[name] = value
    env.setdefault("PATH", DEFAULT_PATH)
    return env
