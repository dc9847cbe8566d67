"""Shared test helpers: drive flows through the real SQL authority and check audit invariants."""

from __future__ import annotations

from pathlib import Path

import psycopg

from qlpg import api, install

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TERMINAL = {"succeeded", "failed", "skipped", "cancelled", "timed_out"}


def install_and_start(qlpg_db, as_role, package_dir, workflow: str, run_id: str | None = None):
    """Install ``package_dir`` as package_manager and admit ``workflow`` as package_executor."""
    pm = as_role("ql3_package_manager")
    inst = install.install_package(pm, package_dir)
    pe = as_role("ql3_package_executor")
    rec = install.start_workflow(pe, "default", inst.manifest.package, workflow, run_id)
    return inst, rec


def admit_all(rt_conn) -> list[api.AttemptReceipt]:
    """Admit every current candidate (one runtime pass over all pages)."""
    out = []
    after = None
    while True:
        page = api.task_attempt_candidates(rt_conn, after, 64)
        for c in page:
            snap = api.task_attempt_snapshot(rt_conn, c["run_id"], c["step_run_id"], c["step_run_version"])
            out.append(api.task_attempt_admit(rt_conn, c["run_id"], c["step_run_id"], c["step_run_version"],
                                              c["step_run_digest"], snap["execution_revision"]))
        if len(page) < 64:
            return out
        after = (page[-1]["run_id"], page[-1]["step_run_id"])


def check_audit_invariants(owner: psycopg.Connection, run_id: str | None = None) -> None:
    """DESIGN §4 audit invariants, for one Run or every Run in the database.

    * run_events.sequence is gapless from 1 and its max equals runs.event_sequence (= version);
    * every StepRun's mutation chain is gapless from version 1 to its current version, each
      mutation's from_status equals the previous to_status, and the last one's to_status and digest
      equal the StepRun's current status and digest;
    * every mutation references an existing RunEvent of the same Run.
    """
    where = "WHERE r.id = %(run)s" if run_id else ""
    rows = owner.execute(
        f"""SELECT r.id, r.event_sequence, r.version,
                   (SELECT count(*) FROM ql3.run_events e WHERE e.run_id = r.id) AS n,
                   (SELECT min(sequence) FROM ql3.run_events e WHERE e.run_id = r.id) AS lo,
                   (SELECT max(sequence) FROM ql3.run_events e WHERE e.run_id = r.id) AS hi
              FROM ql3.runs r {where}""", {"run": run_id}).fetchall()
    assert rows, "no runs to check"
    for r in rows:
        r = r if isinstance(r, dict) else dict(zip(("id", "event_sequence", "version", "n", "lo", "hi"), r))
        assert r["lo"] == 1 and r["hi"] == r["n"] == r["event_sequence"] == r["version"], r
    bad = owner.execute(
        """WITH m AS (
              SELECT m.*, lag(m.to_status) OVER w AS prev_to, row_number() OVER w AS rn
                FROM ql3.step_run_mutations m WINDOW w AS (PARTITION BY m.step_run_id ORDER BY m.version))
            SELECT s.id, s.status, s.version FROM ql3.step_runs s
             WHERE (%(run)s::text IS NULL OR s.run_id = %(run)s)
               AND (NOT EXISTS (SELECT 1 FROM m WHERE m.step_run_id = s.id AND m.version = s.version
                                 AND m.to_status = s.status AND m.digest = s.digest)
                 OR EXISTS (SELECT 1 FROM m WHERE m.step_run_id = s.id
                             AND (m.rn <> m.version OR (m.version > 1 AND m.from_status IS DISTINCT FROM m.prev_to)
                                  OR (m.version = 1 AND m.from_status IS NOT NULL)))
                 OR EXISTS (SELECT 1 FROM ql3.step_run_mutations m2 WHERE m2.step_run_id = s.id
                             AND NOT EXISTS (SELECT 1 FROM ql3.run_events e WHERE e.run_id = s.run_id
                                              AND e.sequence = m2.run_sequence AND e.step_run_id = s.id)))""",
        {"run": run_id}).fetchall()
    assert not bad, f"StepRun mutation chains broken: {bad}"
