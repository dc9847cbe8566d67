"""Digest vectors (DESIGN §6): Python (qlpg.canonical / qlpg.revision) and SQL (ql3.canonical_json,
ql3.domain_digest, ql3.execution_template_normalize, ql3.execution_revision_digest) must both
reproduce every vector in tests/vectors/canonical.json and tests/vectors/execution_revision.json."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import psycopg
import pytest

try:
    import qlpg  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pyshell"))

from qlpg import errors
from qlpg.canonical import (
    canonical_bytes,
    canonical_text,
    canonicalize_text,
    domain_digest,
    loads_strict,
)
from qlpg.revision import (
    ExecutionRevision,
    execution_revision_digest,
    execution_revision_document,
    normalize_execution_template,
)

VECTORS = Path(__file__).resolve().parent / "vectors"
CANON = json.loads((VECTORS / "canonical.json").read_text(encoding="utf-8"))
REV = json.loads((VECTORS / "execution_revision.json").read_text(encoding="utf-8"))
ARGS = ("project_id", "task_id", "task_revision", "executor_type", "template", "context_ref")


def _ids(vs):
    return [v["name"] for v in vs]


@pytest.fixture
def db(ql3_owner):
    return ql3_owner


def test_vector_counts():
    assert len(CANON["valid"]) >= 25 and len(CANON["invalid"]) >= 12
    assert len(REV["valid"]) >= 10 and len(REV["invalid"]) >= 10


# ---------------------------------------------------------------- canonical: Python

@pytest.mark.parametrize("v", CANON["valid"], ids=_ids(CANON["valid"]))
def test_canonical_python_valid(v):
    obj = loads_strict(v["input"])
    assert canonical_text(obj) == v["canonical"]
    assert canonicalize_text(v["input"].encode("utf-8")) == v["canonical"].encode("utf-8")
    assert domain_digest(v["domain"], obj) == v["digest"]
    # canonical form is a fixed point
    assert canonical_text(loads_strict(v["canonical"])) == v["canonical"]


@pytest.mark.parametrize("v", CANON["invalid"], ids=_ids(CANON["invalid"]))
def test_canonical_python_invalid(v):
    with pytest.raises(errors.QlpgError) as ei:
        loads_strict(v["input"])
    assert ei.value.sqlstate == v["sqlstate"]
    assert str(ei.value).startswith("$")


def test_python_rejects_constructed_values():
    for bad, state in [(1.0, "QL001"), (2**53, "QL001"), ({"a": "\x00"}, "QL001"),
                       (["\ud800"], "QL001"), ({1: 2}, "QL001"), (object(), "QL001"),
                       (float("nan"), "QL001")]:
        with pytest.raises(errors.QlpgError) as ei:
            canonical_bytes(bad)
        assert ei.value.sqlstate == state
    for bad in ("NaN", "[Infinity]", "-Infinity", "\ufeff{}", "{} x", "[1,]"):
        with pytest.raises(errors.InvalidInput):
            loads_strict(bad)
    with pytest.raises(errors.InvalidInput):
        loads_strict(b"\xff")
    with pytest.raises(errors.LimitExceeded):
        loads_strict("[" * 100000 + "]" * 100000)
    with pytest.raises(errors.InvalidInput):
        domain_digest("Bad Domain", {})


# ---------------------------------------------------------------- canonical: SQL

@pytest.mark.parametrize("v", CANON["valid"], ids=_ids(CANON["valid"]))
def test_canonical_sql_valid(db, v):
    row = db.execute(
        "SELECT c, ql3.domain_digest(%s, c) FROM (SELECT ql3.canonical_json(%s::json) AS c) s",
        (v["domain"], v["input"]),
    ).fetchone()
    assert row == (v["canonical"], v["digest"])


@pytest.mark.parametrize("v", CANON["invalid"], ids=_ids(CANON["invalid"]))
def test_canonical_sql_invalid(db, v):
    with pytest.raises(psycopg.Error) as ei:
        db.execute("SELECT ql3.canonical_json(%s::json)", (v["input"],))
    assert ei.value.sqlstate == v["sqlstate"], ei.value.diag.message_primary
    msg = ei.value.diag.message_primary
    assert msg.startswith("$")
    translated = errors.translate(ei.value)
    assert isinstance(translated, errors.from_sqlstate(v["sqlstate"]))
    assert str(translated) == msg and translated.__cause__ is ei.value


def test_sql_error_paths_name_the_location(db):
    cases = {
        '{"steps":[{"id":"a"},{"id":"b"},{"id":"c"},{"needs":[1.5]}]}': "$.steps[3].needs[0]: ",
        '{"steps":[{"x":1},{"needs":{"k":1,"k":2}}]}': "$.steps[1].needs.k: duplicate object key",
        '{"a b":{"c":1e2}}': '$["a b"].c: ',
        '[1,["ok","\\u0000"]]': "$[1][1]: string is not valid unicode text",
    }
    for doc, prefix in cases.items():
        with pytest.raises(psycopg.Error) as ei:
            db.execute("SELECT ql3.canonical_json(%s::json)", (doc,))
        assert ei.value.diag.message_primary.startswith(prefix), ei.value.diag.message_primary
        # Python names the same location
        with pytest.raises(errors.InvalidInput) as pi:
            loads_strict(doc)
        assert str(pi.value).startswith(prefix)


def test_sql_null_and_scalars(db):
    assert db.execute("SELECT ql3.canonical_json(NULL::json)").fetchone()[0] is None
    assert db.execute("SELECT ql3.canonical_json('null'::json)").fetchone()[0] == "null"
    with pytest.raises(psycopg.Error) as ei:
        db.execute("SELECT ql3.domain_digest('no domain', '{}')")
    assert ei.value.sqlstate == "QL001"


def test_sql_canonical_speed(db):
    doc = [{"id": f"step-{i}", "task": f"pkg:demo:t{i}", "timeout_ms": i * 1000} for i in range(128)]
    text = json.dumps(doc)
    db.execute("SELECT ql3.canonical_json(%s::json)", (text,))  # warm plan cache
    t0 = time.perf_counter()
    for _ in range(5):
        (out,) = db.execute("SELECT ql3.canonical_json(%s::json)", (text,)).fetchone()
    per_call = (time.perf_counter() - t0) / 5
    assert out == canonical_text(doc)
    assert per_call < 0.05, f"canonical_json of 128 small objects took {per_call * 1000:.1f} ms"


# ---------------------------------------------------------------- errors mapping

def test_errors_mapping_is_one_to_one(db):
    expected = {
        "QL001": errors.InvalidInput, "QL002": errors.LimitExceeded, "QL101": errors.Unavailable,
        "QL201": errors.ImmutableConflict, "QL202": errors.StaleFence,
        "QL203": errors.IllegalTransition, "QL301": errors.StartGuardDenied,
        "QL401": errors.LeaseInvalid, "QL501": errors.IntegrityFailure, "QL601": errors.NotInRole,
    }
    assert errors.SQLSTATE_CLASSES == expected
    for code, cls in expected.items():
        assert errors.from_sqlstate(code) is cls and cls.sqlstate == code
        assert issubclass(cls, errors.QlpgError)
        with pytest.raises(psycopg.Error) as ei:
            db.execute(f"DO $$BEGIN RAISE EXCEPTION USING ERRCODE = '{code}', MESSAGE = 'obj: rule'; END$$")
        t = errors.translate(ei.value)
        assert type(t) is cls and str(t) == "obj: rule" and t.__cause__ is ei.value
    assert errors.from_sqlstate("23505") is None
    with pytest.raises(psycopg.Error) as ei:
        db.execute("SELECT 1/0")
    assert errors.translate(ei.value) is ei.value
    assert errors.ConnectError.sqlstate is None and issubclass(errors.ConnectError, errors.QlpgError)


# ---------------------------------------------------------------- execution revision: Python

@pytest.mark.parametrize("v", REV["valid"], ids=_ids(REV["valid"]))
def test_revision_python_valid(v):
    a = v["args"]
    assert normalize_execution_template(a["template"]) == v["normalized_template"]
    doc = execution_revision_document(*(a[k] for k in ARGS))
    assert canonical_text(doc) == v["canonical"]
    assert execution_revision_digest(*(a[k] for k in ARGS)) == v["digest"]
    assert domain_digest(REV["domain"], loads_strict(v["canonical"])) == v["digest"]


@pytest.mark.parametrize("v", REV["invalid"], ids=_ids(REV["invalid"]))
def test_revision_python_invalid(v):
    a = v["args"]
    with pytest.raises(errors.QlpgError) as ei:
        execution_revision_digest(*(a[k] for k in ARGS))
    assert ei.value.sqlstate == v["sqlstate"]
    assert str(ei.value).split(": ")[0] == v["field"]


# ---------------------------------------------------------------- execution revision: SQL

_REV_SQL = (
    "SELECT ql3.execution_template_normalize(%(t)s::jsonb), "
    "ql3.execution_revision_digest(%(p)s, %(k)s, %(r)s, %(e)s, %(t)s::jsonb, %(c)s)"
)


def _params(a):
    return {"p": a["project_id"], "k": a["task_id"], "r": a["task_revision"], "e": a["executor_type"],
            "t": json.dumps(a["template"], ensure_ascii=False), "c": a["context_ref"]}


@pytest.mark.parametrize("v", REV["valid"], ids=_ids(REV["valid"]))
def test_revision_sql_valid(db, v):
    norm, digest = db.execute(_REV_SQL, _params(v["args"])).fetchone()
    assert norm == v["normalized_template"]
    assert digest == v["digest"]
    (c,) = db.execute(
        "SELECT ql3.canonical_json(json_build_object('project_id', %(p)s::text, 'task_id', %(k)s::text, "
        "'task_revision', %(r)s::text, 'executor_type', %(e)s::text, 'execution_template', "
        "ql3.execution_template_normalize(%(t)s::jsonb)::json, 'context_ref', %(c)s::text))",
        _params(v["args"]),
    ).fetchone()
    assert c == v["canonical"]


@pytest.mark.parametrize("v", REV["invalid"], ids=_ids(REV["invalid"]))
def test_revision_sql_invalid(db, v):
    with pytest.raises(psycopg.Error) as ei:
        db.execute(
            "SELECT ql3.execution_revision_digest(%(p)s, %(k)s, %(r)s, %(e)s, %(t)s::jsonb, %(c)s)",
            _params(v["args"]),
        )
    assert ei.value.sqlstate == v["sqlstate"], ei.value.diag.message_primary
    assert ei.value.diag.message_primary.split(": ")[0] == v["field"]


def test_sql_template_jsonb_number_forms(db):
    # jsonb has no float/int distinction: 1e3 arrives as 1000 (accepted), 1.0 keeps its scale (rejected)
    (n,) = db.execute(
        "SELECT ql3.execution_template_normalize('{\"command\":[\"a\"],\"timeout_ms\":1e3}'::jsonb)"
    ).fetchone()
    assert n == {"command": ["a"], "timeout_ms": 1000}
    with pytest.raises(psycopg.Error) as ei:
        db.execute("SELECT ql3.execution_template_normalize('{\"command\":[\"a\"],\"timeout_ms\":1.0}'::jsonb)")
    assert ei.value.sqlstate == "QL001"
    assert db.execute("SELECT ql3.execution_template_normalize(NULL)").fetchone()[0] is None


# ---------------------------------------------------------------- ExecutionRevision

def _row(v, **over):
    a = v["args"]
    row = {"project_id": a["project_id"], "task_id": a["task_id"], "task_revision": a["task_revision"],
           "executor_type": a["executor_type"], "execution_template": v["normalized_template"],
           "context_ref": a["context_ref"], "content_digest": v["digest"], "created_at_ms": 1_700_000_000_000}
    row.update(over)
    return row


def test_execution_revision_from_row_and_freeze():
    v = next(x for x in REV["valid"] if x["name"] == "all fields")
    rev = ExecutionRevision.from_row(_row(v))
    assert rev.content_digest == v["digest"]
    with pytest.raises(TypeError):
        rev.execution_template["timeout_ms"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        rev.execution_template["command"].append("x")  # tuple
    with pytest.raises(TypeError):
        rev.execution_template["resource_policy"]["cpu_ms"] = 1  # type: ignore[index]
    with pytest.raises(Exception):
        rev.content_digest = "x"  # type: ignore[misc]
    j = rev.to_json()
    j["execution_template"]["command"].append("mutated")
    assert rev.execution_template["command"][-1] != "mutated"
    assert j["execution_template"]["resource_policy"] == v["normalized_template"]["resource_policy"]
    # sequence rows work too, and stored JSON text is accepted
    seq = list(_row(v).values())
    seq[4] = json.dumps(v["normalized_template"])
    assert ExecutionRevision.from_row(seq) == rev


def test_execution_revision_fails_closed():
    v = next(x for x in REV["valid"] if x["name"] == "all fields")
    bad_rows = [
        _row(v, content_digest="0" * 64),
        _row(v, execution_template={**v["normalized_template"], "extra": 1}),  # not normalized
        _row(v, execution_template={**v["normalized_template"], "timeout_ms": 0}),
        _row(v, executor_type="docker"),
        _row(v, created_at_ms=-1),
        _row(v, created_at_ms="soon"),
        _row(v, execution_template='{"command":["a"],"timeout_ms":1.0}'),
        _row(v, task_revision=v["args"]["task_revision"] + "x"),
    ]
    for row in bad_rows:
        with pytest.raises(errors.IntegrityFailure):
            ExecutionRevision.from_row(row)


def test_sql_jsonb_overload_and_privileges(db):
    (c,) = db.execute(
        "SELECT ql3.canonical_json(jsonb_build_object('b', 1, 'a', '[-0, \"x\"]'::jsonb))"
    ).fetchone()
    assert c == '{"a":[0,"x"],"b":1}'
    rows = db.execute(
        "SELECT p.oid::regprocedure::text, p.prosecdef, p.proconfig, "
        "       has_function_privilege('public', p.oid, 'EXECUTE') "
        "FROM pg_proc p WHERE p.oid IN ("
        " 'ql3.canonical_json(json)'::regprocedure, 'ql3.canonical_json(jsonb)'::regprocedure,"
        " 'ql3._canonical_json_locate(json,text)'::regprocedure, 'ql3.domain_digest(text,text)'::regprocedure,"
        " 'ql3.execution_template_normalize(jsonb)'::regprocedure,"
        " 'ql3.execution_revision_digest(text,text,text,text,jsonb,text)'::regprocedure)"
    ).fetchall()
    assert len(rows) == 6
    for name, secdef, config, public_exec in rows:
        assert not secdef, name
        assert "search_path=pg_catalog, pg_temp" in config, name
        assert not public_exec, name
