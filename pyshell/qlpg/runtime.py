"""`qlpg runtime`: the control loop of ``ql3_runtime`` (ADR-0227 §3, §5-6; ADR-0228).

One pass (:meth:`Runtime.run_once`) pages ready epochs with the keyset cursor of
``task_attempt_candidates`` (≤ 64 per page), snapshots each one's generation-bound execution
revision and admits it with ``task_attempt_admit``; then converges whole-run cancellations and
claims/resolves expired-lease recovery controls, each in bounded pages. No timers, LISTEN or
database background workers: the caller drives passes. An ambiguous admission COMMIT is answered
by ``task_attempt_inspect``.

Admission scales out over several runtime processes with ``partition=(k, n)`` (CLI ``--partition
k/n``): each admits only the candidates whose Run id falls in its share (CRC-32 of the id, mod n),
so n loops page the same candidates but never admit the same epoch twice. All loops must use the
same n, and every k in 0..n-1 needs a running loop, or the Runs of a missing share wait. Without
partitions several loops are still safe (the ledger answers a second admission of an epoch with
the first one's receipt) but spend calls on those replays.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field

import psycopg

from . import api, db, errors, ha

log = logging.getLogger("qlpg.runtime")


@dataclass
class PassStats:
    """Counts of one control-loop pass."""

    admitted: int = 0
    replayed: int = 0
    skipped: int = 0
    failed: int = 0              # refused with QL501/QL002/QL201/QL001: logged and passed over
    cancels_converged: int = 0
    recovered: int = 0
    recovery_retry: int = 0      # past the start barrier without trusted evidence: backoff
    recovery_manual: int = 0     # retries exhausted: needs `qlpg recover --attempt ID --evidence ...`
    recovery_no_action: int = 0  # the attempt ended or its holder heartbeated in time
    recovery_stale: int = 0      # our claim expired and another loop re-claimed it (QL202)

    def busy(self) -> bool:
        return bool(self.admitted or self.cancels_converged or self.recovered or self.recovery_retry
                    or self.recovery_manual or self.recovery_no_action)


@dataclass
class Runtime:
    """A control loop bound to a ``ql3_runtime`` login (``conninfo``)."""

    conninfo: str
    page_size: int = 64
    recovery: bool = True
    claimer_id: str = field(default_factory=lambda: "rt-" + uuid.uuid4().hex[:12])
    claim_ms: int = 30000       # how long a recovery claim fences other loops out
    max_pages: int = 16         # bound on cancel-convergence and recovery pages per pass
    batch: bool = False         # admit whole candidate pages with task_attempt_admit_page
    partition: tuple[int, int] | None = None  # (k, n): admit only Runs with crc32(run_id) % n == k
    stop_event: threading.Event = field(default_factory=threading.Event)
    _conn: psycopg.Connection | None = None
    _revisions: dict = field(default_factory=dict)  # task_key -> last admitted execution revision

    def __post_init__(self) -> None:
        if self.partition is not None:
            k, n = self.partition
            if not (isinstance(k, int) and isinstance(n, int) and n >= 1 and 0 <= k < n):
                raise ValueError(f"partition must be (k, n) with 0 <= k < n, got {self.partition!r}")
            if self.batch:
                raise ValueError("partition applies to per-candidate admission; batch admits whole pages in SQL")
            log.info("runtime %s admits partition %d/%d (every loop must use the same N)", self.claimer_id, k, n)

    def owns(self, run_id: str) -> bool:
        """True when this loop's partition includes ``run_id`` (always, without partitions)."""
        if self.partition is None:
            return True
        k, n = self.partition
        return zlib.crc32(run_id.encode("utf-8")) % n == k

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = db.connect(self.conninfo, application_name="qlpg-runtime")
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _call(self, fn, *args, **kw):
        delay = 0.2
        ambiguous = False  # the connection broke after the request was sent: resolved by the replay
        for _ in range(60):
            try:
                out = fn(self._connection(), *args, **kw)
                if ambiguous:
                    ha.record_ambiguous("runtime", fn.__name__, args[:1], out)
                return out
            except (psycopg.OperationalError, errors.ConnectError) as exc:
                ambiguous = ambiguous or ha.is_ambiguous(exc)
                self.close()
                if self.stop_event.is_set():
                    raise
                log.warning("runtime: database unavailable (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, 2.0)
        raise errors.ConnectError("runtime: database unavailable for too long")

    def admit_page(self, after: tuple[str, str] | None, stats: PassStats) -> tuple[str, str] | None:
        """Admit one candidate page; return the keyset cursor for the next page (None at the end).

        With ``batch`` the whole page is admitted by one ``task_attempt_admit_page`` transaction
        (the execution revision derived in SQL); a page that SQL refuses as a whole (a quarantined
        package, an integrity failure) is then admitted one candidate at a time, so one bad Run
        cannot hold up the others. Otherwise each candidate gets ``task_attempt_admit`` with the
        execution revision of ``task_attempt_snapshot`` (the last one of the same task key is tried
        first; SQL compares it with the generation-bound one and a mismatch is retried with a fresh
        snapshot).
        """
        if self.batch:
            try:
                rows = self._call(api.task_attempt_admit_page, after, self.page_size)
            except errors.QlpgError as exc:
                log.info("page after %s refused as a whole (%s): admitting one by one", after, exc)
            else:
                for r in rows:
                    if r["outcome"].startswith("skipped"):
                        stats.skipped += 1
                        continue
                    stats.admitted += r["outcome"] == "admitted"
                    stats.replayed += r["outcome"] == "replayed"
                    ha.record_attempt_admission(dict(r, step_run_digest=r["receipt"]["step_run_digest"]), None, api.AttemptReceipt(
                        r["attempt_id"], r["attempt"], r["event_id"], r["receipt"], r["receipt_digest"],
                        r["outcome"] == "replayed"), "page")
                if len(rows) < self.page_size:
                    return None
                return (rows[-1]["run_id"], rows[-1]["step_run_id"])
        page = self._call(api.task_attempt_candidates, after, self.page_size)
        for c in page:
            if not self.owns(c["run_id"]):
                continue
            key = (c["run_id"], c["step_run_id"], c["step_run_version"])
            try:
                # The execution revision a candidate needs is generation-bound and immutable, so the
                # last one admitted for this task key is tried first (SQL re-derives and compares it:
                # a Run of another package or generation answers QL202 and gets its own snapshot).
                claim, cached = self._revisions.get(c["task_key"]), True
                if claim is None:
                    claim, cached = self._call(api.task_attempt_snapshot, *key)["execution_revision"], False
                how = "direct"
                try:
                    try:
                        rec = api.task_attempt_admit(self._connection(), *key, c["step_run_digest"], claim)
                    except errors.StaleFence:
                        if not cached:
                            raise
                        claim = self._call(api.task_attempt_snapshot, *key)["execution_revision"]
                        rec = api.task_attempt_admit(self._connection(), *key, c["step_run_digest"], claim)
                except psycopg.OperationalError:  # ambiguous COMMIT: inspect, never new ids
                    self.close()
                    try:
                        rec, how = self._call(api.task_attempt_inspect, *key), "inspect"
                    except errors.Unavailable:
                        rec, how = self._call(api.task_attempt_admit, *key, c["step_run_digest"], claim), "readmit"
                    ha.record("ambiguous", client="runtime", call="task_attempt_admit", key=rec.attempt_id,
                              resolution="committed" if how == "inspect" else "not_committed")
                if len(self._revisions) >= 1024:
                    self._revisions.clear()
                self._revisions[c["task_key"]] = claim
                ha.record_attempt_admission(c, claim, rec, how)
                if rec.replayed:
                    stats.replayed += 1
                else:
                    stats.admitted += 1
            except (errors.StaleFence, errors.IllegalTransition, errors.StartGuardDenied, errors.Unavailable) as exc:
                stats.skipped += 1
                log.info("candidate %s skipped: %s", key, exc)
            except (errors.IntegrityFailure, errors.LimitExceeded, errors.ImmutableConflict, errors.InvalidInput) as exc:
                # One Run that cannot be admitted (a record that fails verification, the 8192-attempt
                # bound, a conflicting ledger entry) must not hold up the Runs paged after it, nor
                # this pass's cancel convergence and recovery: log it for the operator and go on.
                stats.failed += 1
                log.error("candidate %s refused (%s): %s", key, exc.sqlstate, exc)
        if len(page) < self.page_size:
            return None
        last = page[-1]
        return (last["run_id"], last["step_run_id"])

    def converge_cancels(self, stats: PassStats) -> None:
        """Converge every Run with a pending cancel request (ADR-0228), in bounded keyset pages.

        Each Run gets at most ``max_pages`` converge calls of ``page_size`` changes per pass; a Run
        whose in-flight attempts are still running is revisited next pass (its workers end them).
        """
        after = None
        for _ in range(self.max_pages):
            page = self._call(api.cancel_pending_runs, after, self.page_size)
            for r in page:
                for _ in range(self.max_pages):
                    try:
                        res = self._call(api.run_cancel_converge, r["run_id"], self.page_size)
                    except errors.QlpgError as exc:
                        log.warning("cancel convergence of %s: %s", r["run_id"], exc)
                        break
                    if res.get("changed", 0):
                        stats.cancels_converged += 1
                    if res.get("changed", 0) < self.page_size:
                        break
            if len(page) < self.page_size:
                return
            after = page[-1]["run_id"]

    def recover(self, stats: PassStats) -> None:
        """Claim expired-lease recovery controls and resolve them with the evidence rules (ADR-0227 §6).

        At most ``max_pages`` claims of ``page_size`` per pass. A claim that expired and was taken
        over by another loop answers QL202 on resolve: that loop owns it now, so it is skipped.
        """
        for _ in range(self.max_pages):
            claims = self._call(api.recovery_claim, self.claimer_id, self.page_size, self.claim_ms)
            for c in claims:
                try:
                    res = self._call(api.recovery_resolve, c["attempt_id"], c["claim_token"])
                except errors.StaleFence as exc:
                    stats.recovery_stale += 1
                    log.info("recovery of %s: %s", c["attempt_id"], exc)
                    continue
                except errors.QlpgError as exc:
                    log.warning("recovery of %s: %s", c["attempt_id"], exc)
                    continue
                resolution = res.get("resolution")
                if resolution in ("lost_before_start", "lost_after_start"):
                    stats.recovered += 1
                elif resolution == "awaiting_evidence":
                    stats.recovery_retry += 1
                elif resolution == "needs_operator":
                    stats.recovery_manual += 1
                    log.warning("attempt %s (run %s) needs an operator: lease expired after the start "
                                "barrier and no trusted evidence arrived; see `qlpg recover --attempt %s "
                                "--evidence not_running`", c["attempt_id"], c["run_id"], c["attempt_id"])
                else:
                    stats.recovery_no_action += 1
            if len(claims) < self.page_size:
                return

    def run_once(self) -> PassStats:
        """One bounded pass: admissions, cancel convergence, recovery."""
        stats = PassStats()
        after = None
        while True:
            after = self.admit_page(after, stats)
            if after is None:
                break
        self.converge_cancels(stats)
        if self.recovery:
            self.recover(stats)
        return stats

    def run_forever(self, idle_sleep_s: float = 0.2, until=None) -> None:
        """Drive passes until ``stop_event`` or ``until()``; sleeps only when a pass did nothing."""
        while not self.stop_event.is_set() and not (until and until()):
            try:
                stats = self.run_once()
            except errors.QlpgError as exc:
                log.error("runtime pass failed: %s", exc)
                stats = PassStats()
            if not stats.busy():
                self.stop_event.wait(idle_sleep_s)
