"""Fuzzing ``ql3.workflow_plan_admit`` with bad plans (ADR-0223, "Bad input"), hypothesis, >= 2,000 cases.

Every case starts from a valid plan of an installed package and breaks it in exactly one way:
missing or extra fields, wrong types, cycles, self-needs, 129+ steps, a canonical form over 256 KiB
or an input over 1 MiB, a non-root ``ready`` or a pending root, duplicate JSON keys (sent as JSON
text through ``workflow_plan_admit(%s::json)``), unicode ids, SQL metacharacters, tampered digests,
drifted bindings, non-object documents and deep nesting. Each case is sent as
``ql3_package_executor`` in its own transaction on one connection and must fail with a SQLSTATE
starting with ``QL`` (never an internal error); afterwards no runtime or package-fact table has
changed. The same text also goes through ``ql3.workflow_plan_normalize`` (as the superuser) and
:func:`qlpg.plan.normalize_plan`: both reject it with the same SQLSTATE, or both accept it with the
same digest (then the admission must have refused a binding).
"""

from __future__ import annotations

import collections
import copy
import json
import re

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from qlpg import errors, install as installmod, plan as planmod
from qlpg.canonical import loads_strict

from test_plan_support import install, package, row_counts

WF = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"], "e": []}
DESCENDANTS = {"a": {"b", "c", "d"}, "b": {"d"}, "c": {"d"}, "d": set(), "e": set()}
TOP_IDS = ("project_id", "package_id", "installation_id", "publication_id", "workflow_key", "run_id")
TOP_DIGESTS = ("lock_digest", "revision_digest", "publication_digest", "workflow_semantic_digest")
STEP_IDS = ("step_key", "step_run_id", "task_key")
META = ["'", '"', ";", "--", "/*", "*/", "\\", "$$", "%s", "%(x)s", " ", "\t", "\n", "' OR '1'='1",
        "'; DROP TABLE ql3.runs; --", "$fn$", "E'\\\\x00'", "\\u0000", "`", "|", "(", ")", "{", "}", "[", "]"]
MIN_CASES = 2000


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**60, 2**60), st.text(max_size=8),
                      st.floats(allow_nan=False, allow_infinity=False))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                          max_leaves=4)
non_string = json_value.filter(lambda v: not isinstance(v, str))
unicode_text = st.text(min_size=1, max_size=40).filter(lambda s: not s.isascii())
meta_text = st.builds(lambda a, m, b: a + m + b, st.sampled_from(["", "a", "run", "x-1"]), st.sampled_from(META),
                      st.sampled_from(["", "b", "--", "1"])).filter(
    lambda s: not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]*", s))  # never a valid portable id


# examples per category: rich spaces get more, tiny spaces are exhausted early by hypothesis, and the
# two heavy ones (129+ steps, > 256 KiB / > 1 MiB) fewer
KINDS = {"missing": 170, "extra": 200, "wrong_type": 200, "duplicate_key": 200, "unicode_id": 200, "sql_meta": 200,
         "digest_tamper": 150, "drift": 200, "not_object": 150, "deep": 120, "bad_needs": 200, "cycle": 60,
         "non_root_ready": 40, "root_pending": 40, "bad_generation": 60, "bad_status": 60, "too_many_steps": 40,
         "too_big": 30}


