"""Run one Task Attempt's real subprocess.

:func:`run_process` starts ``argv`` directly (no shell) in a new session (so
the child leads its own process group), copies stdout/stderr into
``log_dir/stdout.log`` and ``log_dir/stderr.log`` through reader threads with
a per-stream byte cap, and polls until the process exits, its deadline
passes, or ``should_stop()`` asks it to stop.  Stopping signals the whole
process group: SIGTERM, then SIGKILL after :data:`KILL_GRACE_S` seconds.

It never raises for problems of the child itself: a failure to start
(missing binary, not executable, bad working directory) is returned as
``ProcessResult.start_error`` with ``exit_code`` and ``signal`` both ``None``.

When the child (the process-group leader) has exited, any remaining member of
its process group is killed with SIGKILL: an attempt's processes never outlive
the attempt.
"""

from __future__ import annotations

import os
import signal as _signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable, Mapping, Sequence

__all__ = ["ProcessResult", "run_process", "KILL_GRACE_S"]

#: Seconds between SIGTERM and SIGKILL when stopping a process group.
KILL_GRACE_S = 2.0
_CHUNK = 65536


@dataclass(frozen=True)
class ProcessResult:
    """Outcome of :func:`run_process`.

    - ``exit_code``: the child's exit status, or ``None`` if it was killed by
      a signal or never started.
    - ``signal``: the signal number that ended the child, or ``None``.
    - ``stop_reason``: ``None`` if the child ended by itself; otherwise why
      we stopped it (``'timeout'`` or the string ``should_stop()`` returned,
      e.g. ``'cancel'``, ``'shutdown'``, ``'lease_lost'``).  A child that
      exits on SIGTERM by itself still carries the stop reason.
    - ``duration_ms``: wall-clock from spawn to reap (0 if not started).
    - ``stdout_path`` / ``stderr_path``: absolute log file paths (created
      even when the start fails, so they always exist).
    - ``output_truncated``: at least one stream exceeded ``max_output_bytes``.
    - ``start_error``: human-readable reason the process could not start.
    - ``pid``: the child's pid (``None`` if not started).
    """

    exit_code: int | None
    signal: int | None
    stop_reason: str | None
    duration_ms: int
    stdout_path: str
    stderr_path: str
    output_truncated: bool
    start_error: str | None = None
    pid: int | None = None

    @property
    def succeeded(self) -> bool:
        """True iff the process started, was not stopped and exited 0."""
        return self.start_error is None and self.stop_reason is None and self.exit_code == 0


