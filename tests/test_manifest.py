"""Manifest loading and validation (no database needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from pathlib import Path

import pytest

from qlpg.manifest import (
    ManifestError,
    PackageManifest,
    TaskSpec,
    load_package,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


# ----------------------------------------------------------------------------- examples


def test_pg_backup_example_loads():
    m = load_package(EXAMPLES / "pg-backup")
    assert isinstance(m, PackageManifest)
    assert (m.package, m.version, m.publisher) == ("pg-backup", "1.0.0", "qlpg-examples")
    assert m.directory == str(EXAMPLES / "pg-backup")
    assert m.source_path == str(EXAMPLES / "pg-backup" / "qinglong-package.yaml")
    wf = m.workflows["backup"]
    order = wf.topological_order()
    assert order[0] == "create" and order[-1] == "cleanup"
    assert set(wf.steps["cleanup"].needs) == set(wf.steps) - {"cleanup"}
    for s in ("compress", "checksum", "restore"):
        assert wf.steps[s].needs == ("dump",)
    dump = m.tasks["dump"]
    assert dump.command == ("bash", "dump.sh")
    assert dump.working_directory == str(EXAMPLES / "pg-backup" / "scripts")
    assert dump.env_names == ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE")
    tpl = dump.execution_template()
    assert tpl == {
        "command": ["bash", "dump.sh"],
        "working_directory": str(EXAMPLES / "pg-backup" / "scripts"),
        "timeout_ms": 120000,
        "env_names": ["PGHOST", "PGPORT", "PGUSER", "PGDATABASE"],
        "resource_policy": {"max_output_bytes": 1048576},
    }
    # every script a task runs exists
    for t in m.tasks.values():
        if t.working_directory and t.command[0] == "bash" and t.command[1].endswith(".sh"):
            assert os.path.isfile(os.path.join(t.working_directory, t.command[1]))
    expected = json.loads((EXAMPLES / "pg-backup" / "expected.json").read_text())
    assert set(expected["steps"]) == set(wf.steps)
    assert expected["run"] == "succeeded"


def test_fanout_example_loads_and_expected_is_consistent():
    m = load_package(EXAMPLES / "fanout")
    wf = m.workflows["fanout"]
    assert len(wf.steps) >= 20
    assert len(wf.steps["merge"].needs) == 8
    expected = json.loads((EXAMPLES / "fanout" / "expected.json").read_text())
    assert set(expected["steps"]) == set(wf.steps)
    assert expected["run"] == "failed"
    failed = {k for k, v in expected["steps"].items() if v == "failed"}
    assert failed == {"flaky-check"}
    # skipped == exactly the transitive dependents of the failed step
    deps = wf.dependents()
    closure, todo = set(), list(failed)
    while todo:
        for d in deps[todo.pop()]:
            if d not in closure:
                closure.add(d)
                todo.append(d)
    assert len(closure) >= 3
    assert {k for k, v in expected["steps"].items() if v == "skipped"} == closure
    assert all(v == "succeeded" for k, v in expected["steps"].items() if k not in closure | failed)
    flaky = m.tasks["flaky-check"]
    assert flaky.working_directory is None
    assert "working_directory" not in flaky.execution_template()
    assert "env_names" not in flaky.execution_template()


def test_manifest_is_frozen():
    m = load_package(EXAMPLES / "fanout")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.package = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.tasks["x"] = m.tasks["prepare"]  # type: ignore[index]
    assert isinstance(m.tasks["prepare"].command, tuple)
    assert isinstance(m.workflows["fanout"].steps["merge"].needs, tuple)


def test_topological_order_respects_needs():
    wf = load_package(EXAMPLES / "fanout").workflows["fanout"]
    order = wf.topological_order()
    pos = {k: i for i, k in enumerate(order)}
    assert sorted(order) == sorted(wf.steps)
    for k, s in wf.steps.items():
        for n in s.needs:
            assert pos[n] < pos[k]


# ----------------------------------------------------------------------------- minimal / defaults

MINIMAL = """\
package: demo
version: "1"
tasks:
  hello:
    command: ["echo", "hi"]