@st.composite
def cases(draw, base: dict, big_text: str, kind: str):
    """(category, JSON text) — a valid plan broken in exactly one way."""
    p = copy.deepcopy(base)
    steps = {s["step_key"]: s for s in p["steps"]}
    step = steps[draw(st.sampled_from(sorted(steps)))]
    if kind == "missing":
        if draw(st.booleans()):
            p.pop(draw(st.sampled_from(sorted(planmod.PLAN_FIELDS))))
        else:
            step.pop(draw(st.sampled_from(planmod.STEP_FIELDS)))
    elif kind == "extra":
        target = p if draw(st.booleans()) else step
        allowed = set(planmod.PLAN_FIELDS) | {"plan_digest"} if target is p else set(planmod.STEP_FIELDS)
        key = draw(st.one_of(st.text(min_size=1, max_size=12), st.sampled_from(META + ["retries", "secret", "env"]))
                   .filter(lambda k: k not in allowed))
        target[key] = draw(json_value)
    elif kind == "wrong_type":
        if draw(st.booleans()):
            p[draw(st.sampled_from(TOP_IDS + TOP_DIGESTS + ("schema", "steps")))] = draw(non_string)
        else:
            step[draw(st.sampled_from(STEP_IDS + ("task_reference", "source_digest", "initial_status")))] = draw(non_string)
    elif kind == "cycle":
        key = step["step_key"]
        back = draw(st.sampled_from(sorted(DESCENDANTS[key] | {key})))  # a descendant, or itself
        step["needs"] = sorted(set(step["needs"]) | {back})
        step["initial_status"] = "pending"
    elif kind == "too_many_steps":
        n = draw(st.integers(129 - len(p["steps"]), 140 - len(p["steps"])))
        for i in range(n):
            p["steps"].append(dict(step, step_key=f"x{i:03d}", step_run_id=f"sr:x{i:03d}", needs=[],
                                   initial_status="ready"))
    elif kind == "too_big":
        if draw(st.booleans()):
            return kind, big_text  # a real-looking plan whose canonical form is > 256 KiB
        p["padding"] = "x" * (1024 * 1024 + draw(st.integers(0, 64)))  # input over 1 MiB
    elif kind == "non_root_ready":
        step = steps[draw(st.sampled_from(["b", "c", "d"]))]
        step["initial_status"] = "ready"
    elif kind == "root_pending":
        steps[draw(st.sampled_from(["a", "e"]))]["initial_status"] = "pending"
    elif kind == "duplicate_key":
        text = dumps(p)
        if draw(st.booleans()):
            key = draw(st.sampled_from(sorted(planmod.PLAN_FIELDS)))
            val = draw(st.one_of(st.just(p[key]), json_value))
            return kind, "{" + dumps(key) + ":" + dumps(val) + "," + text[1:]
        key = draw(st.sampled_from(planmod.STEP_FIELDS))
        val = draw(st.one_of(st.just(step[key]), json_value))
        head = dumps(step)
        return kind, text.replace(head, "{" + dumps(key) + ":" + dumps(val) + "," + head[1:], 1)
    elif kind == "unicode_id":
        bad = draw(unicode_text)
        where = draw(st.sampled_from(["top", "step", "need"]))
        if where == "top":
            p[draw(st.sampled_from(TOP_IDS))] = bad
        elif where == "step":
            step[draw(st.sampled_from(STEP_IDS))] = bad
        else:
            steps["d"]["needs"] = sorted(steps["d"]["needs"] + [bad])
    elif kind == "sql_meta":
        bad = draw(meta_text)
        where = draw(st.sampled_from(["top_id", "step_id", "reference", "digest", "schema", "status", "need"]))
        if where == "top_id":
            p[draw(st.sampled_from(TOP_IDS))] = bad
        elif where == "step_id":
            step[draw(st.sampled_from(STEP_IDS))] = bad
        elif where == "reference":
            step["task_reference"] = (step["task_reference"] + bad)[:256]
        elif where == "digest":
            p[draw(st.sampled_from(TOP_DIGESTS))] = bad
        elif where == "schema":
            p["schema"] = p["schema"] + bad
        elif where == "status":
            step["initial_status"] = bad
        else:
            steps["d"]["needs"] = sorted(steps["d"]["needs"] + [bad])
    elif kind == "digest_tamper":
        hexd = draw(st.text(alphabet="0123456789abcdef", min_size=64, max_size=64))
        field = draw(st.sampled_from(TOP_DIGESTS + ("source_digest", "plan_digest")))
        if field == "source_digest":
            step["source_digest"] = hexd if hexd != step["source_digest"] else "0" * 64
        elif field == "plan_digest":
            p["plan_digest"] = hexd
        else:
            p[field] = hexd if hexd != p[field] else "0" * 64
    elif kind == "drift":
        ident = draw(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,20}", fullmatch=True))
        field = draw(st.sampled_from(["project_id", "package_id", "installation_id", "publication_id", "workflow_key",
                                      "generation", "task_key", "task_reference", "rename_step"]))
        if field == "generation":
            p["generation"] = draw(st.integers(2, 2147483647))
        elif field == "task_key":
            step["task_key"] = ident if ident != step["task_key"] else ident + "x"
        elif field == "task_reference":
            step["task_reference"] = "pkgref:v1:" + ident
        elif field == "rename_step":
            old, new = step["step_key"], "z" + ident
            step["step_key"] = new
            for s in p["steps"]:
                s["needs"] = sorted(new if n == old else n for n in s["needs"])
        else:
            p[field] = ident if ident != p[field] else ident + "x"
    elif kind == "not_object":
        return kind, dumps(draw(st.one_of(json_leaf, st.lists(json_value, max_size=3), st.just(p["steps"]))))
    elif kind == "deep":
        depth = draw(st.integers(33, 80))
        value = draw(st.sampled_from([[], {}, "x", 1]))
        for _ in range(depth):
            value = [value] if draw(st.booleans()) else {"k": value}
        if draw(st.booleans()):
            p["nested"] = value
        else:
            step["needs"] = value
    elif kind == "bad_needs":
        step["needs"] = draw(st.one_of(
            st.just(step["needs"] + step["needs"][:1] if step["needs"] else ["nope", "nope"]),
            st.lists(non_string, min_size=1, max_size=3),
            st.just(["does-not-exist"]),
            non_string.filter(lambda v: not isinstance(v, list))))
        if step["needs"] == [] or step["needs"] is None:
            step["needs"] = ["nope"]
        step["initial_status"] = "pending" if draw(st.booleans()) else "ready"
    elif kind == "bad_generation":
        text = dumps(p)
        bad = draw(st.sampled_from(["0", "-1", "2147483648", "9007199254740993", "1.0", "1e0", "1E2", "0.5",
                                    '"1"', "true", "null", "[1]", "{}", "-0", "1.5e300"]))
        return kind, text.replace(f'"generation":{p["generation"]}', f'"generation":{bad}', 1)
    elif kind == "bad_status":
        step["initial_status"] = draw(st.sampled_from(["running", "succeeded", "READY", "Pending", "", "ready ", "skipped"]))
    return kind, dumps(p)


