"""Admission refusals (ADR-0223 §3): every refusal has its own SQLSTATE and message and writes nothing.

Each case builds a plan that is valid except for one binding (or whose package facts changed after
the plan was built) and sends it through ``ql3.workflow_plan_admit`` as ``ql3_package_executor``.
Checked per case: the SQLSTATE, a message matching the case's own pattern and no other case's, and
identical row counts in every runtime table and every package-fact table before and after the call.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Callable

import psycopg
import pytest

from qlpg import api, install as installmod, plan as planmod

from helpers import check_audit_invariants
from test_plan_support import DIAMOND, install, owner_snapshot, package, row_counts

Case = tuple[str, str, str, Callable]  # name, sqlstate, message regex, setup -> plan (dict or json text)


def _cases(pm, pe, owner) -> list[Case]:
    n = [0]

    def fresh(**kw) -> tuple[str, dict]:
        """Install a new package (own name and publisher) with workflows wf (diamond) and wf2; a plan of wf."""
        n[0] += 1
        name = f"ref{n[0]}"
        install(pm, package(name, {"wf": DIAMOND, "wf2": {"x": [], "y": ["x"]}}, publisher=f"pub-{name}", **kw))
        return name, installmod.prepare_plan(pe, "default", name, "wf")[0]

    def edit(fn) -> Callable:
        def setup():
            _, p = fresh()
            fn(p)
            return p
        return setup

    def step(key: str, p: dict) -> dict:
        return next(s for s in p["steps"] if s["step_key"] == key)

    def run_collision():
        name, p = fresh()
        installmod.admit_plan(pe, p, planmod.plan_digest(p))
        other = installmod.prepare_plan(pe, "default", name, "wf2", p["run_id"])[0]  # same run id, other plan
        return other

    def steprun_collision():
        _, p = fresh()
        installmod.admit_plan(pe, p, planmod.plan_digest(p))
        return dict(copy.deepcopy(p), run_id="run:another")  # A's StepRun ids under a new run id

    def new_generation(p_name: str) -> None:
        install(pm, package(p_name, {"wf": DIAMOND, "wf2": {"x": [], "y": ["x"]}}, publisher=f"pub-{p_name}",
                            version="2.0.0"))

    def non_current():
        name, p = fresh()
        new_generation(name)  # publish generation 2: the plan's publication is no longer the head
        return p

    def publication_generation_drift():
        name, p = fresh()
        new_generation(name)
        p2 = installmod.prepare_plan(pe, "default", name, "wf")[0]
        return dict(p2, publication_id=p["publication_id"])  # generation 2, generation 1's publication

    def withdrawn():
        _, p = fresh()
        api.automation_withdraw(pm, p["publication_id"], "retired")
        return p

    def quarantined():
        name, p = fresh()
        api.package_quarantine(pm, "default", name, "malware report", "secops")
        return p

    def revoked():
        name, p = fresh()
        api.publisher_revoke(pm, f"pub-{name}", "key compromised", "secops")
        return p

    def disabled_workflow():
        n[0] += 1
        name = f"ref{n[0]}"
        install(pm, package(name, {"wf": DIAMOND}, publisher=f"pub-{name}", disabled_workflows=["wf"]))
        return planmod.build_plan(owner_snapshot(owner, "default", name, "wf"))

    def disabled_task():
        n[0] += 1
        name = f"ref{n[0]}"
        install(pm, package(name, {"wf": DIAMOND}, publisher=f"pub-{name}", disabled_tasks=["t-c"]))
        snap = api.workflow_admission_snapshot(pe, "default", name, "wf")
        assert snap["steps"]["c"]["task_enabled"] is False
        return planmod.build_plan(snap)

    def duplicate_key_json():
        _, p = fresh()
        text = json.dumps(p)
        return text.replace('"run_id": ', '"run_id": "run:dup", "run_id": ', 1)

    def unknown_step(p):
        extra = dict(step("d", p), step_key="e", step_run_id="sr:e-extra", needs=["d"])
        p["steps"].append(extra)

    return [
        ("run id collision with another plan", "QL201", r"^run id collision: run \S+ exists with another plan$",
         run_collision),
        ("StepRun id collision", "QL201", r"^StepRun id collision: StepRun \S+ of this plan already exists", steprun_collision),
        ("generation drift: no such generation", "QL202", r"^plan generation drift: \S+ has no generation 7$",
         edit(lambda p: p.update(generation=7))),
        ("generation drift: lock digest", "QL202", r"^plan generation drift: lock_digest of \S+ generation 1 differs",
         edit(lambda p: p.update(lock_digest="a" * 64))),
        ("generation drift: installation", "QL202", r"^plan generation drift: installation_id of",
         edit(lambda p: p.update(installation_id="inst:other"))),
        ("generation drift: revision digest", "QL202", r"^plan generation drift: revision_digest of",
         edit(lambda p: p.update(revision_digest="b" * 64))),
        ("publication bound to another generation", "QL202",
         r"^plan publication drift: publication \S+ publishes \S+ generation 1, the plan binds generation 2$",
         publication_generation_drift),
        ("publication digest drift", "QL202", r"^plan publication drift: publication \S+ has digest [0-9a-f]{64}, the plan binds c{64}$",
         edit(lambda p: p.update(publication_digest="c" * 64))),
        ("unknown publication", "QL301", r"^start guard: publication pub:nope does not exist$",
         edit(lambda p: p.update(publication_id="pub:nope"))),
        ("non-current publication (new generation published)", "QL301",
         r"^start guard: publication \S+ is not the current publication of \S+ \(current: \S+\)$", non_current),
        ("withdrawn publication", "QL301", r"^start guard: publication \S+ is withdrawn$", withdrawn),
        ("quarantined package", "QL301", r"^start guard: package \S+ is quarantined$", quarantined),
        ("revoked publisher", "QL301", r"^start guard: publisher \S+ is revoked$", revoked),
        ("disabled workflow", "QL301", r"^start guard: workflow wf is disabled$", disabled_workflow),
        ("disabled task", "QL301", r"^start guard: task t-c of step c is disabled$", disabled_task),
        ("missing StepRun id", "QL001", r"^plan\.steps\[1\]: required|^plan\.steps\[1\]\.step_run_id: required$",
         edit(lambda p: step("b", p).pop("step_run_id"))),
        ("missing step (no StepRun id for it)", "QL001", r"^plan\.steps: step d of workflow wf is missing from the plan",
         edit(lambda p: p["steps"].remove(step("d", p)))),
        ("unknown step", "QL001", r"^plan\.steps: step e is not a step of workflow wf$", edit(unknown_step)),
        ("duplicate StepRun id", "QL001", r"^plan\.steps\[2\]\.step_run_id: duplicate StepRun id ",
         edit(lambda p: step("c", p).update(step_run_id=step("b", p)["step_run_id"]))),
        ("duplicate JSON key", "QL001", r"^\$: duplicate object key$|^\$\.run_id: duplicate object key$", duplicate_key_json),
        ("plan digest drift", "QL501", r"^plan\.plan_digest: f{64} does not match the recomputed canonical digest",
         edit(lambda p: p.update(plan_digest="f" * 64))),
        ("workflow semantic digest drift", "QL202",
         r"^plan reference drift: workflow wf has semantic digest [0-9a-f]{64} in generation 1, the plan binds d{64}$",
         edit(lambda p: p.update(workflow_semantic_digest="d" * 64))),
        ("workflow not in the generation", "QL202", r"^plan reference drift: workflow nope is not in \S+ generation 1$",
         edit(lambda p: p.update(workflow_key="nope"))),
        ("step binds another task", "QL202", r"^plan reference drift: step b binds another task than the workflow definition \(t-b\)$",
         edit(lambda p: step("b", p).update(task_key="t-c"))),
        ("step needs drift", "QL202", r"^plan reference drift: step d needs differ from the workflow definition",
         edit(lambda p: step("d", p).update(needs=["b"]))),
        ("source digest drift", "QL202", r"^plan reference drift: step c source digest is not the task's source digest",
         edit(lambda p: step("c", p).update(source_digest="e" * 64))),
        ("generation-bound reference drift", "QL202",
         r"^plan reference drift: step a task_reference is not the generation-bound reference pkgref:v1:\S+:1:t-a$",
         edit(lambda p: step("a", p).update(task_reference="pkgref:v1:elsewhere:1:t-a"))),
        ("non-root ready", "QL001", r"^plan\.steps\[3\]\.initial_status: only root steps",
         edit(lambda p: step("d", p).update(initial_status="ready"))),
    ]


def test_every_refusal_has_its_own_sqlstate_and_message_and_writes_nothing(qlpg_db, as_role, ql3_owner):
    pm, pe = as_role("ql3_package_manager"), as_role("ql3_package_executor")
    cases = _cases(pm, pe, ql3_owner)
    seen: dict[str, str] = {}
    for name, state, pattern, setup in cases:
        plan = setup()
        text = plan if isinstance(plan, str) else json.dumps(plan)
        before = row_counts(ql3_owner)
        with pytest.raises(psycopg.Error) as ei:
            with pe.transaction():
                pe.execute("SELECT * FROM ql3.workflow_plan_admit(%s::json)", (text,))
        msg = ei.value.diag.message_primary or ""
        assert ei.value.sqlstate == state, (name, ei.value.sqlstate, msg)
        assert re.search(pattern, msg), (name, msg)
        assert row_counts(ql3_owner) == before, f"{name}: the refused admission wrote something"
        seen[name] = msg
    # each message is its case's own: no other case's pattern matches it
    for name, _state, _pattern, _ in cases:
        others = [n for n, _s, pat, _ in cases if n != name and re.search(pat, seen[name])]
        assert not others, (name, seen[name], others)
    assert len(set(seen.values())) == len(cases)
    check_audit_invariants(ql3_owner)


def test_refusal_leaves_the_plan_admissible_once_fixed(qlpg_db, as_role, ql3_owner):
    """A refused plan left nothing behind: the corrected plan with the same Run id is admitted."""
    install(as_role("ql3_package_manager"), package("fixme", {"wf": DIAMOND}))
    pe = as_role("ql3_package_executor")
    plan, digest = installmod.prepare_plan(pe, "default", "fixme", "wf", "run:fixme")
    bad = copy.deepcopy(plan)
    bad["steps"][-1]["source_digest"] = "0" * 64
    with pytest.raises(Exception):
        api.workflow_plan_admit(pe, bad)
    rec = installmod.admit_plan(pe, plan, digest)
    assert rec.run_id == "run:fixme" and not rec.replayed
    check_audit_invariants(ql3_owner, rec.run_id)


@pytest.mark.parametrize("isolation", ["repeatable read", "read committed", "serializable"])
def test_concurrent_identical_admissions_at_every_isolation(qlpg_db, as_role, ql3_owner, monkeypatch, isolation):
    """Four sessions admit the same plan at once: one inserts, three replay the identical receipt —
    never a unique violation (at REPEATABLE READ a stale snapshot meets the committed Run through
    INSERT ... ON CONFLICT, which raises 40001 and the shell retries)."""
    import threading

    monkeypatch.setenv("QLPG_ISOLATION", isolation)
    monkeypatch.setenv("QLPG_ADMISSION_ISOLATION", isolation)
    install(as_role("ql3_package_manager"), package("same", {"wf": DIAMOND}))
    plan, digest = installmod.prepare_plan(as_role("ql3_package_executor"), "default", "same", "wf", "run:same")
    conns = [as_role("ql3_package_executor") for _ in range(4)]
    barrier = threading.Barrier(len(conns))
    out: list = [None] * len(conns)

    def go(i):
        barrier.wait()
        try:
            out[i] = installmod.admit_plan(conns[i], plan, digest)
        except Exception as exc:  # noqa: BLE001 - asserted below
            out[i] = exc

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(conns))]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    assert all(isinstance(r, api.AdmissionReceipt) for r in out), out
    assert sorted(r.replayed for r in out) == [False, True, True, True]
    assert len({(r.run_id, r.receipt_digest) for r in out}) == 1
    assert ql3_owner.execute("SELECT count(*) FROM ql3.runs").fetchone()[0] == 1
    check_audit_invariants(ql3_owner, "run:same")