workflows:
  main:
    steps:
      a: {task: hello}
"""


def _write(tmp_path: Path, text: str, name: str = "qinglong-package.yaml") -> Path:
    (tmp_path / name).write_text(textwrap.dedent(text))
    return tmp_path


def test_defaults(tmp_path):
    m = load_package(_write(tmp_path, MINIMAL))
    t = m.tasks["hello"]
    assert t == TaskSpec("hello", ("echo", "hi"), None, 600000, (), 10485760, True)
    assert m.publisher == "local"
    assert m.workflows["main"].enabled is True
    assert t.execution_template() == {
        "command": ["echo", "hi"], "timeout_ms": 600000,
        "resource_policy": {"max_output_bytes": 10485760},
    }
    assert m.task_id("hello") == "pkg:demo:hello"


def test_yml_and_toml(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _write(tmp_path / "a", MINIMAL, "qinglong-package.yml")
    _write(tmp_path / "b", """\
        package = "demo"
        version = "1"
        [tasks.hello]
        command = ["echo", "hi"]
        timeout_ms = 5000
        [workflows.main.steps.a]
        task = "hello"
        [workflows.main.steps.b]
        task = "hello"
        needs = ["a"]
        """, "qinglong-package.toml")
    a = load_package(tmp_path / "a")
    b = load_package(tmp_path / "b")
    assert a.tasks["hello"].command == b.tasks["hello"].command
    assert b.tasks["hello"].timeout_ms == 5000
    assert b.workflows["main"].topological_order() == ("a", "b")


def test_missing_manifest(tmp_path):
    with pytest.raises(ManifestError, match="no qinglong-package"):
        load_package(tmp_path)


# ----------------------------------------------------------------------------- malformed

BAD = {
    "unknown_key": (
        MINIMAL.replace('    command: ["echo", "hi"]', '    command: ["echo", "hi"]\n    shell: true'),
        "tasks.hello.shell", "unknown key",
    ),
    "unknown_top_key": (MINIMAL + "extra: 1\n", "extra", "unknown key"),
    "cycle": (
        MINIMAL.replace("      a: {task: hello}",
                        "      a: {task: hello, needs: [c]}\n"
                        "      b: {task: hello, needs: [a]}\n"
                        "      c: {task: hello, needs: [b]}"),
        "workflows.main.steps", "dependency cycle: ",
    ),
    "missing_task": (
        MINIMAL.replace("a: {task: hello}", "a: {task: nope}"),
        "workflows.main.steps.a.task", "unknown task 'nope'",
    ),
    "bad_package_id": (MINIMAL.replace("package: demo", "package: -bad"), "package", "portable id"),
    "package_id_with_colon": (MINIMAL.replace("package: demo", "package: a:b"), "package", "portable id"),
    "bad_task_name": (MINIMAL.replace("  hello:\n", "  hello world:\n").replace("task: hello", "task: hello world"),
                      "tasks.hello world", "portable id"),
    "bad_timeout": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: ["echo", "hi"]\n    timeout_ms: 0'),
        "tasks.hello.timeout_ms", "must be an integer in 1..86400000",
    ),
    "timeout_too_big": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: ["echo", "hi"]\n    timeout_ms: 86400001'),
        "tasks.hello.timeout_ms", "must be an integer in 1..86400000",
    ),
    "timeout_string": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: ["echo", "hi"]\n    timeout_ms: "60"'),
        "tasks.hello.timeout_ms", "must be an integer",
    ),
    "duplicate_needs": (
        MINIMAL.replace("      a: {task: hello}",
                        "      a: {task: hello}\n      b: {task: hello, needs: [a, a]}"),
        "workflows.main.steps.b.needs[1]", "duplicate dependency 'a'",
    ),
    "self_dependency": (
        MINIMAL.replace("a: {task: hello}", "a: {task: hello, needs: [a]}"),
        "workflows.main.steps.a.needs[0]", "must not depend on itself",
    ),
    "unknown_need": (
        MINIMAL.replace("a: {task: hello}", "a: {task: hello, needs: [zz]}"),
        "workflows.main.steps.a.needs[0]", "unknown step 'zz'",
    ),
    "too_many_steps": (
        MINIMAL.replace("      a: {task: hello}",
                        "\n".join(f"      s{i}: {{task: hello}}" for i in range(129))),
        "workflows.main.steps", "at most 128 steps",
    ),
    "env_value_not_name": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: ["echo", "hi"]\n    env_names: ["PGHOST=db.example"]'),
        "tasks.hello.env_names[0]", "not NAME=value",
    ),
    "env_mapping_not_list": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: ["echo", "hi"]\n    env_names: {PGHOST: db}'),
        "tasks.hello.env_names", "must be a list of environment variable names",
    ),
    "env_duplicate": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: ["echo", "hi"]\n    env_names: [A, A]'),
        "tasks.hello.env_names[1]", "duplicate name",
    ),
    "command_string": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: "echo hi"'),
        "tasks.hello.command", "must be a list of strings",
    ),
    "command_empty": (
        MINIMAL.replace('command: ["echo", "hi"]', "command: []"),
        "tasks.hello.command", "must be a non-empty list",
    ),
    "command_empty_arg": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: ["echo", ""]'),
        "tasks.hello.command[1]", "non-empty string",
    ),
    "command_non_string_arg": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: ["sleep", 5]'),
        "tasks.hello.command[1]", "non-empty string",
    ),
    "missing_workflows": (MINIMAL.split("workflows:")[0], "workflows", "is required"),
    "empty_workflows": (MINIMAL.split("workflows:")[0] + "workflows: {}\n", "workflows", "non-empty mapping"),
    "missing_version": (MINIMAL.replace('version: "1"\n', ""), "version", "is required"),
    "version_number": (MINIMAL.replace('version: "1"', "version: 1"), "version", "non-empty string"),
    "bad_step_key": (MINIMAL.replace("a: {task: hello}", "_a: {task: hello}"),
                     "workflows.main.steps._a", "step key"),
    "bad_enabled": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: ["echo", "hi"]\n    enabled: "yes"'),
        "tasks.hello.enabled", "must be a boolean",
    ),
    "small_output_cap": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: ["echo", "hi"]\n    max_output_bytes: 100'),
        "tasks.hello.max_output_bytes", "must be an integer >= 1024",
    ),
    "missing_working_directory": (
        MINIMAL.replace('command: ["echo", "hi"]', 'command: ["echo", "hi"]\n    working_directory: nope'),
        "tasks.hello.working_directory", "must be an existing directory",
    ),
    "yaml_syntax_error": ("package: demo\ntasks: [unclosed\n", "-", "YAML syntax error"),
    "duplicate_yaml_key": (MINIMAL + "package: other\n", "-", "duplicate mapping key 'package'"),
    "not_a_mapping": ("- just\n- a list\n", "-", "must be a mapping"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_manifest(tmp_path, case):
    text, field, rule = BAD[case]
    _write(tmp_path, text)
    with pytest.raises(ManifestError) as ei:
        load_package(tmp_path)
    err = ei.value
    path = str(tmp_path / "qinglong-package.yaml")
    assert err.path == path
    assert err.field == field, str(err)
    assert rule in err.rule, str(err)
    assert str(err) == f"{path}: {field}: {err.rule}"


def test_cycle_error_names_the_cycle(tmp_path):
    text, _, _ = BAD["cycle"]
    _write(tmp_path, text)
    with pytest.raises(ManifestError) as ei:
        load_package(tmp_path)
    # a needs c needs b needs a
    assert ei.value.rule == "dependency cycle: a -> c -> b -> a"


def test_toml_syntax_error(tmp_path):
    _write(tmp_path, "package = \n", "qinglong-package.toml")
    with pytest.raises(ManifestError, match="TOML syntax error"):
        load_package(tmp_path)
