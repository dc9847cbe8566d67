"""HA gate workload: the gate's package, the Workflow starter and the write probe.

``write_package(dir)`` writes package ``hagate`` with four Workflows:

* ``fanout``  root -> 6 parallel steps -> join (8 steps, succeeds)
* ``chain``   5 steps in a row (succeeds)
* ``failing`` prep -> bad (exits 3) -> two dependents (skipped) + a side step: Run ``failed``
* ``timeout`` prep -> slow (sleeps past its 1.5 s timeout) -> after (skipped): Run ``timed_out``

``starter`` (a process) admits Workflows as ``ql3_package_executor`` through the multi-host DSN,
keeping at most ``--max-inflight`` Runs of its own running, and requests whole-run cancellation
of a fraction of them as ``ql3_admin``. A lost COMMIT response is resolved by
``install.admit_plan(..., reconnect=...)`` (``workflow_admission_inspect``) or by re-sending the
*same* plan (an exact replay), never by building a new plan. Every acknowledged admission goes to
its receipt journal (``$QLPG_RECEIPT_LOG`` format, see ``qlpg.ha``) with the plan, so that the gate
can replay it.

``probe`` (a process) inserts one row per ``--interval`` into ``ha_probe.probe`` as the superuser
through the same multi-host DSN and journals each acknowledged id with its time: the gate takes the
largest gap between acknowledgements around an event as that event's database unavailability and
checks that no acknowledged row is missing afterwards. It reconnects every 0.1 s (no backoff) so
that it measures the server, not a client's backoff.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import psycopg

from qlpg import api, db, errors, ha, install

PACKAGE = "hagate"
WORKFLOW_WEIGHTS = {"fanout": 35, "chain": 35, "failing": 15, "timeout": 15}
EXPECTED_STATUS = {"fanout": "succeeded", "chain": "succeeded", "failing": "failed", "timeout": "timed_out"}

MANIFEST = """\
# Written by scripts/ha/workload.py: the HA gate's workload package.
package: hagate
version: 1.0.0
publisher: qlpg-ha-gate
description: HA gate workload (fan-out, chains, a failing step, a timing-out step)
tasks:
  quick:
    command: ["bash", "-c", "sleep 0.2; echo \\"$QLPG_STEP_KEY ok\\""]
    timeout_ms: 60000
  work:
    command: ["bash", "-c", "sleep 0.6; echo \\"$QLPG_STEP_KEY done\\""]
    timeout_ms: 60000
  bad:
    command: ["bash", "-c", "echo 'bad: simulated failure' >&2; exit 3"]
    timeout_ms: 60000
  slow:
    command: ["bash", "-c", "sleep 30"]
    timeout_ms: 1500
workflows:
  fanout:
    steps:
      root: {task: quick}
      w1: {task: work, needs: [root]}
      w2: {task: work, needs: [root]}
      w3: {task: work, needs: [root]}
      w4: {task: work, needs: [root]}
      w5: {task: work, needs: [root]}
      w6: {task: work, needs: [root]}
      join: {task: quick, needs: [w1, w2, w3, w4, w5, w6]}
  chain:
    steps:
      c1: {task: quick}
      c2: {task: quick, needs: [c1]}
      c3: {task: work, needs: [c2]}
      c4: {task: quick, needs: [c3]}
      c5: {task: quick, needs: [c4]}
  failing:
    steps:
      prep: {task: quick}
      bad: {task: bad, needs: [prep]}
      after1: {task: quick, needs: [bad]}
      after2: {task: quick, needs: [after1]}
      side: {task: work, needs: [prep]}
  timeout:
    steps:
      prep: {task: quick}
      slow: {task: slow, needs: [prep]}
      after: {task: quick, needs: [slow]}
