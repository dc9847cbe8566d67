"""HA gate checks: journals, exact replays, durable receipts, epochs, audit invariants, replica equality.

Every function takes open connections and returns plain data (lists of problems, counters), so
the gate can print and store them; nothing here raises on a failed check.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psycopg

from qlpg import api, errors

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- journals
@dataclass
class Journals:
    plans: dict[str, dict] = field(default_factory=dict)          # run_id -> first acknowledged line
    attempts: dict[str, dict] = field(default_factory=dict)       # attempt_id -> line
    completions: dict[str, dict] = field(default_factory=dict)    # attempt_id -> line
    ambiguous: list[dict] = field(default_factory=list)
    cancels: list[dict] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)            # the same key acknowledged with two digests
    ack_times: list[float] = field(default_factory=list)          # every acknowledged qlpg write
    probe_acks: list[tuple[float, int]] = field(default_factory=list)
    probe_errors: list[dict] = field(default_factory=list)
    executors: dict[str, set] = field(default_factory=lambda: defaultdict(set))  # attempt -> worker ids

    def receipts(self) -> list[tuple[str, dict]]:
        return ([("plan", v) for v in self.plans.values()] + [("attempt", v) for v in self.attempts.values()]
                + [("completion", v) for v in self.completions.values()])


def _keep(store: dict, key: str, line: dict, conflicts: list[str], what: str) -> None:
    old = store.get(key)
    if old is None:
        store[key] = line
    elif old["receipt_digest"] != line["receipt_digest"]:
        conflicts.append(f"{what} {key}: acknowledged as {old['receipt_digest']} and as {line['receipt_digest']}")


def load_journals(logs: Path) -> Journals:
    j = Journals()
    for path in sorted(logs.glob("*.jsonl")):
        for raw in path.read_text().splitlines():
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                continue  # a torn last line of a killed client
            k = line.get("kind")
            if k == "plan_admission":
                _keep(j.plans, line["run_id"], line, j.conflicts, "plan admission of run")
                j.ack_times.append(line["t"])
            elif k == "attempt_admission":
                _keep(j.attempts, line["attempt_id"], line, j.conflicts, "attempt admission")
                j.ack_times.append(line["t"])
            elif k == "completion":
                _keep(j.completions, line["attempt_id"], line, j.conflicts, "completion of attempt")
                j.executors[line["attempt_id"]].add(line["worker_id"])
                j.ack_times.append(line["t"])
            elif k == "ambiguous":
                j.ambiguous.append(line)
            elif k == "cancel":
                j.cancels.append(line)
            elif k == "probe":
                j.probe_acks.append((line["t"], line["id"]))
            elif k == "probe_error":
                j.probe_errors.append(line)
    j.ack_times.sort()
    j.probe_acks.sort()
    return j


def max_gap(times: list[float], start: float, end: float) -> tuple[float, float | None]:
    """Largest gap between consecutive acknowledgements whose interval overlaps [start, end];
    returns (gap seconds, time of the acknowledgement that ended it)."""
    best, at = 0.0, None
    for a, b in zip(times, times[1:]):
        if b < start or a > end:
            continue
        if b - a > best:
            best, at = b - a, b
    return best, at


# ----------------------------------------------------------------------------- exact replays
@dataclass
class ReplayStats:
    issued: int = 0
    identical: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, other: "ReplayStats") -> None:
        self.issued += other.issued
        self.identical += other.identical
        self.problems += other.problems


def _retry(fn: Callable, *args, tries: int = 100):
    for i in range(tries):
        try:
            return fn(*args)
        except (psycopg.OperationalError, errors.ConnectError):
            if i == tries - 1:
                raise
            time.sleep(0.2)


def replay(kind: str, line: dict, conns: dict[str, Callable[[], psycopg.Connection]]) -> tuple[bool, str]:
    """Issue the exact replay(s) of one acknowledged call; ``(identical, detail)``."""
    want = line["receipt_digest"]
    try:
        if kind == "plan":
            plan = dict(line["plan"], plan_digest=line["plan_digest"])
            rec = _retry(lambda: api.workflow_plan_admit(conns["executor"](), plan))
            ins = _retry(lambda: api.workflow_admission_inspect(conns["executor"](), line["run_id"]))
            got = {(rec.receipt_digest, rec.replayed), (ins.receipt_digest, ins.replayed)}
            return got == {(want, True)}, f"plan {line['run_id']}: {got}"
        if kind == "attempt":
            key = (line["run_id"], line["step_run_id"], line["step_run_version"])
            # A page admission (runtime --batch) journals no revision: the replay takes the
            # generation-bound one, exactly as a caller of task_attempt_admit would.
            rev = line.get("execution_revision") or _retry(
                lambda: api.task_attempt_snapshot(conns["runtime"](), *key))["execution_revision"]
            rec = _retry(lambda: api.task_attempt_admit(conns["runtime"](), *key, line["step_run_digest"], rev))
            ins = _retry(lambda: api.task_attempt_inspect(conns["runtime"](), *key))
            got = {(rec.receipt_digest, rec.replayed, rec.attempt_id), (ins.receipt_digest, ins.replayed, ins.attempt_id)}
            return got == {(want, True, line["attempt_id"])}, f"attempt {line['attempt_id']}: {got}"
        if kind == "completion":
            if line["call"] == "complete":
                r = _retry(lambda: api.attempt_complete(conns["worker"](), line["attempt_id"], line["lease_token"],
                                                        line["reported"], line["exit_code"], None))
            else:
                r = _retry(lambda: api.attempt_start_failed(conns["worker"](), line["attempt_id"], line["lease_token"], None))
            got = (r["receipt_digest"], r["replayed"], r["outcome"])
            return got == (want, True, line["outcome"]), f"completion {line['attempt_id']}: {got}"
    except errors.QlpgError as exc:
        return False, f"{kind} {line.get('attempt_id') or line.get('run_id')}: {type(exc).__name__}: {exc}"
    raise ValueError(kind)


def replay_batch(items: list[tuple[str, dict]], conns) -> ReplayStats:
    st = ReplayStats()
    for kind, line in items:
        ok, detail = replay(kind, line, conns)
        st.issued += 1
        if ok:
            st.identical += 1
        else:
            st.problems.append(detail)
    return st


def sample_for_event(j: Journals, t0: float, rng: random.Random, window: float = 10.0, older: int = 25):
    """Receipts at risk (acknowledged in the ``window`` seconds before the event or during it) plus
    a random sample of older ones."""
    recent, old = [], []
    for kind, line in j.receipts():
        (recent if line["t"] >= t0 - window else old).append((kind, line))
    return recent + rng.sample(old, min(older, len(old)))


# ----------------------------------------------------------------------------- database checks
def durable_receipts(owner: psycopg.Connection, j: Journals) -> list[str]:
    """Every acknowledged receipt present with the identical digest (the lost receipts)."""
    lost: list[str] = []
    plans = {r["run_id"]: r for r in owner.execute(
        "SELECT run_id, plan_digest, receipt_digest FROM ql3.workflow_admissions")}
    for run_id, line in j.plans.items():
        r = plans.get(run_id)
        if r is None or r["receipt_digest"] != line["receipt_digest"] or r["plan_digest"] != line["plan_digest"]:
            lost.append(f"plan admission of run {run_id}: acknowledged {line['receipt_digest']}, stored "
                        f"{r and r['receipt_digest']}")
    atts = {r["attempt_id"]: r for r in owner.execute(
        "SELECT attempt_id, run_id, step_run_id, step_run_version, receipt_digest FROM ql3.task_attempt_admissions")}
    for aid, line in j.attempts.items():
        r = atts.get(aid)
        if (r is None or r["receipt_digest"] != line["receipt_digest"]
                or (r["run_id"], r["step_run_id"], r["step_run_version"])
                != (line["run_id"], line["step_run_id"], line["step_run_version"])):
            lost.append(f"attempt admission {aid}: acknowledged {line['receipt_digest']}, stored {r and r['receipt_digest']}")
    comps = {r["attempt_id"]: r for r in owner.execute(
        "SELECT attempt_id, outcome, receipt_digest FROM ql3.run_attempt_completions")}
    for aid, line in j.completions.items():
        r = comps.get(aid)
        if r is None or r["receipt_digest"] != line["receipt_digest"] or r["outcome"] != line["outcome"]:
            lost.append(f"completion of {aid}: acknowledged {line['receipt_digest']}, stored {r and r['receipt_digest']}")
    return lost


def epoch_problems(owner: psycopg.Connection, j: Journals) -> list[str]:
    out = [f"epoch {r['step_run_id']} v{r['step_run_version']} has {r['n']} attempts"
           for r in owner.execute("""SELECT step_run_id, step_run_version, count(*) AS n FROM ql3.run_attempts
                                      GROUP BY 1, 2 HAVING count(*) > 1""")]
    out += [f"step run {r['step_run_id']} entered running {r['n']} times at epoch v{r['step_run_version']}"
            for r in owner.execute("""SELECT step_run_id, step_run_version, count(*) AS n FROM ql3.run_attempts
                                       WHERE running_at_ms IS NOT NULL GROUP BY 1, 2 HAVING count(*) > 1""")]
    out += [f"attempt {a} reported by several workers: {sorted(w)}" for a, w in j.executors.items() if len(w) > 1]
    return out


def run_summary(owner: psycopg.Connection) -> dict:
    rows = owner.execute("""SELECT r.task_id AS workflow, r.status, (r.cancel_requested_at_ms IS NOT NULL) AS cancelled,
                                   count(*) AS n FROM ql3.runs r GROUP BY 1, 2, 3 ORDER BY 1, 2, 3""").fetchall()
    by = defaultdict(dict)
    for r in rows:
        by[r["workflow"]][r["status"] + (" (cancel requested)" if r["cancelled"] else "")] = r["n"]
    att = {r["status"]: r["n"] for r in owner.execute("SELECT status, count(*) AS n FROM ql3.run_attempts GROUP BY 1")}
    rec = {r["status"] + "/" + (r["resolution"] or "-"): r["n"] for r in owner.execute(
        "SELECT status, resolution, count(*) AS n FROM ql3.run_recovery_controls GROUP BY 1, 2")}
    total = owner.execute("SELECT count(*) AS n, count(*) FILTER (WHERE status = 'running') AS running FROM ql3.runs").fetchone()
    return {"runs": total["n"], "running": total["running"], "by_workflow": dict(by), "attempts": att, "recovery": rec}


def audit_invariants(owner: psycopg.Connection) -> list[str]:
    """tests/helpers.py check_audit_invariants over every Run (gapless events, mutation chains)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from helpers import check_audit_invariants  # type: ignore
    finally:
        sys.path.pop(0)
    try:
        check_audit_invariants(owner)
        return []
    except AssertionError as exc:
        return [str(exc)[:2000]]


