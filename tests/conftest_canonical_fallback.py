"""Fallback database for the canonical/revision tests when no ``ql3_owner`` fixture exists.

Not a conftest (pytest does not load it automatically). ``tests/test_canonical_vectors.py`` and
``tests/test_revision_property.py`` ask for the project fixture ``ql3_owner`` first (an autocommit
psycopg Connection to a database with every migration and ``sql/functions/*.sql`` applied) and
use :func:`fallback_connection` only if pytest cannot find it. The fallback recreates the scratch
database ``qlpg_canon_dev`` (server from ``$QLPG_TEST_ADMIN_DSN``, default
``host=127.0.0.1 port=5432 user=postgres dbname=postgres``), creates schema ``ql3`` and applies
just the four canonical/digest function files.
"""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = (
    "canonical_json.sql",
    "domain_digest.sql",
    "execution_template_normalize.sql",
    "execution_revision_digest.sql",
)
DBNAME = "qlpg_canon_dev"
_conn: psycopg.Connection | None = None


def fallback_connection() -> psycopg.Connection:
    global _conn
    if _conn is not None and not _conn.closed:
        return _conn
    admin = os.environ.get("QLPG_TEST_ADMIN_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=postgres")
    try:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {DBNAME} WITH (FORCE)")
            c.execute(f"CREATE DATABASE {DBNAME}")
    except psycopg.OperationalError as exc:  # pragma: no cover - environment
        pytest.skip(f"no PostgreSQL for canonical tests: {exc}")
    conn = psycopg.connect(psycopg.conninfo.make_conninfo(admin, dbname=DBNAME), autocommit=True)
    conn.execute("CREATE SCHEMA ql3")
    for name in FILES:
        conn.execute((ROOT / "sql" / "functions" / name).read_text())
    _conn = conn
    return conn


def db_connection(request: pytest.FixtureRequest) -> psycopg.Connection:
    """``ql3_owner`` when the project provides it, else the scratch fallback."""
    try:
        return request.getfixturevalue("ql3_owner")
    except pytest.FixtureLookupError:
        return fallback_connection()