class _Copier(threading.Thread):
    """Copy a pipe into a file, writing at most ``limit`` bytes; drain the rest."""

    def __init__(self, src: BinaryIO, dst: BinaryIO, limit: int, name: str):
        super().__init__(name=name, daemon=True)
        self.src, self.dst, self.limit = src, dst, limit
        self.written = 0
        self.truncated = False

    def run(self) -> None:
        try:
            while True:
                chunk = self.src.read1(_CHUNK) if hasattr(self.src, "read1") else self.src.read(_CHUNK)
                if not chunk:
                    break
                room = self.limit - self.written
                if room > 0:
                    part = chunk[:room]
                    self.dst.write(part)
                    self.written += len(part)
                if len(chunk) > max(room, 0):
                    self.truncated = True
        except (OSError, ValueError):
            pass
        finally:
            try:
                self.dst.flush()
            except (OSError, ValueError):
                pass


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_process(
    argv: Sequence[str],
    *,
    cwd: str | None,
    env: Mapping[str, str],
    log_dir: str,
    max_output_bytes: int,
    deadline_monotonic: float | None = None,
    should_stop: Callable[[], str | None] | None = None,
    poll_interval_s: float = 0.2,
    on_started: Callable[[int], None] | None = None,
) -> ProcessResult:
    """Run ``argv`` to completion (or until stopped) and return a ProcessResult.

    Parameters:
      argv: program and arguments; ``argv[0]`` is looked up on ``env['PATH']``.
      cwd: working directory (must exist) or ``None`` for the current one.
      env: the child's complete environment (nothing else is inherited).
      log_dir: directory for ``stdout.log``/``stderr.log`` (created if missing).
      max_output_bytes: cap on bytes kept *per stream*; excess is drained and
        discarded and ``output_truncated`` is set.
      deadline_monotonic: ``time.monotonic()`` value after which the process
        group is killed with stop_reason ``'timeout'``.
      should_stop: polled every ``poll_interval_s``; a non-empty string return
        kills the process group with that stop_reason.  Exceptions it raises
        propagate only after the child has been killed and reaped.
      on_started: called with the child's pid right after spawn (e.g. to
        report "running"); an exception from it kills the child and propagates.
    """
    if not argv:
        raise ValueError("argv must be non-empty")
    if max_output_bytes < 0:
        raise ValueError("max_output_bytes must be >= 0")
    os.makedirs(log_dir, exist_ok=True)
    stdout_path = os.path.abspath(os.path.join(log_dir, "stdout.log"))
    stderr_path = os.path.abspath(os.path.join(log_dir, "stderr.log"))
    out_f = open(stdout_path, "wb")
    err_f = open(stderr_path, "wb")

    def _result(**kw) -> ProcessResult:
        return ProcessResult(stdout_path=stdout_path, stderr_path=stderr_path, **kw)

    try:
        if cwd is not None and not os.path.isdir(cwd):
            return _result(exit_code=None, signal=None, stop_reason=None, duration_ms=0,
                           output_truncated=False,
                           start_error=f"working directory does not exist: {cwd}")
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                list(argv),
                cwd=cwd,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                shell=False,
            )
        except FileNotFoundError as exc:
            what = exc.filename or argv[0]
            msg = f"executable not found: {argv[0]}" if what == argv[0] else f"not found: {what}"
            return _result(exit_code=None, signal=None, stop_reason=None, duration_ms=0,
                           output_truncated=False, start_error=msg)
        except PermissionError as exc:
            return _result(exit_code=None, signal=None, stop_reason=None, duration_ms=0,
                           output_truncated=False,
                           start_error=f"permission denied: {exc.filename or argv[0]}")
        except (OSError, ValueError) as exc:
            return _result(exit_code=None, signal=None, stop_reason=None, duration_ms=0,
                           output_truncated=False, start_error=f"cannot start {argv[0]}: {exc}")

        pgid = proc.pid  # start_new_session: the child is its own group leader
        copiers = [
            _Copier(proc.stdout, out_f, max_output_bytes, f"qlpg-stdout-{proc.pid}"),
            _Copier(proc.stderr, err_f, max_output_bytes, f"qlpg-stderr-{proc.pid}"),
        ]
        for c in copiers:
            c.start()

        stop_reason: str | None = None
        pending_exc: BaseException | None = None
        term_sent_at: float | None = None
        killed = False
        try:
            if on_started is not None:
                on_started(proc.pid)
            while True:
                rc = proc.poll()
                if rc is not None:
                    break
                now = time.monotonic()
                if stop_reason is None:
                    if deadline_monotonic is not None and now >= deadline_monotonic:
                        stop_reason = "timeout"
                    elif should_stop is not None:
                        reason = should_stop()
                        if reason:
                            stop_reason = str(reason)
                    if stop_reason is not None:
                        _kill_group(pgid, _signal.SIGTERM)
                        term_sent_at = now
                elif not killed and term_sent_at is not None and now - term_sent_at >= KILL_GRACE_S:
                    _kill_group(pgid, _signal.SIGKILL)
                    killed = True
                wait = poll_interval_s
                if deadline_monotonic is not None and stop_reason is None:
                    wait = max(0.0, min(wait, deadline_monotonic - now))
                if term_sent_at is not None and not killed:
                    wait = max(0.0, min(wait, term_sent_at + KILL_GRACE_S - now))
                try:
                    proc.wait(timeout=max(wait, 0.005))
                except subprocess.TimeoutExpired:
                    pass
        except BaseException as exc:  # should_stop/on_started raised, or KeyboardInterrupt
            pending_exc = exc
            stop_reason = stop_reason or "error"
            _kill_group(pgid, _signal.SIGKILL)
            killed = True
            proc.wait()

        # The leader is reaped.  An attempt's processes must not outlive it:
        # kill whatever is left of its process group (background children that
        # would otherwise keep working, or keep the pipes open).  Processes that
        # escaped into their own session are out of reach; the copier threads
        # are daemons and are abandoned after a bounded join.
        _kill_group(pgid, _signal.SIGKILL)
        for c in copiers:
            c.join(timeout=5.0)
        duration_ms = int((time.monotonic() - started) * 1000)
        for p in (proc.stdout, proc.stderr):
            try:
                p.close()
            except OSError:
                pass
        if pending_exc is not None:
            raise pending_exc

        rc = proc.returncode
        return _result(
            exit_code=rc if rc >= 0 else None,
            signal=-rc if rc < 0 else None,
            stop_reason=stop_reason,
            duration_ms=duration_ms,
            output_truncated=any(c.truncated for c in copiers),
            start_error=None,
            pid=proc.pid,
        )
    finally:
        out_f.close()
        err_f.close()
