"""Static analysis of qlpg's SQL: plpgsql_check on every plpgsql function, squawk on every migration.

Used by ``tests/test_static_analysis.py`` and by ``scripts/static-analysis`` (CI), and runnable by
hand::

    .venv/bin/python tests/security/static_analysis.py [--dsn SUPERUSER_DSN] [--json]

plpgsql_check
    needs the extension on the server (Debian ``postgresql-15-plpgsql-check``; PostgreSQL 15 only
    here). :func:`scratch_database` creates a throw-away database, runs ``qlpg migrate`` in it as
    the connecting superuser and ``CREATE EXTENSION plpgsql_check`` there (in schema ``public`` of
    that scratch database only: never in ``ql3``, never in a user database), and drops it at the end.
    :func:`plpgsql_check` runs ``plpgsql_check_function_tb`` on every plpgsql function in ``ql3``
    with every warning class enabled (:data:`CHECK_OPTIONS`); a trigger function is checked
    against each table it is attached to. Each finding is mapped back to the source file and line
    (``sql/functions/*.sql`` or ``sql/migrations/*.sql``) by locating the function body in the files.

squawk
    ``squawk --reporter json`` on every ``sql/migrations/*.sql`` with the repository's
    ``.squawk.toml`` (whose excluded rules are justified there).

Allow-list: ``tests/security/plpgsql_check_allow.json`` — accepted findings, each
``{function, message, [detail], justification}`` (``function`` is the ``oid::regprocedure`` text or
just ``ql3.name``; ``message``/``detail`` are regular expressions searched in the finding).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SQL = ROOT / "sql"
ALLOW_FILE = HERE / "plpgsql_check_allow.json"
SQUAWK_CONFIG = ROOT / ".squawk.toml"

# Every warning class plpgsql_check has (documented in docs/security.md §8):
#   fatal_errors=false     report every error of a function instead of stopping at the first
#   other_warnings         unused/shadowed variables, reserved-keyword names, implicit casts that may fail …
#   extra_warnings         never-read variables, unused parameters, composite OUT parameters …
#   performance_warnings   implicit casts (e.g. bigint → integer on assignment) that cost or hide an index
#   security_warnings      SQL injection through dynamic SQL (EXECUTE of concatenated text)
#   compatibility_warnings constructs deprecated or changed across PostgreSQL versions
CHECK_OPTIONS = {
    "fatal_errors": False,
    "other_warnings": True,
    "extra_warnings": True,
    "performance_warnings": True,
    "security_warnings": True,
    "compatibility_warnings": True,
}

_CHECK_Q = """
SELECT %(oid)s::pg_catalog.oid::pg_catalog.regprocedure::text AS function, t.lineno, t.statement, t.sqlstate, t.message,
       t.detail, t.hint, t.level, t."position", t.query, t.context
  FROM public.plpgsql_check_function_tb(%(oid)s::pg_catalog.oid::pg_catalog.regprocedure, %(rel)s::pg_catalog.oid::pg_catalog.regclass,
         fatal_errors => %(fatal_errors)s, other_warnings => %(other_warnings)s,
         extra_warnings => %(extra_warnings)s, performance_warnings => %(performance_warnings)s,
         security_warnings => %(security_warnings)s, compatibility_warnings => %(compatibility_warnings)s) t
"""

_FUNCS_Q = """
SELECT p.oid::pg_catalog.int8 AS oid, p.oid::pg_catalog.regprocedure::text AS function, p.proname AS name,
       p.prosrc AS body, p.prorettype = 'pg_catalog.trigger'::pg_catalog.regtype AS is_trigger,
       ARRAY(SELECT DISTINCT tg.tgrelid::pg_catalog.int8 FROM pg_catalog.pg_trigger tg WHERE tg.tgfoid = p.oid) AS rels
  FROM pg_catalog.pg_proc p
  JOIN pg_catalog.pg_language l ON l.oid = p.prolang
 WHERE p.pronamespace = 'ql3'::pg_catalog.regnamespace AND l.lanname = 'plpgsql'
 ORDER BY 2
