"""Shared support for the plan / frontier / revocation test modules (no tests here).

* :func:`package` + :func:`install` — install a synthetic package from a Python dict (the same
  path as ``qlpg package install``: materialize → reconcile → publish, as ``ql3_package_manager``);
* :func:`owner_snapshot` — the admission snapshot of any generation read as the owner, bypassing
  the start guard (to build plans the guard must then refuse at admission);
* :class:`Driver` — drives StepRuns through the real SQL API as the runtime and a worker
  (``task_attempt_admit`` → ``lease_acquire`` → ``attempt_start`` → ``attempt_running`` →
  ``attempt_complete``) without running processes;
* :func:`row_counts` — row counts of every runtime table (for "a refusal writes nothing").
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

import psycopg

from qlpg import api, errors, install as installmod, manifest as manifestmod, plan as planmod

from helpers import admit_all

RUNTIME_TABLES = (
    "runs", "step_runs", "step_run_mutations", "run_events", "workflow_admissions",
    "workflow_admission_steps", "task_attempt_admissions", "run_attempts", "run_dispatch_leases",
    "run_attempt_completions", "run_recovery_controls",
)
PACKAGE_FACT_TABLES = (
    "package_materialized_revisions", "package_revision_tasks", "package_revision_workflows",
    "automation_publications", "automation_publication_heads", "package_quarantines",
    "publisher_revocations", "task_reconciliation_receipts", "task_reconciliation_items",
    "task_execution_revisions",
)


def package(name: str, workflows: Mapping[str, Mapping[str, Iterable[str]]], *, publisher: str = "qlpg-tests",
            version: str = "1.0.0", disabled_tasks: Iterable[str] = (), disabled_workflows: Iterable[str] = (),
            task_of: Mapping[str, str] | None = None, timeout_ms: int = 30000,
            timeouts: Mapping[str, int] | None = None) -> dict[str, Any]:
    """A manifest dict: each workflow maps step key → needs; every step runs task ``t-<step>``
    unless ``task_of`` maps it elsewhere (one task per step key, all ``true`` commands). Tasks time
    out after ``timeout_ms`` unless ``timeouts`` names the task."""
    timeouts = dict(timeouts or {})
    task_of = dict(task_of or {})
    tasks: dict[str, Any] = {}
    wfs: dict[str, Any] = {}
    disabled_tasks, disabled_workflows = set(disabled_tasks), set(disabled_workflows)
    for wf, steps in workflows.items():
        st = {}
        for key, needs in steps.items():
            task = task_of.get(key, f"t-{key}")
            tasks.setdefault(task, {"command": ["true"], "timeout_ms": timeouts.get(task, timeout_ms),
                                    **({"enabled": False} if task in disabled_tasks else {})})
            st[key] = {"task": task, "needs": list(needs)}
        wfs[wf] = {"steps": st, **({"enabled": False} if wf in disabled_workflows else {})}
    return {"package": name, "version": version, "publisher": publisher, "tasks": tasks, "workflows": wfs}


def install(pm: psycopg.Connection, data: Mapping[str, Any], project_id: str = "default") -> installmod.InstallResult:
    """Install a manifest dict exactly like :func:`qlpg.install.install_package` does a directory."""
    man = manifestmod.parse_manifest(dict(data), path="<test>", directory=os.getcwd())
    doc = planmod.materialized_document(man, project_id)
    m = api.package_revision_materialize(pm, doc)
    assert m["revision_digest"] == planmod.revision_digest(doc)
    rec = api.task_reconciliation_record(pm, project_id, man.package, m["generation"])
    pub = api.automation_publish(pm, project_id, man.package, m["generation"])
    return installmod.InstallResult(man, project_id, m["outcome"], m["generation"], m["revision_digest"],
                                    rec["receipt_digest"], pub["publication_id"], pub["publication_digest"])


def chain(n: int, prefix: str = "s") -> dict[str, list[str]]:
    """Steps s000 → s001 → … (each needs the previous one)."""
    keys = [f"{prefix}{i:03d}" for i in range(n)]
    return {k: ([keys[i - 1]] if i else []) for i, k in enumerate(keys)}


DIAMOND = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]}


def owner_snapshot(owner: psycopg.Connection, project_id: str, package_id: str, workflow_key: str,
                   generation: int | None = None) -> dict[str, Any]:
    """The snapshot ``ql3.workflow_admission_snapshot`` would give, for any generation (default:
    the current head's), read directly as the owner — no start guard."""
    row = owner.execute(
        """SELECT m.project_id, m.package_id, m.installation_id, m.lock_digest, m.generation, m.revision_digest,
                  p.publication_id, p.publication_digest, w.workflow_key, w.semantic_digest, w.definition
             FROM ql3.package_materialized_revisions m
             JOIN ql3.automation_publications p
               ON p.project_id = m.project_id AND p.package_id = m.package_id AND p.generation = m.generation
             JOIN ql3.package_revision_workflows w
               ON w.project_id = m.project_id AND w.package_id = m.package_id AND w.generation = m.generation
            WHERE m.project_id = %(pr)s AND m.package_id = %(pk)s AND w.workflow_key = %(wf)s
              AND m.generation = COALESCE(%(g)s::int, (SELECT p2.generation FROM ql3.automation_publication_heads h
                                                    JOIN ql3.automation_publications p2 USING (publication_id)
                                                   WHERE h.project_id = %(pr)s AND h.package_id = %(pk)s))""",
        {"pr": project_id, "pk": package_id, "wf": workflow_key, "g": generation}).fetchone()
    assert row is not None, (project_id, package_id, workflow_key, generation)
    row = row if isinstance(row, dict) else dict(zip(
        ("project_id", "package_id", "installation_id", "lock_digest", "generation", "revision_digest",
         "publication_id", "publication_digest", "workflow_key", "semantic_digest", "definition"), row))
    tasks = dict(owner.execute(
        "SELECT task_key, source_digest FROM ql3.package_revision_tasks WHERE project_id = %s AND package_id = %s"
        " AND generation = %s", (project_id, package_id, row["generation"])).fetchall())
    steps = {k: {"task_key": s["task"], "needs": s["needs"], "source_digest": tasks[s["task"]],
                 "task_reference": f"pkgref:v1:{package_id}:{row['generation']}:{s['task']}"}
             for k, s in row["definition"]["steps"].items()}
    return {"project_id": project_id, "package_id": package_id, "installation_id": row["installation_id"],
            "lock_digest": row["lock_digest"], "generation": row["generation"],
            "revision_digest": row["revision_digest"], "publication_id": row["publication_id"],
            "publication_digest": row["publication_digest"], "workflow_key": workflow_key,
            "workflow_semantic_digest": row["semantic_digest"], "steps": steps}


def row_counts(owner: psycopg.Connection, tables: Iterable[str] = RUNTIME_TABLES + PACKAGE_FACT_TABLES) -> dict[str, int]:
    """``{table: count(*)}`` of the given ql3 tables (default: every runtime and package-fact table)."""
    q = " UNION ALL ".join(f"SELECT '{t}', count(*) FROM ql3.{t}" for t in tables)
    return {r[0]: r[1] for r in owner.execute(q).fetchall()}


def sqlstate_of(exc: BaseException) -> str | None:
    """The SQLSTATE of a qlpg or psycopg error."""
    return getattr(exc, "sqlstate", None) or getattr(getattr(exc, "diag", None), "sqlstate", None)


class Driver:
    """Completes StepRuns through the SQL API as ``ql3_runtime`` + ``ql3_worker_ingress``."""

    def __init__(self, as_role, worker_id: str = "test-worker"):
        self.rt = as_role("ql3_runtime")
        self.wi = as_role("ql3_worker_ingress")
        self.worker_id = worker_id
        self.leases: dict[str, api.Lease] = {}  # step_run_id -> lease

    def admit(self) -> list[api.AttemptReceipt]:
        """Admit every ready epoch (one runtime pass)."""
        return admit_all(self.rt)

    def lease_batch(self) -> list[api.Lease]:
        """Lease every claimed attempt (pages of 64)."""
        got: list[api.Lease] = []
        while True:
            batch = api.lease_acquire(self.wi, self.worker_id, max_=64)
            for lease in batch:
                self.leases[lease.step_run_id] = lease
            got += batch
            if len(batch) < 64:
                return got

    def lease_all(self) -> dict[str, api.Lease]:
        """Lease every claimed attempt of one Run; returns the leases by step key."""
        got = {}
        for lease in self.lease_batch():
            assert lease.step_key not in got, "lease_all is for one Run at a time: use lease_batch"
            got[lease.step_key] = lease
        return got

    def start(self, lease: api.Lease, running: bool = True) -> None:
        api.attempt_start(self.wi, lease.attempt_id, lease.lease_token)
        if running:
            api.attempt_running(self.wi, lease.attempt_id, lease.lease_token)

    def complete(self, lease: api.Lease, outcome: str = "succeeded", exit_code: int | None = None,
                 conn: psycopg.Connection | None = None) -> dict:
        if exit_code is None:
            exit_code = 0 if outcome == "succeeded" else 1
        return api.attempt_complete(conn or self.wi, lease.attempt_id, lease.lease_token, outcome, exit_code)

    def step_ready(self, outcomes: Mapping[str, str] | None = None, default: str = "succeeded") -> list[str]:
        """Admit, lease, start and complete every ready step once (outcome by step key); returns keys."""
        outcomes = outcomes or {}
        self.admit()
        done = []
        for lease in sorted(self.lease_batch(), key=lambda x: (x.run_id, x.step_key)):
            self.start(lease)
            self.complete(lease, outcomes.get(lease.step_key, default))
            done.append(lease.step_key)
        return done

    def drive(self, outcomes: Mapping[str, str] | None = None, default: str = "succeeded", max_rounds: int = 256) -> int:
        """Complete ready steps round by round until nothing is ready; returns the number of rounds."""
        for i in range(max_rounds):
            if not self.step_ready(outcomes, default):
                return i
        raise AssertionError("frontier did not converge")


def run_state(owner: psycopg.Connection, run_id: str) -> tuple[str, dict[str, str]]:
    """``(run status, {step_key: status})`` read as the owner."""
    status = owner.execute("SELECT status FROM ql3.runs WHERE id = %s", (run_id,)).fetchone()[0]
    steps = dict(owner.execute("SELECT step_key, status FROM ql3.step_runs WHERE run_id = %s", (run_id,)).fetchall())
    return status, steps


def admit_plan_as(pe: psycopg.Connection, snapshot: Mapping[str, Any], run_id: str | None = None) -> api.AdmissionReceipt:
    """Build a plan from ``snapshot`` and admit it (with its digest) as ``ql3_package_executor``."""
    plan = planmod.build_plan(snapshot, run_id)
    return installmod.admit_plan(pe, plan, planmod.plan_digest(plan))


__all__ = [n for n in dir() if not n.startswith("_")] + ["errors"]
