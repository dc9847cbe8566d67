"""`qlpg worker`: the worker loop of ``ql3_worker_ingress`` (ADR-0227 §4-6).

One :class:`Worker` holds one connection and runs one attempt at a time:
``lease_acquire`` → ``attempt_start`` (the start barrier; deadline from database time) →
spawn the pinned revision's argv (no shell) with an allow-listed environment and per-attempt
logs → ``attempt_running`` as soon as the process exists → heartbeats through ``lease_control``
at most every lease/3 → ``attempt_complete`` (exit 0 → succeeded, else failed) or
``attempt_start_failed``. On ``stop_requested`` (cancel or timeout) or at the local deadline the
process group is killed. The worker executes only the execution revision the database pinned
for the attempt, never a mutable definition.

Lost connections are retried with backoff; every worker call is an exact replay in SQL
(start/running/complete return the same answer again), so an ambiguous COMMIT is resolved by
repeating the call with the same token, never by inventing ids. A lost ``lease_acquire``
response leaves leases nobody holds: they expire and recovery turns them into a new epoch.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psycopg

from . import api, db, errors, ha
from .process import run_process
from .taskenv import build_task_env

log = logging.getLogger("qlpg.worker")
POLL_S = 0.1  # how often the process loop checks deadline, heartbeat and stop requests


@dataclass
class AttemptOutcome:
    """What one executed attempt ended with (for progress tables)."""

    attempt_id: str
    run_id: str
    step_key: str
    attempt: int
    outcome: str
    exit_code: int | None
    duration_ms: int
    stdout_path: str
    stderr_path: str
    stop_reason: str | None = None


@dataclass
class Worker:
    """A worker bound to a ``ql3_worker_ingress`` login.

    ``conninfo``: libpq string of the worker login; ``worker_id``: portable id ≤ 128 bytes;
    ``state_dir``: where run scratch dirs (``runs/<run>/``) and attempt logs
    (``runs/<run>/logs/<step>.<attempt>/``) go; ``lease_ms``: lease length (heartbeat every
    lease_ms/3); ``executor_type``: ``local_process`` or ``remote_worker``.
    """

    conninfo: str
    worker_id: str
    state_dir: Path
    lease_ms: int = 30000
    executor_type: str = "local_process"
    combined_start: bool = False
    on_outcome: Callable[[AttemptOutcome], None] | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    _conn: psycopg.Connection | None = None

    # -------------------------------------------------------------- connection
    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = db.connect(self.conninfo, application_name=f"qlpg-worker:{self.worker_id}"[:63])
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _call(self, fn, *args, retry_forever: bool = False, **kw):
        """Call ``fn(conn, ...)``; on a broken connection reconnect with backoff and replay."""
        delay = 0.2
        since = time.monotonic()
        ambiguous = False  # the connection broke after the request was sent: resolved by the replay
        while True:
            try:
                out = fn(self._connection(), *args, **kw)
                if ambiguous:
                    ha.record_ambiguous("worker", fn.__name__, args[:1], out)
                return out
            except (psycopg.OperationalError, errors.ConnectError) as exc:
                ambiguous = ambiguous or ha.is_ambiguous(exc)
                self.close()
                if not retry_forever and time.monotonic() - since > ha.RECONNECT_WINDOW_S:
                    raise
                if self.stop_event.is_set() and not retry_forever:
                    raise
                log.warning("worker %s: database unavailable (%s); retrying in %.1fs", self.worker_id, exc, delay)
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, 2.0)

    # -------------------------------------------------------------- loop
    def run_once(self) -> bool:
        """Lease and execute at most one attempt; return whether one was executed.

        With ``combined_start`` the lease and the start barrier are one transaction
        (``lease_acquire_start``: one commit less per step). Its trade-off: if that COMMIT's answer
        is lost, the attempt is ``starting`` with a token nobody holds, and recovery needs
        not_running evidence (``--reset-session`` on restart) instead of re-opening the epoch by
        itself as it does for a lost ``lease_acquire`` answer.
        """
        if self.stop_event.is_set():
            return False
        fn = api.lease_acquire_start if self.combined_start else api.lease_acquire
        leases = self._call(fn, self.worker_id, self.executor_type, 1, self.lease_ms)
        if not leases:
            return False
        self.execute(leases[0])
        return True

    def run_forever(self, idle_sleep_s: float = 0.2, until: Callable[[], bool] | None = None) -> None:
        """Loop until ``stop_event`` is set (SIGTERM in the CLI) or ``until()`` is true."""
        while not self.stop_event.is_set() and not (until and until()):
            try:
                busy = self.run_once()
            except errors.QlpgError as exc:
                log.error("worker %s: %s", self.worker_id, exc)
                busy = False
            if not busy:
                self.stop_event.wait(idle_sleep_s)

    # -------------------------------------------------------------- one attempt
    def execute(self, lease: api.Lease) -> AttemptOutcome | None:
        """Run one leased attempt to its terminal report."""
        rev = lease.execution_revision
        tmpl = rev["execution_template"]
        run_dir = self.state_dir / "runs" / lease.run_id.replace(":", "_")
        log_dir = run_dir / "logs" / f"{lease.step_key}.{lease.attempt}"
        run_dir.mkdir(parents=True, exist_ok=True)
        if getattr(lease, "status", "claimed") == "starting":  # lease_acquire_start crossed the barrier
            started = {"deadline_at_ms": lease.deadline_at_ms, "started_at_ms": lease.started_at_ms}
        elif self.stop_event.is_set():
            self._call(api.lease_release, lease.attempt_id, lease.lease_token, "shutdown")
            return None
        else:
            started = None
        try:
            if started is None:
                started = self._call(api.attempt_start, lease.attempt_id, lease.lease_token)
        except (errors.IllegalTransition, errors.StaleFence, errors.LeaseInvalid) as exc:
            log.info("attempt %s not started: %s", lease.attempt_id, exc)
            try:
                self._call(api.lease_release, lease.attempt_id, lease.lease_token, "not started")
            except errors.QlpgError:
                pass
            return None
        timeout_s = (started["deadline_at_ms"] - started["started_at_ms"]) / 1000.0
        deadline = time.monotonic() + timeout_s
        env = build_task_env(tmpl.get("env_names") or (), extra={
            "QLPG_RUN_ID": lease.run_id, "QLPG_RUN_DIR": str(run_dir), "QLPG_STEP_KEY": lease.step_key,
            "QLPG_ATTEMPT_ID": lease.attempt_id, "QLPG_ATTEMPT": str(lease.attempt),
        })
        # Heartbeat so that consecutive lease_control calls are at most lease/3 apart: the poll loop
        # of run_process wakes every POLL_S, so a beat is sent once lease/3 - POLL_S has passed.
        heartbeat_every = max(0.05, self.lease_ms / 3000.0 - POLL_S)
        last_beat = [time.monotonic()]

        def should_stop() -> str | None:
            if time.monotonic() - last_beat[0] < heartbeat_every:
                return None
            last_beat[0] = time.monotonic()
            try:
                ctl = self._call(api.lease_control, lease.attempt_id, lease.lease_token, self.lease_ms)
            except errors.LeaseInvalid:
                return "lease_lost"
            if ctl["decision"] == "stop_requested":
                return ctl["reason"] or "stop"
            return None

        def on_started(_pid: int) -> None:
            self._call(api.attempt_running, lease.attempt_id, lease.lease_token)

        policy = tmpl.get("resource_policy") or {}
        result = run_process(
            list(tmpl["command"]), cwd=tmpl.get("working_directory") or str(run_dir), env=env,
            log_dir=str(log_dir), max_output_bytes=int(policy.get("max_output_bytes", 10 * 1024 * 1024)),
            deadline_monotonic=deadline, should_stop=should_stop, on_started=on_started, poll_interval_s=POLL_S,
        )
        detail = {"stdout_path": result.stdout_path, "stderr_path": result.stderr_path,
                  "duration_ms": result.duration_ms, "signal": result.signal,
                  "stop_reason": result.stop_reason, "output_truncated": result.output_truncated}
        try:
            if result.start_error is not None:
                detail["error"] = result.start_error[:2000]
                done = self._call(api.attempt_start_failed, lease.attempt_id, lease.lease_token, detail)
                ha.record_completion(self.worker_id, lease, "start_failed", None, None, done)
            else:
                if result.exit_code == 0 and result.stop_reason is None:
                    reported = "succeeded"
                elif result.stop_reason == "timeout":
                    reported = "timed_out"
                elif result.stop_reason == "cancel":
                    reported = "cancelled"
                else:
                    reported = "failed"
                done = self._call(api.attempt_complete, lease.attempt_id, lease.lease_token, reported,
                                  result.exit_code, detail)
                ha.record_completion(self.worker_id, lease, "complete", reported, result.exit_code, done)
        except errors.LeaseInvalid as exc:
            log.warning("attempt %s: report refused (%s); recovery will resolve it", lease.attempt_id, exc)
            return None
        out = AttemptOutcome(lease.attempt_id, lease.run_id, lease.step_key, lease.attempt, done["outcome"],
                             result.exit_code, result.duration_ms, result.stdout_path, result.stderr_path,
                             result.stop_reason)
        if self.on_outcome:
            self.on_outcome(out)
        return out


def install_sigterm(stop_event: threading.Event) -> None:
    """Graceful shutdown: SIGTERM/SIGINT stop leasing; the attempt in hand finishes or is released."""

    def handler(signum, _frame):
        log.info("signal %s: stopping after the current attempt", signum)
        stop_event.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def default_worker_id() -> str:
    """``<hostname>-<pid>`` trimmed to a portable id."""
    import re
    import socket

    raw = f"{socket.gethostname()}-{os.getpid()}"
    return re.sub(r"[^A-Za-z0-9._:-]", "-", raw)[:100]
