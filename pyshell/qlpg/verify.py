"""Digest checks over every immutable record (used by `qlpg doctor` and the tests).

Recomputes, in Python, the domain-separated canonical digest of every stored plan, admission
receipt, attempt receipt, completion receipt and Task Execution Revision and compares it with the
stored digest. Needs read access to the tables (the owner ``ql3_migration`` or a superuser).
Returns a list of human-readable failures (empty when everything verifies).
"""

from __future__ import annotations

import psycopg

from . import plan as planmod
from .canonical import domain_digest
from .errors import QlpgError
from .revision import execution_revision_digest


def verify_digests(conn: psycopg.Connection) -> list[str]:
    bad: list[str] = []
    with conn.transaction():
        for r in conn.execute("SELECT run_id, plan_digest, plan, receipt, receipt_digest FROM ql3.workflow_admissions"):
            if planmod.plan_digest(r["plan"]) != r["plan_digest"]:
                bad.append(f"plan of run {r['run_id']}")
            if domain_digest(planmod.ADMISSION_RECEIPT_DOMAIN, r["receipt"]) != r["receipt_digest"]:
                bad.append(f"admission receipt of run {r['run_id']}")
        for r in conn.execute("SELECT attempt_id, receipt, receipt_digest FROM ql3.task_attempt_admissions"):
            if domain_digest(planmod.ATTEMPT_RECEIPT_DOMAIN, r["receipt"]) != r["receipt_digest"]:
                bad.append(f"attempt receipt {r['attempt_id']}")
        for r in conn.execute("SELECT attempt_id, receipt, receipt_digest FROM ql3.run_attempt_completions"):
            if domain_digest(planmod.COMPLETION_RECEIPT_DOMAIN, r["receipt"]) != r["receipt_digest"]:
                bad.append(f"completion receipt {r['attempt_id']}")
        for r in conn.execute("SELECT * FROM ql3.task_execution_revisions"):
            try:
                d = execution_revision_digest(r["project_id"], r["task_id"], r["task_revision"], r["executor_type"],
                                              r["execution_template"], r["context_ref"])
            except QlpgError as exc:
                bad.append(f"revision {r['task_id']} {r['task_revision']}: {exc}")
                continue
            if d != r["content_digest"]:
                bad.append(f"revision {r['task_id']} {r['task_revision']}")
    return bad