def digest_problems(owner: psycopg.Connection) -> list[str]:
    from qlpg.verify import verify_digests

    return verify_digests(owner)


# ----------------------------------------------------------------------------- replica equality
def table_digests(conn: psycopg.Connection, schema: str) -> dict[str, tuple[int, str]]:
    tables = [r["tablename"] for r in conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY 1", (schema,))]
    out = {}
    for t in tables:
        r = conn.execute(
            f'SELECT count(*) AS n, md5(coalesce(string_agg(md5(x::text), \'\' ORDER BY md5(x::text)), \'\')) AS d '
            f'FROM "{schema}"."{t}" x').fetchone()
        out[t] = (r["n"], r["d"])
    return out


def wait_replica(primary: psycopg.Connection, standby: psycopg.Connection, timeout: float = 60) -> float:
    lsn = primary.execute("SELECT pg_current_wal_lsn() AS l").fetchone()["l"]
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        r = standby.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn AS ok", (lsn,)).fetchone()
        if r["ok"]:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise TimeoutError(f"standby did not replay up to {lsn} within {timeout}s")


def compare_replica(primary: psycopg.Connection, standby: psycopg.Connection, schema: str) -> tuple[int, list[str]]:
    a, b = table_digests(primary, schema), table_digests(standby, schema)
    problems = [f"{schema}.{t}: primary {a.get(t)} standby {b.get(t)}" for t in sorted(set(a) | set(b))
                if a.get(t) != b.get(t)]
    return sum(n for n, _ in a.values()), problems


def ambiguity_summary(j: Journals) -> dict:
    c = Counter((x["client"], x["call"], x["resolution"]) for x in j.ambiguous)
    return {f"{k[0]}:{k[1]}:{k[2]}": v for k, v in sorted(c.items())}