"""


def write_package(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "qinglong-package.yaml").write_text(MANIFEST)
    return directory


# ----------------------------------------------------------------------------- helpers
def connect_retry(conninfo: str, stop_at: float | None = None, delay: float = 0.1, max_delay: float = 1.0,
                  app: str = "qlpg-ha-gate") -> psycopg.Connection:
    """Connect through the multi-host DSN, retrying until a read-write primary answers."""
    while True:
        try:
            return db.connect(conninfo, application_name=app)
        except errors.ConnectError:
            if stop_at is not None and time.time() > stop_at:
                raise
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, max_delay)


class Client:
    """One connection that reconnects on loss; ``call(fn, ...)`` retries read-only/idempotent calls."""

    def __init__(self, conninfo: str, app: str):
        self.conninfo, self.app = conninfo, app
        self.conn: psycopg.Connection | None = None

    def get(self) -> psycopg.Connection:
        if self.conn is None or self.conn.closed:
            self.conn = connect_retry(self.conninfo, app=self.app)
        return self.conn

    def reset(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # noqa: BLE001
                pass
        self.conn = None

    def reconnect(self) -> psycopg.Connection:
        self.reset()
        return self.get()

    def call(self, fn, *args, tries: int = 200, **kw):
        for i in range(tries):
            try:
                return fn(self.get(), *args, **kw)
            except (psycopg.OperationalError, errors.ConnectError):
                self.reset()
                if i == tries - 1:
                    raise
                time.sleep(0.1)


# ----------------------------------------------------------------------------- starter
def admit(pe: Client, plan: dict, digest: str) -> tuple[api.AdmissionReceipt, str]:
    """Admit ``plan``; returns ``(receipt, resolution)`` with resolution ``direct`` (COMMIT
    acknowledged), ``committed`` (ambiguous; the durable receipt was found) or ``not_committed``
    (ambiguous; nothing had committed and the same plan was admitted again)."""
    ambiguous = [False]

    def reconnect():
        ambiguous[0] = True
        return pe.reconnect()

    for _ in range(1000):
        try:
            rec = install.admit_plan(pe.get(), plan, digest, reconnect=reconnect)
            break
        except psycopg.OperationalError:
            ambiguous[0] = True          # lost again (or during the inspect): same plan, exact replay
            pe.reset()
            time.sleep(0.1)
        except errors.ConnectError:
            pe.reset()
            time.sleep(0.1)
    else:  # pragma: no cover
        raise RuntimeError("admission never resolved")
    if not ambiguous[0]:
        return rec, "direct"
    return rec, "committed" if rec.replayed else "not_committed"


def starter_main(a: argparse.Namespace) -> int:
    os.environ[ha.RECEIPT_LOG_ENV] = a.journal
    rng = random.Random(a.seed)
    pe = Client(a.dsn_executor, "ha-starter")
    adm = Client(a.dsn_admin, "ha-starter-admin")
    names, weights = zip(*WORKFLOW_WEIGHTS.items())
    inflight: dict[str, str] = {}
    cancels: list[tuple[float, str]] = []
    started = 0
    last_check = 0.0
    while True:
        if Path(a.stop_file).exists() and started >= a.min_workflows:
            break
        now = time.time()
        for due, run_id in [c for c in cancels if c[0] <= now]:
            cancels.remove((due, run_id))
            try:
                r = adm.call(api.run_cancel_request, run_id, "user", "ha-gate")
                ha.record("cancel", client="starter", run_id=run_id, outcome=r["outcome"])
            except errors.QlpgError as exc:
                ha.record("cancel", client="starter", run_id=run_id, outcome=f"error: {exc}")
        if now - last_check > 1.0 or len(inflight) >= a.max_inflight:
            last_check = now
            for run_id in list(inflight):
                try:
                    st = adm.call(api.run_inspect, run_id)["run"]["status"]
                except errors.QlpgError:
                    continue
                if st != "running":
                    inflight.pop(run_id)
        if len(inflight) >= a.max_inflight:
            time.sleep(0.3)
            continue
        wf = rng.choices(names, weights)[0]
        plan, digest = pe.call(install.prepare_plan, "default", PACKAGE, wf)
        rec, resolution = admit(pe, plan, digest)
        ha.record("plan_admission", client="starter", workflow=wf, run_id=rec.run_id, plan_digest=rec.plan_digest,
                  receipt_digest=rec.receipt_digest, replayed=rec.replayed, resolution=resolution, plan=plan)
        if resolution != "direct":
            ha.record("ambiguous", client="starter", call="workflow_plan_admit", key=rec.run_id, resolution=resolution)
        started += 1
        inflight[rec.run_id] = wf
        if rng.random() < a.cancel_fraction:
            cancels.append((time.time() + rng.uniform(0.3, 3.0), rec.run_id))
        time.sleep(a.interval)
    # Requested cancels still due are sent before leaving, so that every Run converges.
    for _, run_id in cancels:
        try:
            adm.call(api.run_cancel_request, run_id, "user", "ha-gate")
        except errors.QlpgError:
            pass
    print(json.dumps({"started": started}), flush=True)
    return 0


# ----------------------------------------------------------------------------- probe
PROBE_DDL = "CREATE TABLE IF NOT EXISTS probe (id bigint PRIMARY KEY, sent double precision NOT NULL)"


def probe_main(a: argparse.Namespace) -> int:
    out = open(a.journal, "a", buffering=1)
    conn = None
    i = a.start_id
    while not Path(a.stop_file).exists():
        i += 1
        sent = time.time()
        try:
            if conn is None or conn.closed:
                conn = psycopg.connect(a.dsn, autocommit=True)
            with conn.transaction():
                conn.execute("INSERT INTO probe (id, sent) VALUES (%s, %s)", (i, sent))
            out.write(json.dumps({"kind": "probe", "id": i, "sent": sent, "t": time.time()}) + "\n")
        except psycopg.OperationalError as exc:
            # The connection broke: the INSERT may or may not have committed (ambiguous).
            out.write(json.dumps({"kind": "probe_error", "id": i, "sent": sent, "t": time.time(),
                                  "connected": conn is not None and not conn.closed,
                                  "error": str(exc).strip().splitlines()[0][:200]}) + "\n")
            try:
                if conn is not None:
                    conn.close()
            except Exception:  # noqa: BLE001
                pass
            conn = None
            time.sleep(0.1)
            continue
        time.sleep(a.interval)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="workload.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("starter")
    s.add_argument("--dsn-executor", required=True)
    s.add_argument("--dsn-admin", required=True)
    s.add_argument("--journal", required=True)
    s.add_argument("--stop-file", required=True)
    s.add_argument("--min-workflows", type=int, default=50)
    s.add_argument("--max-inflight", type=int, default=10)
    s.add_argument("--interval", type=float, default=0.2)
    s.add_argument("--cancel-fraction", type=float, default=0.05)
    s.add_argument("--seed", type=int, default=None)
    s.set_defaults(fn=starter_main)
    s = sub.add_parser("probe")
    s.add_argument("--dsn", required=True)
    s.add_argument("--journal", required=True)
    s.add_argument("--stop-file", required=True)
    s.add_argument("--interval", type=float, default=0.05)
    s.add_argument("--start-id", type=int, default=0)
    s.set_defaults(fn=probe_main)
    a = p.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
