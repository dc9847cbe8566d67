"""Property tests: Python and SQL produce byte-identical canonical forms and digests
(DESIGN §6, ADR-0023 §3) for generated execution templates and for general JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:
    import qlpg  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pyshell"))

from qlpg import errors
from qlpg.canonical import MAX_SAFE_INT, canonical_text, domain_digest
from qlpg.revision import DOMAIN, execution_revision_digest, normalize_execution_template

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                      HealthCheck.too_slow])


@pytest.fixture
def db(ql3_owner):
    return ql3_owner


# Text PostgreSQL can hold: no NUL, no surrogates; includes non-BMP and controls.
_chars = st.characters(codec="utf-8", exclude_characters="\x00")
_text = st.text(_chars, max_size=12)
_nonempty = st.text(_chars, min_size=1, max_size=12)
_name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)
_policy_key = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)

_template = st.fixed_dictionaries(
    {
        "command": st.lists(_nonempty, min_size=1, max_size=6),
        "timeout_ms": st.integers(1, 86_400_000),
    },
    optional={
        "working_directory": st.one_of(st.none(), _nonempty),
        "env_names": st.one_of(st.none(), st.lists(_name, max_size=6, unique=True)),
        "resource_policy": st.one_of(
            st.none(), st.dictionaries(_policy_key, st.integers(0, MAX_SAFE_INT), max_size=5)
        ),
        "unknown_field": st.integers(),
        "labels": st.dictionaries(_text, _text, max_size=3),
        "env": st.none(),
    },
)

# Templates that may be invalid in one field: both sides must agree on the SQLSTATE.
_maybe_bad = _template.flatmap(
    lambda t: st.one_of(
        st.just(t),
        st.builds(lambda v: {**t, "timeout_ms": v}, st.one_of(st.integers(-5, 10**11), st.text(max_size=3), st.booleans())),
        st.builds(lambda v: {**t, "env_names": [v]}, st.text(st.sampled_from("AZaz09_= \n$"), max_size=5)),
        st.builds(lambda v: {**t, "command": v}, st.lists(st.one_of(_text, st.integers()), max_size=3)),
        st.builds(lambda k, v: {**t, "resource_policy": {k: v}},
                  st.text(st.sampled_from("az09_A-"), max_size=4), st.integers(-2, 2**54)),
        st.builds(lambda v: {**t, "env": v}, st.dictionaries(_name, _text, min_size=1, max_size=2)),
    )
)

_ids = st.tuples(_nonempty, _nonempty, _nonempty,
                 st.sampled_from(["local_process", "remote_worker"]),
                 st.one_of(st.none(), _nonempty))


@settings(max_examples=500, **SETTINGS)
@given(template=_maybe_bad, ids=_ids)
def test_template_python_sql_identical(db, template, ids):
    project_id, task_id, task_revision, executor_type, context_ref = ids
    t_json = json.dumps(template, ensure_ascii=False)
    try:
        py_norm = normalize_execution_template(template)
        py_digest = execution_revision_digest(project_id, task_id, task_revision, executor_type,
                                              template, context_ref)
        py_err = None
    except errors.QlpgError as exc:
        py_err = exc
    try:
        (sql_norm_c, sql_digest) = db.execute(
            "SELECT ql3.canonical_json(ql3.execution_template_normalize(%s::jsonb)::json), "
            "ql3.execution_revision_digest(%s, %s, %s, %s, %s::jsonb, %s)",
            (t_json, project_id, task_id, task_revision, executor_type, t_json, context_ref),
        ).fetchone()
        sql_err = None
    except psycopg.Error as exc:
        sql_err = exc
    if py_err is not None or sql_err is not None:
        assert py_err is not None and sql_err is not None, (py_err, sql_err and sql_err.diag.message_primary)
        assert py_err.sqlstate == sql_err.sqlstate
        assert str(py_err).split(": ")[0] == sql_err.diag.message_primary.split(": ")[0]
        return
    assert sql_norm_c == canonical_text(py_norm)
    assert sql_digest == py_digest


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-MAX_SAFE_INT, MAX_SAFE_INT) | _text,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_text, inner, max_size=5),
    max_leaves=30,
)
_nonbmp = st.text(st.characters(min_codepoint=0xE000, max_codepoint=0x1F6FF,
                                exclude_categories=("Cs",)), min_size=1, max_size=4)


@settings(max_examples=300, **SETTINGS)
@given(doc=st.one_of(_json, st.dictionaries(_nonbmp, _json, max_size=6)), ascii_=st.booleans(),
       indent=st.sampled_from([None, 1]))
def test_general_json_python_sql_identical(db, doc, ascii_, indent):
    text = json.dumps(doc, ensure_ascii=ascii_, indent=indent)
    expected = canonical_text(doc)
    digest = domain_digest("qinglong/property-test@v1", doc)
    row = db.execute(
        "SELECT c, ql3.domain_digest('qinglong/property-test@v1', c) "
        "FROM (SELECT ql3.canonical_json(%s::json) AS c) s",
        (text,),
    ).fetchone()
    assert row == (expected, digest)


def test_domain_constant():
    assert DOMAIN == "qinglong/task-execution-revision@v1"
