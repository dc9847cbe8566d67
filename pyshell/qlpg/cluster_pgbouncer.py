"""A throwaway PgBouncer in ``pool_mode = transaction`` in front of a PostgreSQL server.

:class:`TempPgBouncer` writes a private ``pgbouncer.ini`` into a fresh temporary directory, starts
PgBouncer (Debian package ``pgbouncer``) on a free TCP port of 127.0.0.1 and stops it and removes
the directory afterwards. It never touches the server's configuration nor any other PgBouncer
(the Debian service on :6432 included).

Authentication: ``auth_type = trust`` with ``auth_user`` = the server superuser (listed in the
private ``auth_file``): any login that exists on the server is looked up through PgBouncer's
default ``auth_query`` (``pg_shadow``), so logins created while PgBouncer runs (test logins,
``qlpg run``'s throwaway logins) can connect without being listed anywhere. PgBouncer then logs in
to the server under the same name, so ``session_user`` is the client's login (qlpg's role checks
rely on that). This is a test setup for a server that trusts local connections; production
PgBouncer uses ``scram-sha-256`` (see docs/operations.md).

Who runs it: PgBouncer refuses to run as root, so when ``os.geteuid() == 0`` it runs as the
``postgres`` OS user (like :class:`qlpg.cluster.TempCluster`). Clean-up: :meth:`stop`
(SIGTERM = immediate shutdown, then SIGKILL), ``atexit`` and a watchdog process that stops it when
the starting process dies (SIGKILL included).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from .cluster import ClusterError, _free_port, _pid_alive, _server_ids, close_watchdog

__all__ = ["TempPgBouncer", "find_pgbouncer", "INSTALL_HINT"]

INSTALL_HINT = "install it with: apt-get update && apt-get install -y pgbouncer"
START_TIMEOUT_S = 20
PORT_ATTEMPTS = 5

_LIVE: dict[int, "TempPgBouncer"] = {}
_LIVE_LOCK = threading.Lock()
_ATEXIT = False


def find_pgbouncer() -> str:
    """Path of the ``pgbouncer`` binary (PATH, then /usr/sbin); raise :class:`ClusterError` if absent."""
    exe = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/local/sbin")
    if exe is None:
        raise ClusterError("pgbouncer not found (PATH, /usr/sbin); " + INSTALL_HINT)
    return exe


def _stop_all() -> None:
    with _LIVE_LOCK:
        live = [b for b in _LIVE.values() if b._owner_pid == os.getpid()]
    for b in live:
        b.stop()


_WATCHDOG_SRC = r"""
import json, os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGHUP, signal.SIG_IGN)
spec = json.loads(sys.argv[1])
try:
    while sys.stdin.buffer.read(4096):
        pass
except OSError:
    pass
