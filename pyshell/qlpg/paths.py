"""Where qlpg's SQL lives.

``sql_dir()`` returns the directory holding ``bootstrap.sql``, ``migrations/`` and ``functions/``:
``$QLPG_SQL_DIR`` if set, else the ``sql/`` folder of the source tree this package was installed
from (qlpg is installed editable, ``pip install -e .``).
"""

from __future__ import annotations

import os
from pathlib import Path


def sql_dir() -> Path:
    """Return the SQL directory; raise FileNotFoundError naming the places looked at."""
    env = os.environ.get("QLPG_SQL_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "sql")
    for c in candidates:
        if (c / "migrations").is_dir() and (c / "functions").is_dir():
            return c
    raise FileNotFoundError(
        "qlpg SQL files not found (looked in: %s); set QLPG_SQL_DIR or install qlpg editable "
        "from its source tree (pip install -e .)" % ", ".join(str(c) for c in candidates)
    )
