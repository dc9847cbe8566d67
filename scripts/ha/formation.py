"""A pg_auto_failover formation on loopback: one monitor and two Postgres nodes on 127.0.0.1.

Everything lives under one base directory; nothing touches the server on :5432 (facts and
pitfalls: ../shared/ha/NOTES.md):

* run as root, pg_autoctl runs as the ``postgres`` OS user: foreground commands through
  ``runuser -u postgres -- env ...``, the supervisors through ``setpriv`` (which does not fork,
  so the PID we hold is pg_autoctl's own) in a new session;
* ``HOME``/``XDG_CONFIG_HOME``/``XDG_DATA_HOME``/``XDG_RUNTIME_DIR`` point into the base directory
  (pg_autoctl's config, state and pid files) and ``PG_REGRESS_SOCK_DIR`` moves the Unix sockets
  out of /var/run/postgresql;
* ``--listen 127.0.0.1 --hostname 127.0.0.1`` on every node and on the monitor;
* the "fast" settings (monitor health checks, unhealthy/demote timeouts, keeper
  ``network_partition_timeout``, ``wal_retrieve_retry_interval``) unless ``fast=False``.

Teardown is by PID: SIGTERM to each pg_autoctl supervisor (it stops its Postgres), then SIGKILL
of whatever is left of each process tree, then removal of SysV shared memory a killed postmaster
left behind (the id is in its ``postmaster.pid``).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psycopg

PG_BIN = "/usr/lib/postgresql/15/bin"

FAST_MONITOR_SETTINGS = {
    "pgautofailover.health_check_period": 1000,
    "pgautofailover.health_check_timeout": 1000,
    "pgautofailover.health_check_max_retries": 1,
    "pgautofailover.health_check_retry_delay": 500,
    "pgautofailover.node_considered_unhealthy_timeout": 5000,
    "pgautofailover.primary_demote_timeout": 10000,
}
FAST_KEEPER_SETTINGS = {"timeout.network_partition_timeout": "5"}
FAST_NODE_CONF = "wal_retrieve_retry_interval = '1s'\n"


class FormationError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- process trees
def _children_map() -> dict[int, list[int]]:
    m: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        m.setdefault(ppid, []).append(int(d))
    return m


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (a snapshot of /proc)."""
    if not pid_alive(pid):
        return []
    m = _children_map()
    out, i = [pid], 0
    while i < len(out):
        out.extend(m.get(out[i], []))
        i += 1
    return out


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def kill_tree(pid: int | None, sig: int = signal.SIGKILL) -> int:
    """Freeze then signal ``pid`` and every descendant (SIGSTOP first so nothing respawns or
    escapes to init between the snapshot and the kill). Returns how many processes were signalled."""
    if not pid:
        return 0
    pids = process_tree(pid)
    if sig == signal.SIGKILL:
        for p in pids:
            try:
                os.kill(p, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return len(pids)


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.3)
        if s.connect_ex(("127.0.0.1", port)) == 0:
            return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Postgres does: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


# ----------------------------------------------------------------------------- the formation
@dataclass
class Node:
    name: str
    port: int
    pgdata: Path
    log: Path
    pid: int | None = None            # the pg_autoctl supervisor (setpriv does not fork)