def _big_plan_text(base: dict) -> str:
    keys = [f"k{i:03d}" + "x" * 60 for i in range(100)]
    t = base["steps"][0]
    steps = [dict(t, step_key=k, step_run_id=f"sr:{i}", needs=keys[:i], initial_status="pending" if i else "ready")
             for i, k in enumerate(keys)]
    return dumps(dict(base, steps=steps))


def test_fuzz_bad_plans_get_a_ql_error_and_write_nothing(qlpg_db, as_role, ql3_owner):
    install(as_role("ql3_package_manager"), package("fuzz", {"wf": WF}))
    pe = as_role("ql3_package_executor")
    base, _ = installmod.prepare_plan(pe, "default", "fuzz", "wf", "run:fuzz")
    planmod.normalize_plan(base)  # the base itself is valid
    big = _big_plan_text(base)
    before = row_counts(ql3_owner)
    seen: collections.Counter = collections.Counter()
    states: collections.Counter = collections.Counter()

    def one(case):
        kind, text = case
        seen[kind] += 1
        with pytest.raises(psycopg.Error) as ei:  # autocommit: the statement is its own transaction
            pe.execute("SELECT * FROM ql3.workflow_plan_admit(%s::json)", (text,))
        state = ei.value.sqlstate or ""
        assert state.startswith("QL"), (kind, state, str(ei.value), text[:300])
        assert ei.value.diag.message_primary, (kind, state)
        states[state] += 1
        # Python agrees with SQL's normalisation: a rule of the plan itself gets the same SQLSTATE from
        # qlpg.plan.normalize_plan; a binding refusal (after normalisation) means Python accepts it.
        msg = ei.value.diag.message_primary
        binding = state in {"QL201", "QL202", "QL301"} or (state == "QL001" and " of workflow " in msg)
        if len(text) > 1024 * 1024:
            assert state == "QL002", (kind, state, msg)
            return
        try:
            planmod.normalize_plan(loads_strict(text))
            py = None
        except errors.QlpgError as exc:
            py = exc.sqlstate
        assert py == (None if binding else state), (kind, py, state, msg, text[:300])

    for kind, n in KINDS.items():
        settings(max_examples=n, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.large_base_example])(given(case=cases(base, big, kind))(one))()
    assert sum(seen.values()) >= MIN_CASES, seen
    assert set(seen) == set(KINDS) and all(seen[k] >= 10 for k in seen), seen
    assert {"QL001", "QL002", "QL202", "QL301", "QL501"} <= set(states), states
    assert row_counts(ql3_owner) == before
