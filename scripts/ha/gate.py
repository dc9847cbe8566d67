"""The HA gate (issue 9, docs/ha.md): qlpg keeps every receipt through failovers and crashes.

Run through ``scripts/ha-gate`` (which installs pg_auto_failover when missing). Steps:

1. A pg_auto_failover formation on 127.0.0.1 (monitor + two nodes, formation.py) in one temporary
   folder; ``qlpg migrate`` through the multi-host URI; one login per role with
   ``qlpg roles create-login``; the workload package installed with ``qlpg package install``.
2. Clients, each its own process through the multi-host DSN
   (``target_session_attrs=read-write&connect_timeout=2``): ``qlpg runtime``, ``--workers`` ×
   ``qlpg worker``, the Workflow starter and the write probe (workload.py). Runtime and workers
   journal every acknowledged receipt and every ambiguous COMMIT they resolved
   (``$QLPG_RECEIPT_LOG``).
3. Events: ``--failovers`` planned failovers (``pg_autoctl perform failover``) and ``--crashes``
   kill -9 of the primary's whole node (pg_autoctl + Postgres tree), restarting it so that it
   rejoins (pg_rewind) every time; on every other crash a worker process is killed -9 as well and
   restarted with ``--reset-session``. After each event: exact replays of the receipts at risk.
4. Convergence (every Run terminal), then the checks on the final primary and the comparison
   with the secondary; the report; teardown by PID (also on error, SIGINT/SIGTERM, and — through
   a watchdog process — if the gate itself is killed).

Exit status 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import checks  # noqa: E402
import workload  # noqa: E402
from formation import Formation, FormationError, kill_tree, pid_alive, remove_tree, save_pids  # noqa: E402

from qlpg import db  # noqa: E402

LOGINS = {"ha_package_manager": "ql3_package_manager", "ha_executor": "ql3_package_executor",
          "ha_runtime": "ql3_runtime", "ha_worker": "ql3_worker_ingress", "ha_admin": "ql3_admin"}


class GateFailure(RuntimeError):
    pass


def now() -> float:
    return time.time()


class Gate:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.t_start = now()
        if a.base:
            self.base = Path(a.base)
            self.base.mkdir(parents=True, exist_ok=False)
        else:
            self.base = Path(tempfile.mkdtemp(prefix="qlpg-ha-gate.", dir="/tmp"))
        self.logs = self.base / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pidfile = self.base / "pids.json"
        self.clients: dict[str, subprocess.Popen] = {}
        self.formation = Formation(self.base, monitor_port=a.base_port, node_ports=(a.base_port + 1, a.base_port + 2),
                                   fast=not a.default_timeouts, on_pids=lambda _p: self._save_pids())
        self.events: list[dict] = []
        self.results: dict = {"settings": {}, "events": self.events, "checks": {}, "timings": {}}
        self.rng = random.Random(a.seed)
        self.replays = checks.ReplayStats()
        self.worker_restarts = 0
        self._watchdog: subprocess.Popen | None = None

    # ------------------------------------------------------------------ plumbing
    def log(self, msg: str) -> None:
        print(f"[{now() - self.t_start:7.1f}s] {msg}", flush=True)

    def _save_pids(self) -> None:
        save_pids(self.pidfile, {"formation": self.formation.pids(),
                                 "clients": {k: p.pid for k, p in self.clients.items()}})

    def start_watchdog(self) -> None:
        """A process in its own session that tears everything down by PID if the gate dies."""
        self._watchdog = subprocess.Popen([sys.executable, str(Path(__file__)), "watchdog", str(self.base)],
                                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            try:
                self._watchdog.stdin.write(b"done\n")
                self._watchdog.stdin.close()
                self._watchdog.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                kill_tree(self._watchdog.pid)

    def qlpg(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cp = subprocess.run([sys.executable, "-m", "qlpg", *args], capture_output=True, text=True, timeout=300,
                            cwd=self.base)
        if check and cp.returncode != 0:
            raise GateFailure(f"qlpg {' '.join(args[:3])} exited {cp.returncode}: {cp.stdout[-2000:]} {cp.stderr[-2000:]}")
        return cp

    def uri(self, user: str, dbname: str | None = None) -> str:
        return self.formation.uri(user, dbname)

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        full_env = dict(os.environ, **(env or {}))
        full_env["PYTHONUNBUFFERED"] = "1"
        with open(self.logs / f"{name}.log", "ab") as out:
            p = subprocess.Popen(argv, cwd=self.base, env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        self.clients[name] = p
        self._save_pids()
        return p

    def stop_client(self, name: str, timeout: float = 30) -> int | None:
        p = self.clients.get(name)
        if p is None:
            return None
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
                p.wait(timeout=10)
        return p.returncode

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        a = self.a
        t0 = time.monotonic()
        steps = self.formation.create(log=self.log)
        self.results["timings"]["formation_setup_s"] = round(steps["total"], 1)
        self.log(f"formation ready in {steps['total']:.1f}s: {self.formation.describe()}")
        su = self.uri("postgres")
        with db.connect(su) as c:
            c.execute("CREATE DATABASE ha_probe")
            if a.synchronous_commit != "on":
                for d in (self.formation.dbname, "ha_probe"):
                    c.execute(f"ALTER DATABASE {d} SET synchronous_commit = '{a.synchronous_commit}'")
        with db.connect(self.uri("postgres", "ha_probe")) as c:
            c.execute(workload.PROBE_DDL)
        if a.commit_samples:
            self.results["settings"]["commit_latency_ms"] = lat = self.measure_commit_latency(a.commit_samples)
            self.log("commit latency (median/p99 ms, idle formation): "
                     + ", ".join(f"{k} {v['median']}/{v['p99']}" for k, v in lat.items()))
        self.qlpg("migrate", "--dsn", su)
        for login, role in LOGINS.items():
            self.qlpg("roles", "create-login", login, "--role", role, "--dsn", su)
        pkg = workload.write_package(self.base / "packages" / workload.PACKAGE)
        self.qlpg("package", "install", str(pkg), "--dsn", self.uri("ha_package_manager"))
        self.results["timings"]["qlpg_setup_s"] = round(time.monotonic() - t0 - steps["total"], 1)
        self.record_settings()
        self.log("qlpg migrated, logins created, package installed")

    def measure_commit_latency(self, n: int) -> dict:
        """Sequential one-row INSERT commits through the multi-host URI under each
        synchronous_commit value, interleaved in blocks of 25 so that load drifts hit all alike."""
        kinds = ("local", "on", "remote_apply")
        lat: dict[str, list[float]] = {k: [] for k in kinds}
        with db.connect(self.uri("postgres", "ha_probe")) as c:
            c.execute("CREATE TABLE commit_latency (id bigserial PRIMARY KEY, v integer)")
            for _ in range(max(1, n // 25)):
                for k in kinds:
                    c.execute(f"SET synchronous_commit = {k}")
                    for _ in range(25):
                        t = time.perf_counter()
                        with c.transaction():
                            c.execute("INSERT INTO commit_latency (v) VALUES (1)")
                        lat[k].append(time.perf_counter() - t)
            c.execute("DROP TABLE commit_latency")
        return {k: {"median": round(statistics.median(v) * 1000, 2),
                    "p99": round(sorted(v)[max(0, int(len(v) * 0.99) - 1)] * 1000, 2), "n": len(v)}
                for k, v in lat.items()}

    def record_settings(self) -> None:
        s = self.results["settings"]
        with db.connect(self.uri("ha_admin")) as c:
            for k in ("synchronous_commit", "synchronous_standby_names", "wal_level", "wal_keep_size",
                      "wal_retrieve_retry_interval", "server_version"):
                s[k] = c.execute(f"SHOW {k}").fetchone()[k]
        with self.formation.monitor_conn() as m:
            s["number_sync_standbys"] = m.execute("SELECT number_sync_standbys FROM pgautofailover.formation "
                                                  "WHERE formationid = 'default'").fetchone()[0]
            s["nodes"] = [dict(zip(("name", "candidate_priority", "replication_quorum"), r)) for r in m.execute(
                "SELECT nodename, candidatepriority, replicationquorum FROM pgautofailover.node ORDER BY nodeid")]
            s["monitor"] = {r[0]: r[1] for r in m.execute(
                "SELECT name, setting FROM pg_settings WHERE name LIKE 'pgautofailover.%' ORDER BY 1")}
        s["fast_settings"] = not self.a.default_timeouts
        s["pg_autoctl"] = subprocess.run(["pg_autoctl", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        s["lease_ms"] = self.a.lease_ms
        s["workers"] = self.a.workers

    # ------------------------------------------------------------------ clients
    def start_clients(self) -> None:
        a = self.a
        q = [sys.executable, "-m", "qlpg"]
        self.spawn("probe", [sys.executable, str(HERE / "workload.py"), "probe", "--dsn", self.uri("postgres", "ha_probe"),
                             "--journal", str(self.logs / "probe.probe"), "--stop-file", str(self.base / "stop-probe")])
        self.spawn("runtime", [*q, "runtime", "--dsn", self.uri("ha_runtime"), "--idle-ms", "200"],
                   env={"QLPG_RECEIPT_LOG": str(self.logs / "runtime.jsonl")})
        for i in range(a.workers):
            self.spawn_worker(i, reset=False)
        self.spawn("starter", [sys.executable, str(HERE / "workload.py"), "starter",
                               "--dsn-executor", self.uri("ha_executor"), "--dsn-admin", self.uri("ha_admin"),
                               "--journal", str(self.logs / "starter.jsonl"), "--stop-file", str(self.base / "stop-starter"),
                               "--min-workflows", str(a.workflows), "--max-inflight", str(a.max_inflight),
                               "--cancel-fraction", str(a.cancel_fraction), "--seed", str(a.seed)])

    def spawn_worker(self, i: int, reset: bool) -> None:
        argv = [sys.executable, "-m", "qlpg", "worker", "--dsn", self.uri("ha_worker"), "--worker-id", f"ha-w{i}",
                "--state-dir", str(self.base / "state"), "--lease-ms", str(self.a.lease_ms)]
        if reset:
            argv.append("--reset-session")
        self.spawn(f"worker-{i}", argv, env={"QLPG_RECEIPT_LOG": str(self.logs / f"worker-{i}.jsonl")})

    def check_clients_alive(self) -> None:
        dead = [f"{n} (exit {p.returncode})" for n, p in self.clients.items() if p.poll() is not None and n != "starter"]
        if self.clients.get("starter") and self.clients["starter"].poll() not in (None, 0):
            dead.append(f"starter (exit {self.clients['starter'].returncode})")
        if dead:
            raise GateFailure(f"client process(es) died: {', '.join(dead)}; see {self.logs}")

    # ------------------------------------------------------------------ events
    def schedule(self) -> list[str]:
        n, m = self.a.failovers, self.a.crashes
        total = n + m
        crash_at = {int((k + 0.5) * total / m) for k in range(m)} if m else set()
        return ["crash" if i in crash_at else "failover" for i in range(total)]

    def replay_conns(self):
        if not hasattr(self, "_rc"):
            self._rc = {k: workload.Client(self.uri(u), f"ha-gate-replay-{k}") for k, u in
                        (("executor", "ha_executor"), ("runtime", "ha_runtime"), ("worker", "ha_worker"))}
        return {k: c.get for k, c in self._rc.items()}

    def reset_replay_conns(self) -> None:
        for c in getattr(self, "_rc", {}).values():
            c.reset()

    def run_event(self, idx: int, kind: str, crash_no: int) -> None:
        f = self.formation
        f.wait(f.healthy, 180, "primary + secondary before the event")
        time.sleep(self.a.settle)
        self.check_clients_alive()
        old = f.primary()
        other = next(n for n in f.nodes if n != old)
        ev = {"n": idx + 1, "kind": kind, "from": old, "to": other}
        self.log(f"event {idx + 1}: {kind} of {old} ({f.describe()})")
        t0 = now()
        ev["t0"] = t0
        if kind == "failover":
            cmd = f.perform_failover()
            f.wait(lambda: f.promoted(other), 300, f"{other} promoted")
            ev["promoted_s"] = round(now() - t0, 2)
            out, _ = cmd.communicate(timeout=300)
            ev["command_s"] = round(now() - t0, 2)
            if cmd.returncode != 0:
                raise GateFailure(f"pg_autoctl perform failover exited {cmd.returncode}: {out[-2000:]}")
        else:
            ev["killed_processes"] = f.kill_node(old)
            if self.a.worker_kill_every and crash_no % self.a.worker_kill_every == 0:
                i = self.rng.randrange(self.a.workers)
                p = self.clients[f"worker-{i}"]
                ev["worker_killed"] = f"ha-w{i}"
                kill_tree(p.pid)
                p.wait(timeout=10)
                self.spawn_worker(i, reset=True)
                self.worker_restarts += 1
            f.wait(lambda: f.promoted(other), 300, f"{other} promoted")
            ev["promoted_s"] = round(now() - t0, 2)
            t_restart = now()
            f.start_node(old)
            ev["restart_at_s"] = round(t_restart - t0, 2)
        f.wait(lambda: f.healthy() and f.primary() == other, 300, f"{other} primary and {old} secondary")
        ev["healthy_s"] = round(now() - t0, 2)
        if kind == "crash":
            ev["rejoin_s"] = round(now() - t_restart, 2)
        ev["t_healthy"] = now()
        # Exact replays after the promotion: every receipt acknowledged shortly before or during
        # the event, plus a sample of older ones, on the new primary.
        time.sleep(1.0)
        self.reset_replay_conns()
        j = checks.load_journals(self.logs)
        st = checks.replay_batch(checks.sample_for_event(j, t0, self.rng), self.replay_conns())
        ev["replays"] = st.issued
        ev["replays_identical"] = st.identical
        self.replays.add(st)
        self.events.append(ev)
        self.log(f"event {idx + 1}: {kind} {old} -> {other}: healthy after {ev['healthy_s']}s; "
                 f"{st.identical}/{st.issued} exact replays identical")

    # ------------------------------------------------------------------ convergence and checks
    def owner(self):
        return db.connect(self.uri("postgres"), application_name="ha-gate-check")

    def converge(self) -> None:
        (self.base / "stop-starter").touch()
        p = self.clients["starter"]
        deadline = time.monotonic() + self.a.converge_timeout + 600
        while p.poll() is None:
            if time.monotonic() > deadline:
                raise GateFailure("the starter did not finish")
            self.check_clients_alive()
            time.sleep(1)
        self.log(f"starter finished: {(self.logs / 'starter.log').read_text().strip().splitlines()[-1:]}")
        t0 = time.monotonic()
        operator = 0
        while True:
            with self.owner() as c:
                running = c.execute("SELECT count(*) AS n FROM ql3.runs WHERE status = 'running'").fetchone()["n"]
                manual = [r["attempt_id"] for r in c.execute(
                    "SELECT attempt_id FROM ql3.run_recovery_controls WHERE status = 'manual'")]
            if running == 0:
                break
            if manual:
                # An operator's step (docs/ha.md): the workers are known, so trusted not_running
                # evidence can be given for attempts whose lease expired without evidence.
                for aid in manual:
                    self.qlpg("recover", "--attempt", aid, "--evidence", "not_running", "--actor", "ha-gate",
                              "--dsn", self.uri("ha_admin"))
                    operator += 1
            if time.monotonic() - t0 > self.a.converge_timeout:
                raise GateFailure(f"{running} run(s) still running after {self.a.converge_timeout}s")
            self.check_clients_alive()
            time.sleep(1)
        self.results["checks"]["operator_recoveries"] = operator
        self.results["timings"]["convergence_s"] = round(time.monotonic() - t0, 1)
        self.log(f"every run is terminal ({time.monotonic() - t0:.1f}s after the last start)")

    def stop_clients(self) -> None:
        (self.base / "stop-probe").touch()
        for name in list(self.clients):
            self.stop_client(name)

    def verify(self) -> bool:
        r = self.results["checks"]
        j = checks.load_journals(self.logs)
        probe_lines = [json.loads(x) for x in (self.logs / "probe.probe").read_text().splitlines() if x.strip()]
        j.probe_acks = sorted((x["t"], x["id"]) for x in probe_lines if x["kind"] == "probe")
        j.probe_errors = [x for x in probe_lines if x["kind"] == "probe_error"]
        with self.owner() as c:
            r["lost_receipts"] = checks.durable_receipts(c, j)
            r["journal_conflicts"] = j.conflicts
            r["epochs"] = checks.epoch_problems(c, j)
            r["runs"] = checks.run_summary(c)
            r["audit_invariants"] = checks.audit_invariants(c)
            r["digests"] = checks.digest_problems(c)
        r["acknowledged"] = {"plan_admissions": len(j.plans), "attempt_admissions": len(j.attempts),
                             "completions": len(j.completions)}
        r["ambiguous"] = checks.ambiguity_summary(j)
        r["ambiguous_total"] = len(j.ambiguous)
        r["cancels"] = len(j.cancels)
        self.log(f"final exact replay of all {sum(r['acknowledged'].values())} acknowledged receipts")
        self.reset_replay_conns()
        final = checks.replay_batch(j.receipts(), self.replay_conns())
        r["replays_after_promotion"] = {"issued": self.replays.issued, "identical": self.replays.identical,
                                        "problems": self.replays.problems[:20]}
        r["replays_final"] = {"issued": final.issued, "identical": final.identical, "problems": final.problems[:20]}
        # The probe: acknowledged rows present; the replica holds the same rows.
        with db.connect(self.uri("postgres", "ha_probe")) as c:
            have = {x["id"] for x in c.execute("SELECT id FROM probe")}
        acked = {i for _, i in j.probe_acks}
        r["probe"] = {"acknowledged": len(acked), "lost": sorted(acked - have)[:20],
                      "errors": len(j.probe_errors),
                      "ambiguous_committed": len({x["id"] for x in j.probe_errors} & have)}
        f = self.formation
        prim = f.primary()
        sec = next(n for n in f.nodes if n != prim)
        r["final_primary"] = prim
        replica = {}
        for dbname, schema in ((f.dbname, "ql3"), ("ha_probe", "public")):
            with psycopg_connect(f.node_conninfo(prim, dbname=dbname)) as pc, \
                    psycopg_connect(f.node_conninfo(sec, dbname=dbname)) as sc:
                checks.wait_replica(pc, sc)
                rows, problems = checks.compare_replica(pc, sc, schema)
                replica[f"{dbname}.{schema}"] = {"rows": rows, "problems": problems}
        r["replica"] = replica
        doc = self.qlpg("doctor", "--json", "--dsn", self.uri("ha_admin"), check=False)
        try:
            rows = json.loads(doc.stdout)
            r["doctor"] = {x["check"]: {"ok": x["ok"], "detail": x["detail"]} for x in rows
                           if x["check"] in ("synchronous_commit", "durability", "replication")}
        except (json.JSONDecodeError, KeyError, TypeError):
            r["doctor"] = {"output": doc.stdout[-2000:] + doc.stderr[-2000:]}
        # Unavailability per event.
        for ev in self.events:
            ev["probe_gap_s"] = round(checks.max_gap([t for t, _ in j.probe_acks], ev["t0"], ev["t_healthy"])[0], 2)
            ev["qlpg_gap_s"] = round(checks.max_gap(j.ack_times, ev["t0"], ev["t_healthy"])[0], 2)
            ev["ambiguous"] = sum(1 for x in j.ambiguous if ev["t0"] - 1 <= x["t"] <= ev["t_healthy"] + 5)
        lat = [x["t"] - x["sent"] for x in probe_lines if x["kind"] == "probe"
               and not any(ev["t0"] - 2 <= x["t"] <= ev["t_healthy"] + 2 for ev in self.events)]
        if lat:
            r["probe_commit_latency_ms"] = {"median": round(statistics.median(lat) * 1000, 2),
                                            "p99": round(sorted(lat)[int(len(lat) * 0.99) - 1] * 1000, 2)}
        failures = []
        if r["lost_receipts"]:
            failures.append(f"{len(r['lost_receipts'])} lost receipt(s)")
        if j.conflicts:
            failures.append(f"{len(j.conflicts)} key(s) acknowledged with two digests")
        if r["epochs"]:
            failures.append("epoch problems")
        if r["runs"]["running"]:
            failures.append(f"{r['runs']['running']} run(s) not terminal")
        if r["audit_invariants"]:
            failures.append("audit invariants")
        if r["digests"]:
            failures.append("digest verification")
        if self.replays.problems or final.problems:
            failures.append(f"{len(self.replays.problems) + len(final.problems)} replay(s) not identical")
        if r["probe"]["lost"]:
            failures.append("lost probe rows")
        for k, v in replica.items():
            if v["problems"]:
                failures.append(f"replica differs in {k}")
        if len(self.events) != self.a.failovers + self.a.crashes:
            failures.append("not every event ran")
        r["failures"] = failures
        return not failures

    # ------------------------------------------------------------------ report
    def report(self, ok: bool) -> None:
        r = self.results["checks"]
        print("\n=== HA gate report ===")
        s = self.results["settings"]
        if s.get("commit_latency_ms"):
            print(f"commit latency ms (idle formation): {s['commit_latency_ms']}")
        print(f"settings: synchronous_commit={s.get('synchronous_commit')} synchronous_standby_names="
              f"{s.get('synchronous_standby_names')!r} number_sync_standbys={s.get('number_sync_standbys')} "
              f"fast={s.get('fast_settings')} lease_ms={s.get('lease_ms')} workers={s.get('workers')}")
        print(markdown_events(self.events))
        if r:
            print(f"acknowledged: {r.get('acknowledged')}")
            print(f"ambiguous commits resolved: {r.get('ambiguous_total')} {r.get('ambiguous')}")
            print(f"lost receipts: {len(r.get('lost_receipts', []))}")
            print(f"exact replays after promotions: {r['replays_after_promotion']['identical']}/"
                  f"{r['replays_after_promotion']['issued']} identical; final: {r['replays_final']['identical']}/"
                  f"{r['replays_final']['issued']}")
            print(f"runs: {r['runs']}")
            print(f"probe: {r['probe']}; commit latency {r.get('probe_commit_latency_ms')}")
            print(f"replica: { {k: (v['rows'], len(v['problems'])) for k, v in r['replica'].items()} }")
            print(f"epochs: {r['epochs'] or 'ok'}; audit invariants: {r['audit_invariants'] or 'ok'}; "
                  f"digests: {r['digests'] or 'ok'}; operator recoveries: {r.get('operator_recoveries')}")
            print(f"doctor: {r.get('doctor')}")
            if r.get("failures"):
                print(f"FAILURES: {r['failures']}")
        self.results["timings"]["total_s"] = round(now() - self.t_start, 1)
        self.results["ok"] = ok
        print(f"timings: {self.results['timings']}")
        print(f"HA gate {'PASSED' if ok else 'FAILED'} in {now() - self.t_start:.0f}s")
        out = json.dumps(self.results, indent=2, default=str)
        (self.logs / "results.json").write_text(out)
        if self.a.results:
            Path(self.a.results).write_text(out)

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        ok = False
        self.start_watchdog()
        self._save_pids()
        try:
            self.setup()
            self.start_clients()
            crash_no = 0
            for i, kind in enumerate(self.schedule()):
                if kind == "crash":
                    crash_no += 1
                self.run_event(i, kind, crash_no)
            self.converge()
            self.stop_clients()
            ok = self.verify()
        except (GateFailure, FormationError) as exc:
            self.log(f"GATE ERROR: {exc}")
            self.results["error"] = str(exc)
        except KeyboardInterrupt:
            self.log("interrupted")
            self.results["error"] = "interrupted"
        finally:
            try:
                self.report(ok)
            finally:
                self.teardown(ok)
        return 0 if ok else 1

    def teardown(self, ok: bool) -> None:
        self.log("teardown")
        for name in list(self.clients):
            p = self.clients[name]
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait(timeout=10)
        notes = self.formation.teardown()
        for n in notes:
            self.log(n)
        self._save_pids()
        if self.a.keep:
            self.log(f"kept {self.base}")
        elif not ok:
            remove_tree(self.base, keep=("logs",))
            self.log(f"logs kept in {self.logs}")
        else:
            if self.a.results is None:
                self.log(f"results: {self.logs / 'results.json'} (removed with the folder; use --results FILE to keep)")
            remove_tree(self.base)
        self.stop_watchdog()


def markdown_events(events: list[dict]) -> str:
    """The per-event table (Markdown, as in docs/ha.md)."""
    out = ["| # | event | from → to | db unavailable (s) | qlpg ack gap (s) | promoted (s) | rejoined (s) "
           "| primary+secondary (s) | ambiguous resolved | exact replays identical |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for ev in events:
        kind = ev["kind"] + (f" + worker {ev['worker_killed']} kill -9" if ev.get("worker_killed") else "")
        out.append(f"| {ev['n']} | {kind} | {ev['from']} → {ev['to']} | {ev.get('probe_gap_s', '-')} "
                   f"| {ev.get('qlpg_gap_s', '-')} | {ev.get('promoted_s', ev.get('command_s', '-'))} "
                   f"| {ev.get('rejoin_s', '-')} | {ev['healthy_s']} | {ev.get('ambiguous', '-')} "
                   f"| {ev['replays_identical']}/{ev['replays']} |")
    return "\n".join(out)


def psycopg_connect(conninfo: str):
    import psycopg
    from psycopg.rows import dict_row

    return psycopg.connect(conninfo, autocommit=True, row_factory=dict_row)


# ----------------------------------------------------------------------------- watchdog
def watchdog(base: str) -> int:
    """Wait for EOF on stdin (the gate exited); unless it said "done", kill by the PIDs it saved."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    data = sys.stdin.buffer.read()
    if b"done" in data:
        return 0
    try:
        pids = json.loads((Path(base) / "pids.json").read_text())
    except (OSError, json.JSONDecodeError):
        return 1
    for pid in (pids.get("clients") or {}).values():
        kill_tree(pid)
    sup = [p for p in (pids.get("formation") or {}).values() if p]
    for p in sup:
        if pid_alive(p):
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(pid_alive(p) for p in sup):
        time.sleep(0.2)
    for p in sup:
        kill_tree(p)
    for d in Path(base).glob("*/postmaster.pid"):
        try:
            pm = int(d.read_text().split("\n", 1)[0])
            kill_tree(pm)
        except (OSError, ValueError):
            pass
    remove_tree(Path(base), keep=("logs",))
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/ha-gate", description=__doc__.split("\n\n")[0])
    p.add_argument("--failovers", type=int, default=10, help="planned failovers (pg_autoctl perform failover)")
    p.add_argument("--crashes", type=int, default=5, help="kill -9 of the primary's whole node")
    p.add_argument("--workflows", type=int, default=150, help="at least this many Workflow starts")
    p.add_argument("--short", action="store_true", help="CI size: 1 failover, 1 crash, 12 workflows")
    p.add_argument("--workers", type=int, default=3, help="qlpg worker processes")
    p.add_argument("--lease-ms", type=int, default=30000)
    p.add_argument("--max-inflight", type=int, default=8, help="running Runs the starter keeps at most")
    p.add_argument("--cancel-fraction", type=float, default=0.05)
    p.add_argument("--settle", type=float, default=4.0, help="seconds of normal workload before each event")
    p.add_argument("--worker-kill-every", type=int, default=2,
                   help="kill -9 (and restart with --reset-session) a worker on every Nth crash (0: never)")
    p.add_argument("--synchronous-commit", default="on", choices=["on", "remote_apply", "remote_write"],
                   help="ALTER DATABASE ... SET synchronous_commit for the qlpg and probe databases")
    p.add_argument("--default-timeouts", action="store_true", help="pg_auto_failover's default timeouts (slow)")
    p.add_argument("--commit-samples", type=int, default=300,
                   help="commits per synchronous_commit value (local, on, remote_apply) timed before the workload (0: skip)")
    p.add_argument("--converge-timeout", type=float, default=240)
    p.add_argument("--base-port", type=int, default=6000, help="monitor port; nodes use the next two")
    p.add_argument("--base", help="folder to create (default: a new /tmp/qlpg-ha-gate.* folder)")
    p.add_argument("--keep", action="store_true", help="keep the folder (data and logs) at the end")
    p.add_argument("--results", help="also write the results JSON here")
    p.add_argument("--seed", type=int, default=9)
    a = p.parse_args(argv)
    if a.short:
        a.failovers, a.crashes, a.workflows, a.worker_kill_every = 1, 1, min(a.workflows, 12), 1
        a.settle = min(a.settle, 3.0)
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["watchdog"]:
        return watchdog(argv[1])
    a = parse(argv)
    gate = Gate(a)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    return gate.run()


if __name__ == "__main__":
    sys.exit(main())