@dataclass
class Formation:
    base: Path
    monitor_port: int = 6000
    node_ports: tuple[int, ...] = (6001, 6002)
    dbname: str = "qlpg"
    fast: bool = True
    on_pids: Callable[[dict], None] | None = None   # called whenever a supervisor PID changes
    monitor: Node = field(init=False)
    nodes: dict[str, Node] = field(init=False)

    def __post_init__(self) -> None:
        self.base = Path(self.base)
        self.as_root = os.geteuid() == 0
        self.monitor = Node("monitor", self.monitor_port, self.base / "monitor", self.base / "logs" / "monitor.log")
        self.nodes = {f"node{i + 1}": Node(f"node{i + 1}", p, self.base / f"node{i + 1}",
                                           self.base / "logs" / f"node{i + 1}.log")
                      for i, p in enumerate(self.node_ports)}
        self.sock = self.base / "sock"

    # ------------------------------------------------------------------ environment
    def env(self) -> dict[str, str]:
        b = self.base
        return {
            "HOME": str(b / "home"), "XDG_CONFIG_HOME": str(b / "config"), "XDG_DATA_HOME": str(b / "share"),
            "XDG_RUNTIME_DIR": str(b / "run"), "PG_REGRESS_SOCK_DIR": str(self.sock), "PGHOST": str(self.sock),
            "PATH": f"{PG_BIN}:/usr/bin:/bin", "LANG": "C.UTF-8",
        }

    def _argv(self, argv: list[str]) -> list[str]:
        envs = [f"{k}={v}" for k, v in self.env().items()]
        if self.as_root:
            return ["runuser", "-u", "postgres", "--", "env", "-i", *envs, *argv]
        return ["env", "-i", *envs, *argv]

    def run(self, argv: list[str], timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """Run a foreground command (pg_autoctl, psql) as the postgres OS user from the base dir."""
        cp = subprocess.run(self._argv(argv), cwd=self.base, capture_output=True, text=True, timeout=timeout)
        if check and cp.returncode != 0:
            raise FormationError(f"{' '.join(argv)} exited {cp.returncode}:\n{cp.stdout[-3000:]}\n{cp.stderr[-3000:]}")
        return cp

    def _spawn_supervisor(self, node: Node) -> None:
        envs = [f"{k}={v}" for k, v in self.env().items()]
        argv = ["env", "-i", *envs, "pg_autoctl", "run", "--pgdata", str(node.pgdata)]
        if self.as_root:
            argv = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", *argv]
        with open(node.log, "ab") as log:
            p = subprocess.Popen(argv, cwd=self.base, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        # setpriv and env exec (no fork): p.pid is pg_autoctl's PID.
        node.pid = p.pid
        self._pids_changed()

    def _pids_changed(self) -> None:
        if self.on_pids:
            self.on_pids(self.pids())

    def pids(self) -> dict[str, int | None]:
        return {"monitor": self.monitor.pid, **{n.name: n.pid for n in self.nodes.values()}}

    # ------------------------------------------------------------------ creation
    def prepare(self) -> None:
        busy = [p for p in (self.monitor_port, *self.node_ports) if port_in_use(p)]
        if busy:
            raise FormationError(f"ports {busy} are in use on 127.0.0.1; choose others (--base-port)")
        for d in ("home", "config", "share", "run", "sock", "logs"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)
        os.chmod(self.base / "run", 0o700)
        if self.as_root:
            pw = pwd.getpwnam("postgres")
            for root, dirs, files in os.walk(self.base):
                for x in [root, *[os.path.join(root, d) for d in dirs], *[os.path.join(root, f) for f in files]]:
                    os.chown(x, pw.pw_uid, pw.pw_gid)

    def create(self, log: Callable[[str], None] = print) -> dict[str, float]:
        """Create and start monitor and nodes; returns step timings (s)."""
        t: dict[str, float] = {}
        t0 = time.monotonic()
        self.prepare()
        ssl = ["--no-ssl"]
        self.run(["pg_autoctl", "create", "monitor", "--pgdata", str(self.monitor.pgdata), "--pgport",
                  str(self.monitor_port), "--hostname", "127.0.0.1", "--listen", "127.0.0.1", "--auth", "trust", *ssl])
        self._spawn_supervisor(self.monitor)
        self.wait(lambda: self._monitor_ready(), 60, "monitor accepting connections")
        if self.fast:
            with self.monitor_conn() as c:
                for k, v in FAST_MONITOR_SETTINGS.items():
                    c.execute(f"ALTER SYSTEM SET {k} = {int(v)}")
                c.execute("SELECT pg_reload_conf()")
        t["monitor"] = time.monotonic() - t0
        log(f"monitor up on 127.0.0.1:{self.monitor_port} ({t['monitor']:.1f}s)")
        for i, node in enumerate(self.nodes.values()):
            t1 = time.monotonic()
            self.run(["pg_autoctl", "create", "postgres", "--pgdata", str(node.pgdata), "--pgport", str(node.port),
                      "--hostname", "127.0.0.1", "--listen", "127.0.0.1", "--auth", "trust", *ssl,
                      "--monitor", self.monitor_uri(), "--dbname", self.dbname, "--name", node.name], timeout=300)
            if self.fast:
                for k, v in FAST_KEEPER_SETTINGS.items():
                    self.run(["pg_autoctl", "config", "set", "--pgdata", str(node.pgdata), k, v])
                with open(node.pgdata / "postgresql.conf", "a") as f:
                    f.write(FAST_NODE_CONF)
            self._spawn_supervisor(node)
            if i == 0:
                self.wait(lambda: self._states().get(node.name, ("", ""))[0] in ("single", "primary"), 120,
                          f"{node.name} single")
            t[node.name] = time.monotonic() - t1
            log(f"{node.name} created on 127.0.0.1:{node.port} ({t[node.name]:.1f}s)")
        t1 = time.monotonic()
        self.wait(self.healthy, 180, "primary + secondary")
        t["sync"] = time.monotonic() - t1
        t["total"] = time.monotonic() - t0
        return t

    # ------------------------------------------------------------------ state
    def monitor_uri(self) -> str:
        return f"postgres://autoctl_node@127.0.0.1:{self.monitor_port}/pg_auto_failover?sslmode=prefer"

    def monitor_conn(self) -> psycopg.Connection:
        return psycopg.connect(host="127.0.0.1", port=self.monitor_port, dbname="pg_auto_failover", user="postgres",
                               autocommit=True, connect_timeout=3)

    def _monitor_ready(self) -> bool:
        try:
            with self.monitor_conn() as c:
                c.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def _states(self) -> dict[str, tuple[str, str]]:
        """``{node name: (reported state, assigned state)}`` from the monitor ({} if unreachable)."""
        try:
            with self.monitor_conn() as c:
                rows = c.execute("SELECT nodename, reportedstate::text, goalstate::text FROM pgautofailover.node").fetchall()
        except psycopg.Error:
            return {}
        return {r[0]: (r[1], r[2]) for r in rows}

    def states(self) -> dict[str, tuple[str, str]]:
        return self._states()

    def describe(self) -> str:
        return " ".join(f"{n}:{a}/{b}" for n, (a, b) in sorted(self._states().items()))

    def primary(self) -> str | None:
        """The node both reported and assigned primary (or wait_primary)."""
        for n, (rep, goal) in self._states().items():
            if rep == goal and rep in ("primary", "wait_primary", "single"):
                return n
        return None

    def healthy(self) -> bool:
        st = self._states()
        if len(st) != len(self.nodes):
            return False
        vals = sorted(st.values())
        return vals == [("primary", "primary"), ("secondary", "secondary")] and all(
            pid_alive(n.pid) for n in self.nodes.values())

    def wait(self, pred: Callable[[], bool], timeout: float, what: str, poll: float = 0.1) -> float:
        t0 = time.monotonic()
        while True:
            if pred():
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise FormationError(f"timed out after {timeout:.0f}s waiting for {what}; formation: {self.describe()}")
            time.sleep(poll)

    def uri(self, user: str, dbname: str | None = None, **extra: str) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.node_ports)
        q = {"target_session_attrs": "read-write", "connect_timeout": "2", "user": user, **extra}
        return f"postgresql://{hosts}/{dbname or self.dbname}?" + "&".join(f"{k}={v}" for k, v in q.items())

    def node_conninfo(self, name: str, user: str = "postgres", dbname: str | None = None) -> str:
        return f"host=127.0.0.1 port={self.nodes[name].port} dbname={dbname or self.dbname} user={user} connect_timeout=3"

    # ------------------------------------------------------------------ events
    def perform_failover(self) -> subprocess.Popen:
        """Start ``pg_autoctl perform failover`` (it returns once the failover completed)."""
        return subprocess.Popen(self._argv(["pg_autoctl", "perform", "failover", "--pgdata", str(self.monitor.pgdata)]),
                                cwd=self.base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def promoted(self, name: str) -> bool:
        """``name`` reports (and is assigned) wait_primary or primary: it accepts writes."""
        rep, goal = self._states().get(name, ("", ""))
        return rep == goal and rep in ("wait_primary", "primary")

    def kill_node(self, name: str) -> int:
        """kill -9 of the node's whole tree: pg_autoctl supervisor and every Postgres process."""
        node = self.nodes[name]
        n = kill_tree(node.pid, signal.SIGKILL)
        pm = self._postmaster_pid(node)
        if pm and pid_alive(pm):
            n += kill_tree(pm, signal.SIGKILL)
        return n

    def start_node(self, name: str) -> None:
        self._spawn_supervisor(self.nodes[name])

    @staticmethod
    def _postmaster_pid(node: Node) -> int | None:
        try:
            return int((node.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------------ teardown
    def teardown(self, grace: float = 15.0) -> list[str]:
        """Stop every supervisor by PID (SIGTERM, then SIGKILL of the tree); remove leftover shm."""
        notes: list[str] = []
        everything = [*self.nodes.values(), self.monitor]
        for n in everything:
            if pid_alive(n.pid):
                try:
                    os.kill(n.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(pid_alive(n.pid) for n in everything):
            time.sleep(0.2)
        for n in everything:
            k = kill_tree(n.pid) if pid_alive(n.pid) else 0
            pm = self._postmaster_pid(n)
            if pm and pid_alive(pm):
                k += kill_tree(pm)
            if k:
                notes.append(f"{n.name}: SIGKILLed {k} process(es)")
            remove_shm(n.pgdata)
            n.pid = None
        self._pids_changed()
        return notes


def remove_shm(pgdata: Path) -> None:
    """Remove the SysV shared memory segment a killed postmaster left (id from postmaster.pid)."""
    try:
        lines = (Path(pgdata) / "postmaster.pid").read_text().splitlines()
        shmid = int(lines[6].split()[1])
    except (OSError, IndexError, ValueError):
        return
    try:
        out = subprocess.run(["ipcs", "-m", "-i", str(shmid)], capture_output=True, text=True, timeout=5).stdout
        if "nattch=0" in out.replace(" ", ""):
            subprocess.run(["ipcrm", "-m", str(shmid)], capture_output=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        pass


def save_pids(path: Path, pids: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(pids))
    os.replace(tmp, path)


def remove_tree(base: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove ``base`` (or everything in it but the names in ``keep``)."""
    if not keep:
        shutil.rmtree(base, ignore_errors=True)
        return
    for p in Path(base).iterdir():
        if p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
