"""`qlpg runtime`: the control loop of ``ql3_runtime`` (ADR-0227 §3, §5-6; ADR-0228).

One pass (:meth:`Runtime.run_once`) pages ready epochs with the keyset cursor of
``task_attempt_candidates`` (≤ 64 per page), snapshots each one's generation-bound execution
revision and admits it with ``task_attempt_admit``; then converges whole-run cancellations and
claims/resolves expired-lease recovery controls, each in bounded pages. No timers, LISTEN or
database background workers: the caller drives passes. An ambiguous admission COMMIT is answered
by ``task_attempt_inspect``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import psycopg

from . import api, db, errors

log = logging.getLogger("qlpg.runtime")


@dataclass
class PassStats:
    """Counts of one control-loop pass."""

    admitted: int = 0
    replayed: int = 0
    skipped: int = 0
    cancels_converged: int = 0
    recovered: int = 0

    def busy(self) -> bool:
        return bool(self.admitted or self.cancels_converged or self.recovered)


@dataclass
class Runtime:
    """A control loop bound to a ``ql3_runtime`` login (``conninfo``)."""

    conninfo: str
    page_size: int = 64
    recovery: bool = True
    claimer_id: str = field(default_factory=lambda: "rt-" + uuid.uuid4().hex[:12])
    stop_event: threading.Event = field(default_factory=threading.Event)
    _conn: psycopg.Connection | None = None

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
        for _ in range(60):
            try:
                return fn(self._connection(), *args, **kw)
            except (psycopg.OperationalError, errors.ConnectError) as exc:
                self.close()
                if self.stop_event.is_set():
                    raise
                log.warning("runtime: database unavailable (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, 5.0)
        raise errors.ConnectError("runtime: database unavailable for too long")

    def admit_page(self, after: tuple[str, str] | None, stats: PassStats) -> tuple[str, str] | None:
        """Admit one candidate page; return the keyset cursor for the next page (None at the end)."""
        page = self._call(api.task_attempt_candidates, after, self.page_size)
        for c in page:
            key = (c["run_id"], c["step_run_id"], c["step_run_version"])
            try:
                snap = self._call(api.task_attempt_snapshot, *key)
                try:
                    rec = api.task_attempt_admit(self._connection(), *key, c["step_run_digest"],
                                                 snap["execution_revision"])
                except psycopg.OperationalError:
                    self.close()
                    try:
                        rec = self._call(api.task_attempt_inspect, *key)
                    except errors.Unavailable:
                        rec = self._call(api.task_attempt_admit, *key, c["step_run_digest"],
                                         snap["execution_revision"])
                if rec.replayed:
                    stats.replayed += 1
                else:
                    stats.admitted += 1
            except (errors.StaleFence, errors.IllegalTransition, errors.StartGuardDenied, errors.Unavailable) as exc:
                stats.skipped += 1
                log.info("candidate %s skipped: %s", key, exc)
        if len(page) < self.page_size:
            return None
        last = page[-1]
        return (last["run_id"], last["step_run_id"])

    def converge_cancels(self, stats: PassStats) -> None:
        """Converge every Run with a pending cancel request, in bounded pages."""
        after = None
        while True:
            page = self._call(api.cancel_pending_runs, after, self.page_size)
            for r in page:
                res = self._call(api.run_cancel_converge, r["run_id"], self.page_size)
                stats.cancels_converged += 1 if res.get("changed", 0) else 0
            if len(page) < self.page_size:
                return
            after = page[-1]["run_id"]

    def recover(self, stats: PassStats) -> None:
        """Claim expired-lease recovery controls and resolve them with the evidence rules."""
        claims = self._call(api.recovery_claim, self.claimer_id, self.page_size, 30000)
        for c in claims:
            try:
                res = self._call(api.recovery_resolve, c["attempt_id"], c["claim_token"])
                if res.get("resolution") in ("lost_before_start", "lost_after_start"):
                    stats.recovered += 1
            except errors.QlpgError as exc:
                log.info("recovery of %s: %s", c["attempt_id"], exc)

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
