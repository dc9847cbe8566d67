"""qlpg.process.run_process and qlpg.taskenv.build_task_env (no database needed)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from qlpg.process import run_process
from qlpg.taskenv import BASELINE_NAMES, build_task_env

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C"}


def _run(tmp_path, argv, **kw):
    kw.setdefault("cwd", str(tmp_path))
    kw.setdefault("env", ENV)
    kw.setdefault("log_dir", str(tmp_path / "logs"))
    kw.setdefault("max_output_bytes", 1 << 20)
    kw.setdefault("poll_interval_s", 0.05)
    return run_process(argv, **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); treat it as gone
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def test_exit_zero_and_output(tmp_path):
    started = []
    r = _run(tmp_path, ["bash", "-c", "echo out; echo err >&2; pwd"], on_started=started.append)
    assert r.exit_code == 0 and r.signal is None and r.stop_reason is None
    assert r.start_error is None and r.succeeded
    assert started == [r.pid]
    assert open(r.stdout_path).read() == f"out\n{tmp_path}\n"
    assert open(r.stderr_path).read() == "err\n"
    assert r.stdout_path == str(tmp_path / "logs" / "stdout.log")
    assert not r.output_truncated
    assert r.duration_ms >= 0


def test_exit_three(tmp_path):
    r = _run(tmp_path, ["bash", "-c", "echo checking; exit 3"])
    assert r.exit_code == 3 and r.signal is None and r.stop_reason is None
    assert not r.succeeded
    assert open(r.stdout_path).read() == "checking\n"


def test_env_is_exactly_given(tmp_path):
    r = _run(tmp_path, ["env"], env={"PATH": ENV["PATH"], "ONLY_ME": "1"})
    lines = sorted(open(r.stdout_path).read().split())
    assert lines == sorted([f"PATH={ENV['PATH']}", "ONLY_ME=1"])


def test_output_truncation(tmp_path):
    # 200 KiB on stdout, 5 KiB on stderr, cap 64 KiB per stream; the child must
    # not block on a full pipe once the cap is reached (drain and discard).
    script = "import sys; sys.stdout.write('x'*204800); sys.stderr.write('e'*5120)"
    r = _run(tmp_path, [sys.executable, "-c", script], max_output_bytes=65536,
             env={**ENV, "PATH": os.path.dirname(sys.executable) + ":" + ENV["PATH"]})
    assert r.exit_code == 0
    assert r.output_truncated
    assert os.path.getsize(r.stdout_path) == 65536
    assert os.path.getsize(r.stderr_path) == 5120


def test_exact_cap_is_not_truncated(tmp_path):
    r = _run(tmp_path, ["head", "-c", "2048", "/dev/zero"], max_output_bytes=2048)
    assert r.exit_code == 0 and not r.output_truncated
    assert os.path.getsize(r.stdout_path) == 2048


def test_timeout_kills_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    # child spawns a grandchild `sleep 60`, records its pid, then waits forever
    script = f"sleep 60 & echo $! > {pidfile}; wait"
    t0 = time.monotonic()
    r = _run(tmp_path, ["bash", "-c", script], deadline_monotonic=time.monotonic() + 0.7)
    elapsed = time.monotonic() - t0
    assert r.stop_reason == "timeout"
    assert r.exit_code is None and r.signal == signal.SIGTERM
    assert not r.succeeded
    assert elapsed < 5
    gpid = int(pidfile.read_text())
    assert _wait_gone(gpid), f"grandchild {gpid} survived the timeout"


def test_timeout_escalates_to_sigkill(tmp_path):
    # ignores SIGTERM: must be SIGKILLed after the grace period
    script = "trap '' TERM; echo ready; while :; do sleep 0.1; done"
    t0 = time.monotonic()
    r = _run(tmp_path, ["bash", "-c", script], deadline_monotonic=time.monotonic() + 0.3)
    elapsed = time.monotonic() - t0
    assert r.stop_reason == "timeout"
    assert r.signal == signal.SIGKILL
    assert 2.0 <= elapsed < 6


def test_should_stop_cancels(tmp_path):
    calls = {"n": 0}

    def should_stop():
        calls["n"] += 1
        return "cancel" if calls["n"] >= 3 else None

    pidfile = tmp_path / "gc.pid"
    r = _run(tmp_path, ["bash", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], should_stop=should_stop)
    assert r.stop_reason == "cancel"
    assert r.exit_code is None and r.signal is not None
    assert calls["n"] == 3
    assert _wait_gone(int(pidfile.read_text()))


def test_background_child_of_successful_process_is_reaped(tmp_path):
    pidfile = tmp_path / "bg.pid"
    r = _run(tmp_path, ["bash", "-c", f"sleep 60 >/dev/null 2>&1 & echo $! > {pidfile}; exit 0"])
    assert r.exit_code == 0 and r.stop_reason is None
    assert _wait_gone(int(pidfile.read_text()))


def test_missing_binary_is_start_error(tmp_path):
    r = _run(tmp_path, ["definitely-not-a-binary-qlpg"])
    assert r.start_error and "not found" in r.start_error
    assert r.exit_code is None and r.signal is None and r.stop_reason is None
    assert not r.succeeded
    assert os.path.exists(r.stdout_path) and os.path.exists(r.stderr_path)


def test_not_executable_is_start_error(tmp_path):
    f = tmp_path / "script.sh"
    f.write_text("#!/bin/sh\necho hi\n")
    f.chmod(0o644)
    r = _run(tmp_path, [str(f)])
    assert r.start_error and "permission denied" in r.start_error


def test_bad_cwd_is_start_error(tmp_path):
    r = _run(tmp_path, ["true"], cwd=str(tmp_path / "missing"))
    assert r.start_error and "working directory" in r.start_error
    assert r.exit_code is None


def test_on_started_exception_kills_child(tmp_path):
    seen = []

    def boom(pid):
        seen.append(pid)
        raise RuntimeError("report failed")

    with pytest.raises(RuntimeError, match="report failed"):
        _run(tmp_path, ["sleep", "60"], on_started=boom)
    assert _wait_gone(seen[0])


# ----------------------------------------------------------------------------- taskenv


def test_build_task_env_allow_list():
    base = {
        "PATH": "/bin", "HOME": "/h", "LANG": "C.UTF-8", "TZ": "UTC",
        "PGHOST": "/sock", "PGPASSWORD": "secret", "AWS_SECRET_ACCESS_KEY": "x",
    }
    env = build_task_env(["PGHOST", "PGPORT"], base=base, extra={"QLPG_RUN_ID": "r1"})
    assert env == {"PATH": "/bin", "HOME": "/h", "LANG": "C.UTF-8", "TZ": "UTC",
                   "PGHOST": "/sock", "QLPG_RUN_ID": "r1"}


def test_build_task_env_extra_wins_and_default_path():
    env = build_task_env(None, base={"QLPG_RUN_ID": "evil"}, extra={"QLPG_RUN_ID": "good"})
    assert env == {"QLPG_RUN_ID": "good", "PATH": "/usr/local/bin:/usr/bin:/bin"}
    assert "TMPDIR" in BASELINE_NAMES and "LC_ALL" in BASELINE_NAMES


def test_build_task_env_rejects_bad_names():
    with pytest.raises(ValueError):
        build_task_env(["A=B"], base={})
    with pytest.raises(ValueError):
        build_task_env([], base={}, extra={"X": 1})  # type: ignore[dict-item]


def test_build_task_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("QLPG_TEST_VAR", "v")
    assert build_task_env(["QLPG_TEST_VAR"])["QLPG_TEST_VAR"] == "v"
    assert "QLPG_TEST_VAR" not in build_task_env([])