pid = spec["pid"]
for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        break
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
shutil.rmtree(spec["base"], ignore_errors=True)
"""


class TempPgBouncer:
    """A private PgBouncer (``pool_mode = transaction`` by default); a context manager.

    Parameters
    ----------
    server_host, server_port:
        the PostgreSQL server PgBouncer forwards to (socket directory or host name; port).
        Every database name is forwarded (``* = host=... port=...``).
    port:
        TCP port on 127.0.0.1 to listen on; default a free port.
    pool_mode:
        ``transaction`` (default), ``session`` or ``statement``.
    pool_size, max_db_connections:
        server connections per (database, user) pair and per database. Kept small: the server
        (``max_connections``) is shared with other test runs.
    admin_user:
        the server superuser PgBouncer uses for ``auth_query`` (it must connect without a password).
    settings:
        extra ``[pgbouncer]`` settings, ``{"name": value}``, written after the defaults.

    Attributes after :meth:`start`: ``host`` (``"127.0.0.1"``), ``port``, ``base`` (temp dir holding
    ``pgbouncer.ini``, ``userlist.txt``, ``pgbouncer.log``), ``logfile``, ``pid``, ``version``.
    Raises :class:`qlpg.cluster.ClusterError` when the binary is missing or PgBouncer does not come up
    (the message quotes the log tail).
    """

    def __init__(
        self,
        server_host: str,
        server_port: int,
        *,
        port: int | None = None,
        pool_mode: str = "transaction",
        pool_size: int = 12,
        max_db_connections: int = 40,
        admin_user: str = "postgres",
        settings: Mapping[str, Any] | None = None,
        binary: str | None = None,
    ) -> None:
        self.server_host = str(server_host)
        self.server_port = int(server_port)
        self.requested_port = port
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.max_db_connections = max_db_connections
        self.admin_user = admin_user
        self.settings = dict(settings or {})
        self.binary = binary or find_pgbouncer()
        self.host = "127.0.0.1"
        self.port: int | None = None
        self.base: str | None = None
        self.logfile: str | None = None
        self.pid: int | None = None
        self.version: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ids = _server_ids()
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._watch_fd: int | None = None
        self._owner_pid = os.getpid()
        self._stopped = False
        self._lock = threading.Lock()

    # -- connection helpers ---------------------------------------------------------------------

    def dsn(self, dbname: str = "postgres", user: str | None = None) -> str:
        """libpq ``key=value`` conninfo reaching ``dbname`` through this PgBouncer."""
        return f"host={self.host} port={self.port} dbname={dbname} user={user or self.admin_user}"

    def env(self) -> dict[str, str]:
        """Variables for a child process: where the pooler is and that qlpg must behave for it.

        ``QLPG_TEST_CLIENT_HOST``/``_PORT`` route the test suite's service connections through
        PgBouncer (tests/conftest.py) while ``PGHOST``/``PGPORT`` stay on the server for database
        creation; ``QLPG_POOLER=transaction`` makes every qlpg connection skip prepared statements.
        """
        return {
            "QLPG_PGBOUNCER_HOST": self.host,
            "QLPG_PGBOUNCER_PORT": str(self.port),
            "QLPG_TEST_CLIENT_HOST": self.host,
            "QLPG_TEST_CLIENT_PORT": str(self.port),
            "QLPG_POOLER": self.pool_mode,
        }

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "TempPgBouncer":
        if self.base is None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _config(self, port: int) -> str:
        assert self.base is not None
        gucs: dict[str, Any] = {
            "listen_addr": self.host,
            "listen_port": port,
            "unix_socket_dir": self.base,
            "auth_type": "trust",
            "auth_file": os.path.join(self.base, "userlist.txt"),
            "auth_user": self.admin_user,
            "pool_mode": self.pool_mode,
            "default_pool_size": self.pool_size,
            "min_pool_size": 0,
            "reserve_pool_size": 0,
            "max_db_connections": self.max_db_connections,
            "max_client_conn": 400,
            # test databases are created and dropped all the time: let idle server connections and
            # the automatic per-database pools go quickly
            "server_idle_timeout": 5,
            "autodb_idle_timeout": 10,
            "server_login_retry": 1,
            "query_wait_timeout": 120,
            "logfile": self.logfile,
            "pidfile": os.path.join(self.base, "pgbouncer.pid"),
            "admin_users": self.admin_user,
            "log_connections": 0,
            "log_disconnections": 0,
        }
        gucs.update(self.settings)
        lines = ["[databases]", f"* = host={self.server_host} port={self.server_port}", "", "[pgbouncer]"]
        lines += [f"{k} = {v}" for k, v in gucs.items()]
        return "\n".join(lines) + "\n"

    def start(self) -> "TempPgBouncer":
        """Write the config and start PgBouncer; returns ``self``. Raises :class:`ClusterError`."""
        if self.base is not None:
            raise ClusterError("TempPgBouncer.start() called twice")
        self.base = tempfile.mkdtemp(prefix="qlpg-pgbouncer-")
        os.chmod(self.base, 0o755)
        self.logfile = os.path.join(self.base, "pgbouncer.log")
        Path(self.base, "userlist.txt").write_text(f'"{self.admin_user}" ""\n')
        if self._ids is not None:
            for p in (self.base, os.path.join(self.base, "userlist.txt")):
                os.chown(p, *self._ids)
        global _ATEXIT
        with _LIVE_LOCK:
            _LIVE[id(self)] = self
            if not _ATEXIT:
                atexit.register(_stop_all)
                _ATEXIT = True
        try:
            self._start_server()
            self.version = self._version()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_server(self) -> None:
        assert self.base is not None
        attempts = 1 if self.requested_port else PORT_ATTEMPTS
        last = ""
        for _ in range(attempts):
            port = self.requested_port or _free_port()
            ini = os.path.join(self.base, "pgbouncer.ini")
            Path(ini).write_text(self._config(port))
            if self._ids is not None:
                os.chown(ini, *self._ids)
            kwargs: dict[str, Any] = {}
            if self._ids is not None:
                kwargs.update(user=self._ids[0], group=self._ids[1], extra_groups=[])
            out = open(os.path.join(self.base, "stderr.log"), "ab")
            try:
                self._proc = subprocess.Popen([self.binary, ini], cwd=self.base, stdin=subprocess.DEVNULL,
                                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                              **kwargs)
            except OSError as exc:
                raise ClusterError(f"pgbouncer: cannot start {self.binary}: {exc}") from exc
            finally:
                out.close()
            self.pid = self._proc.pid
            self._start_watchdog()
            # ready = this process logged that it listens on the port and accepts a connection
            # (a connection alone could reach another process already bound to that port)
            ready = f"[{self.pid}] LOG listening on {self.host}:{port}"
            refused = f"cannot listen on {self.host}:{port}"  # PgBouncer then stays up on its socket only
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline and self._proc.poll() is None:
                log = self._log_tail(200)
                if refused in log:
                    break
                if ready in log:
                    try:
                        with socket.create_connection((self.host, port), timeout=0.5):
                            pass
                    except OSError:
                        pass
                    else:
                        if self._proc.poll() is None:
                            self.port = port
                            return
                time.sleep(0.05)
            last = self._log_tail()
            self._kill()
            if "Address already in use" not in last or self.requested_port:
                break
        raise ClusterError(f"pgbouncer did not start (config {self.base}/pgbouncer.ini):\n{last}")

    def _version(self) -> str:
        proc = subprocess.run([self.binary, "--version"], capture_output=True, text=True)
        first = (proc.stdout or "").splitlines()[:1]
        return first[0].strip() if first else "?"

    def _log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of ``pgbouncer.log``, else of its stderr (errors before the log opens)."""
        for name in ("pgbouncer.log", "stderr.log"):
            try:
                with open(os.path.join(str(self.base), name), errors="replace") as fh:
                    text = "".join(fh.readlines()[-n:])
            except OSError:
                continue
            if text:
                return text
        return "(no log)"

    def _start_watchdog(self) -> None:
        rfd, wfd = os.pipe()
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG_SRC, json.dumps({"pid": self.pid, "base": self.base})],
                stdin=rfd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                cwd="/")
        except OSError:  # pragma: no cover - atexit still applies
            os.close(wfd)
            wfd = None  # type: ignore[assignment]
        finally:
            os.close(rfd)
        self._watch_fd = wfd

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # PgBouncer: SIGTERM = immediate shutdown
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        close_watchdog(self)

    def stop(self) -> None:
        """Stop PgBouncer and remove its directory; idempotent."""
        with self._lock:
            if self._stopped or self.base is None:
                return
            self._stopped = True
        self._kill()
        with _LIVE_LOCK:
            _LIVE.pop(id(self), None)
        shutil.rmtree(self.base, ignore_errors=True)
        if self.pid is not None and _pid_alive(self.pid):
            raise ClusterError(f"pgbouncer (pid {self.pid}) survived stop()")

    def __repr__(self) -> str:
        return f"<TempPgBouncer {self.pool_mode} {self.host}:{self.port} -> {self.server_host}:{self.server_port}>"