"""


@dataclass(frozen=True)
class Finding:
    """One plpgsql_check result, located in the repository."""

    function: str
    file: str | None  # path relative to the repository root
    line: int | None  # line in ``file`` (None: the function as a whole, e.g. an unused parameter)
    lineno: int | None  # plpgsql_check's line within the function body
    level: str
    sqlstate: str
    message: str
    detail: str | None
    hint: str | None
    statement: str | None
    query: str | None

    def where(self) -> str:
        if self.file is None:
            return f"{self.function} (source file not found)"
        return f"{self.file}:{self.line}" if self.line else f"{self.file} ({self.function})"

    def describe(self) -> str:
        text = f"{self.where()}: {self.function}: {self.level} {self.sqlstate}: {self.message}"
        if self.detail:
            text += f" ({self.detail})"
        if self.statement == "statement block":
            text += " [a DECLARE default of the block that begins on this line]"
        elif self.statement:
            text += f" [statement {self.statement}]"
        return text


# ------------------------------------------------------------------ source locations

def source_files() -> list[Path]:
    """Every SQL file that defines functions: sql/functions/*.sql, then the migrations."""
    return sorted((SQL / "functions").glob("*.sql")) + sorted(
        p for p in (SQL / "migrations").glob("*.sql") if not p.name.endswith(".rollback.sql"))


def locate_body(body: str, name: str, files: list[Path] | None = None) -> tuple[Path, int] | None:
    """(file, line of the body's first line) of the function whose source text is ``body``.

    plpgsql numbers the body from 1 starting on the line that holds the opening dollar quote, so a
    finding at body line ``n`` is at file line ``first + n - 1``. The file named after the function
    is searched first (one file per function), then every other file; the last definition in a file
    wins (a later CREATE OR REPLACE replaces an earlier one).
    """
    files = files if files is not None else source_files()
    preferred = [f for f in files if f.stem == name]
    for f in preferred + [f for f in files if f not in preferred]:
        text = f.read_text(encoding="utf-8")
        at = text.rfind(body)
        if at >= 0 and body.strip():
            return f, text.count("\n", 0, at) + 1
    return None


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------ plpgsql_check

def extension_available(conn: psycopg.Connection) -> bool:
    """Whether the server can ``CREATE EXTENSION plpgsql_check``."""
    return conn.execute("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_available_extensions"
                        " WHERE name = 'plpgsql_check')").fetchone()[0]


def plpgsql_check(conn: psycopg.Connection, options: dict | None = None) -> tuple[list[Finding], list[str]]:
    """Run plpgsql_check on every plpgsql function of ``ql3``; (findings, names of functions checked).

    ``conn`` is a superuser connection to a migrated database where ``plpgsql_check`` is installed.
    """
    opts = dict(CHECK_OPTIONS, **(options or {}))
    files = source_files()
    findings: dict[tuple, Finding] = {}
    checked: list[str] = []
    with conn.cursor(row_factory=dict_row) as cur:
        funcs = cur.execute(_FUNCS_Q).fetchall()
        for fn in funcs:
            checked.append(fn["function"])
            loc = locate_body(fn["body"], fn["name"], files)
            # a trigger function needs a relation; one with no trigger attached cannot be checked
            rels = fn["rels"] if fn["is_trigger"] else [0]
            if not rels:
                f = Finding(fn["function"], _rel(loc[0]) if loc else None, None, None, "error", "QLSA1",
                            "trigger function is attached to no table, so plpgsql_check cannot check it",
                            None, None, None, None)
                findings[(f.function, None, f.message, None)] = f
                continue
            for rel in rels:
                for r in cur.execute(_CHECK_Q, dict(opts, oid=fn["oid"], rel=rel)).fetchall():
                    line = (loc[1] + r["lineno"] - 1) if (loc and r["lineno"]) else None
                    f = Finding(r["function"], _rel(loc[0]) if loc else None, line, r["lineno"], r["level"],
                                r["sqlstate"], r["message"], r["detail"], r["hint"], r["statement"], r["query"])
                    findings.setdefault((f.function, f.lineno, f.message, f.detail), f)
    return sorted(findings.values(), key=lambda f: (f.file or "~", f.line or 0, f.function, f.message)), checked


def load_allow(path: Path = ALLOW_FILE) -> list[dict]:
    """The allow-list entries; each must have function, message and a non-trivial justification."""
    data = json.loads(path.read_text(encoding="utf-8"))
    entries = data["allow"]
    for e in entries:
        missing = {"function", "message", "justification"} - set(e)
        if missing:
            raise ValueError(f"{path}: entry {e} lacks {sorted(missing)}")
        if len(e["justification"].strip()) < 20:
            raise ValueError(f"{path}: entry {e['function']} / {e['message']}: justification too short")
        re.compile(e["message"])
        if "detail" in e:
            re.compile(e["detail"])
    return entries


def _fn_matches(pattern: str, function: str) -> bool:
    return pattern == function or ("(" not in pattern and function.split("(", 1)[0] == pattern)


def allowed_by(finding: Finding, entries: list[dict]) -> dict | None:
    """The allow-list entry that accepts ``finding``, if any."""
    for e in entries:
        if not _fn_matches(e["function"], finding.function):
            continue
        if not re.search(e["message"], finding.message):
            continue
        if "detail" in e and not re.search(e["detail"], finding.detail or ""):
            continue
        return e
    return None


def unused_allow_entries(findings: list[Finding], entries: list[dict]) -> list[dict]:
    """Allow-list entries that no finding needs any more (stale: remove them)."""
    return [e for e in entries if not any(allowed_by(f, [e]) for f in findings)]


@contextmanager
def scratch_database(admin_conninfo: str, *, template: str | None = None):
    """A throw-away migrated database with ``plpgsql_check`` installed; yields its conninfo.

    ``admin_conninfo`` must be a superuser (CREATE EXTENSION plpgsql_check needs one). With
    ``template`` the database is cloned from that already-migrated database instead of migrated.
    """
    sys.path.insert(0, str(ROOT / "pyshell"))
    from qlpg import migrate

    name = f"qlpg_static_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin_conninfo, autocommit=True) as admin:
        if template:
            admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        else:
            admin.execute(f'CREATE DATABASE "{name}"')
    conninfo = psycopg.conninfo.make_conninfo(admin_conninfo, dbname=name)
    try:
        if not template:
            migrate.migrate(conninfo)
        with psycopg.connect(conninfo, autocommit=True) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS plpgsql_check SCHEMA public")
        yield conninfo
    finally:
        with psycopg.connect(admin_conninfo, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ------------------------------------------------------------------ squawk

def squawk_binary() -> str | None:
    """The squawk executable: next to this Python (the venv), else on PATH."""
    local = Path(sys.executable).parent / "squawk"
    if local.exists():
        return str(local)
    return shutil.which("squawk")


def migration_files() -> list[Path]:
    return sorted((SQL / "migrations").glob("*.sql"))


def squawk(files: list[Path] | None = None) -> list[dict]:
    """squawk findings on ``files`` (default: every migration) as dicts with a 1-based ``line``."""
    exe = squawk_binary()
    if exe is None:
        raise FileNotFoundError("squawk not installed: .venv/bin/pip install -e '.[test]' (PyPI squawk-cli)")
    files = files if files is not None else migration_files()
    if not files:
        return []
    proc = subprocess.run([exe, "--config", str(SQUAWK_CONFIG), "--reporter", "json",
                           *[_rel(f) for f in files]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise RuntimeError(f"squawk failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    out = []
    for d in json.loads(proc.stdout):
        d = dict(d)
        d["line"] = int(d["line"]) + 1  # squawk's JSON lines are 0-based
        d["source"] = (ROOT / d["file"]).read_text(encoding="utf-8").split("\n")[d["line"] - 1].strip()
        out.append(d)
    return out


def describe_squawk(d: dict) -> str:
    return f"{d['file']}:{d['line']}: {d['rule_name']}: {d['message']} | {d['source']}"


def known_literal(findings: list[Finding]) -> str:
    """``findings`` as the KNOWN_FINDINGS dict literal of tests/test_static_analysis.py."""
    def lit(pattern: str) -> str:
        return f"r'{pattern}'" if "'" not in pattern and not pattern.endswith("\\") else repr(pattern)

    def rx(text: str) -> str:
        return re.sub(r"([\\\[\](){}.*+?^$|])", r"\\\1", text)

    by_file: dict[str, list[str]] = {}
    for f in findings:
        detail = lit(rx(f.detail)) if f.detail and f.message.startswith("target type") else "None"
        entry = f"(\"{f.function.split('(', 1)[0]}\", {lit('^' + rx(f.message) + '$')}, {detail}),"
        if entry not in by_file.setdefault(f.file or "?", []):
            by_file[f.file or "?"].append(entry)
    lines = ["KNOWN_FINDINGS: dict[str, list[tuple[str, str, str | None]]] = {"]
    for file, entries in by_file.items():
        lines.append(f"    \"{file}\": [")
        lines += ["        " + e for e in entries]
        lines.append("    ],")
    lines.append("}")
    return "\n".join(lines)


# ------------------------------------------------------------------ CLI

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("QLPG_STATIC_DSN", ""),
                    help="superuser connection (default: PG* variables / libpq defaults)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--skip-plpgsql-check", action="store_true")
    ap.add_argument("--skip-squawk", action="store_true")
    ap.add_argument("--known", action="store_true",
                    help="print the unaccepted plpgsql_check findings as a KNOWN_FINDINGS literal "
                         "(for tests/test_static_analysis.py, after reporting them)")
    args = ap.parse_args(argv)

    result: dict = {"plpgsql_check": None, "squawk": None}
    failed = False
    if not args.skip_plpgsql_check:
        with psycopg.connect(args.dsn, autocommit=True) as c:
            avail = extension_available(c)
            version = c.execute("SHOW server_version").fetchone()[0]
        if not avail:
            print(f"plpgsql_check: SKIPPED: extension not available on PostgreSQL {version} "
                  "(apt-get install postgresql-15-plpgsql-check)", file=sys.stderr)
            failed = True
        else:
            with scratch_database(args.dsn) as ci, psycopg.connect(ci, autocommit=True) as conn:
                ext = conn.execute("SELECT extversion FROM pg_catalog.pg_extension"
                                   " WHERE extname = 'plpgsql_check'").fetchone()[0]
                findings, checked = plpgsql_check(conn)
            allow = load_allow()
            rows = [dict(asdict(f), allowed=(allowed_by(f, allow) or {}).get("justification")) for f in findings]
            result["plpgsql_check"] = {"server": version, "extension": ext, "options": CHECK_OPTIONS,
                                       "functions_checked": len(checked), "findings": rows,
                                       "stale_allow_entries": unused_allow_entries(findings, allow)}
            if not args.json:
                print(f"plpgsql_check {ext} on PostgreSQL {version}: {len(checked)} plpgsql functions, "
                      f"{len(findings)} finding(s), options {CHECK_OPTIONS}")
                for f, r in zip(findings, rows):
                    print(("  allowed  " if r["allowed"] else "  FINDING  ") + f.describe())
                for e in result["plpgsql_check"]["stale_allow_entries"]:
                    print(f"  STALE allow-list entry (no finding matches): {e['function']} / {e['message']}")
            failed |= any(not r["allowed"] for r in rows)
            if args.known:
                print(known_literal([f for f, r in zip(findings, rows) if not r["allowed"]]))
                return 0
    if not args.skip_squawk:
        found = squawk()
        result["squawk"] = {"files": [_rel(f) for f in migration_files()], "findings": found}
        if not args.json:
            print(f"squawk on {len(result['squawk']['files'])} migration(s) with {_rel(SQUAWK_CONFIG)}: "
                  f"{len(found)} finding(s)")
            for d in found:
                print("  FINDING  " + describe_squawk(d))
        failed |= bool(found)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
