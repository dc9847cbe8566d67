"""Package manifests: ``qinglong-package.yaml`` (or ``.yml`` / ``.toml``).

A package directory holds one manifest that declares the package's Tasks
(argv commands run by workers, never through a shell) and Workflows (DAGs of
Task steps).  :func:`load_package` reads and validates it strictly and returns
immutable dataclasses; every problem raises :class:`ManifestError` naming the
file, the dotted field and the rule that failed, e.g.::

    examples/x/qinglong-package.yaml: tasks.dump.timeout_ms: must be an integer in 1..86400000

Format (YAML shown; TOML has the same structure)::

    package: pg-backup            # required portable id (no ':'), <= 36 bytes
    version: 1.0.0                # required string, 1..64 chars
    publisher: qlpg-examples      # optional portable id, default "local"
    description: ...              # optional string
    tasks:                        # required mapping, 1..256 entries, keys are task ids
      dump:
        command: ["pg_dump", "-Fc", "-f", "dump.pgc"]   # required argv list
        working_directory: scripts   # optional, relative to the package dir; must exist
        timeout_ms: 60000            # optional, 1..86400000, default 600000
        env_names: [PGHOST]          # optional unique env var NAMES (values never here)
        max_output_bytes: 1048576    # optional, >= 1024, default 10485760 (per stream)
        enabled: true                # optional, default true
    workflows:                    # required mapping, >= 1 entries, keys are workflow ids
      backup:
        enabled: true               # optional, default true
        steps:                      # 1..128 steps: step key -> {task, needs}
          dump: {task: dump}
          gzip: {task: compress, needs: [dump]}

Unknown keys are rejected at every level.  Duplicate mapping keys in YAML are
rejected too (PyYAML would otherwise silently keep the last one).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import yaml

__all__ = [
    "ManifestError",
    "TaskSpec",
    "StepSpec",
    "WorkflowSpec",
    "PackageManifest",
    "MANIFEST_NAMES",
    "find_manifest",
    "load_package",
    "parse_manifest",
]

#: Manifest file names tried in order inside a package directory.
MANIFEST_NAMES = ("qinglong-package.yaml", "qinglong-package.yml", "qinglong-package.toml")

#: Portable id without ':' so that ``pkg:<package>:<task>`` parses unambiguously.
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,35}$")
STEP_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

MAX_TASKS = 256
MAX_STEPS = 128
MAX_VERSION_LEN = 64
MAX_DESCRIPTION_LEN = 4096
MAX_ENV_NAMES = 128
MAX_ARGV = 1024
MAX_ARG_LEN = 32768
TIMEOUT_MIN_MS = 1
TIMEOUT_MAX_MS = 86_400_000
DEFAULT_TIMEOUT_MS = 600_000
MIN_OUTPUT_BYTES = 1024
DEFAULT_MAX_OUTPUT_BYTES = 10 * 1024 * 1024

ID_RULE = "must be a portable id matching ^[A-Za-z0-9][A-Za-z0-9._-]{0,35}$"
STEP_KEY_RULE = "must be a step key matching ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class ManifestError(ValueError):
    """A manifest violates the format.

    Attributes: ``path`` (manifest file as given), ``field`` (dotted path such
    as ``tasks.dump.timeout_ms``, or ``-`` for the whole document) and
    ``rule`` (what was expected).  ``str(err)`` is ``"<path>: <field>: <rule>"``.
    """

    def __init__(self, path: str, field: str, rule: str):
        self.path = str(path)
        self.field = field or "-"
        self.rule = rule
        super().__init__(f"{self.path}: {self.field}: {self.rule}")


@dataclass(frozen=True)
class TaskSpec:
    """One Task of a package.

    ``command`` is the argv tuple (no shell); ``working_directory`` is an
    absolute path or ``None`` (the worker then uses the run directory);
    ``timeout_ms`` is the per-attempt wall-clock limit in milliseconds;
    ``env_names`` are the names of worker environment variables passed
    through to the process; ``max_output_bytes`` caps each of stdout/stderr.
    """

    name: str
    command: tuple[str, ...]
    working_directory: str | None = None
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    env_names: tuple[str, ...] = ()
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    enabled: bool = True

    def execution_template(self) -> dict[str, Any]:
        """Return the JSON execution template published for this Task.

        Shape: ``{"command": [str, ...], "working_directory": str (only if
        set), "timeout_ms": int, "env_names": [str, ...] (only if non-empty),
        "resource_policy": {"max_output_bytes": int}}``.  Fresh lists/dicts
        each call; safe to canonicalise.
        """
        tpl: dict[str, Any] = {"command": list(self.command)}
        if self.working_directory is not None:
            tpl["working_directory"] = self.working_directory
        tpl["timeout_ms"] = self.timeout_ms
        if self.env_names:
            tpl["env_names"] = list(self.env_names)
        tpl["resource_policy"] = {"max_output_bytes": self.max_output_bytes}
        return tpl


@dataclass(frozen=True)
class StepSpec:
    """One Workflow step: ``key`` runs Task ``task`` after all of ``needs`` succeed."""

    key: str
    task: str
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkflowSpec:
    """A Workflow: ``steps`` is a read-only ordered mapping key -> StepSpec."""

    name: str
    enabled: bool
    steps: Mapping[str, StepSpec] = field(default_factory=lambda: MappingProxyType({}))

    def topological_order(self) -> tuple[str, ...]:
        """Step keys in dependency order (Kahn's algorithm, ties broken by
        declaration order, so the result is deterministic).  Raises
        ``ValueError`` on a cycle (cannot happen for a loaded manifest)."""
        order = _topo(self.steps)
        if order is None:
            raise ValueError(f"workflow {self.name!r} has a dependency cycle")
        return order

    def dependents(self) -> dict[str, tuple[str, ...]]:
        """Map step key -> keys of the steps that directly need it."""
        out: dict[str, list[str]] = {k: [] for k in self.steps}
        for k, s in self.steps.items():
            for n in s.needs:
                out[n].append(k)
        return {k: tuple(v) for k, v in out.items()}


@dataclass(frozen=True)
class PackageManifest:
    """A validated package.  ``tasks``/``workflows`` are read-only ordered
    mappings (declaration order); ``directory`` and ``source_path`` are
    absolute."""

    package: str
    version: str
    publisher: str
    description: str | None
    tasks: Mapping[str, TaskSpec]
    workflows: Mapping[str, WorkflowSpec]
    directory: str
    source_path: str

    def task_id(self, task: str) -> str:
        """Runtime Task id ``pkg:<package>:<task>``."""
        if task not in self.tasks:
            raise KeyError(task)
        return f"pkg:{self.package}:{task}"


# --------------------------------------------------------------------------- loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    loader.flatten_mapping(node)
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "unhashable mapping key", key_node.start_mark
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate mapping key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def find_manifest(directory: str | os.PathLike) -> str:
    """Return the path of the manifest inside ``directory`` (first of
    :data:`MANIFEST_NAMES` that exists).  Raises ManifestError if none."""
    d = os.fspath(directory)
    for name in MANIFEST_NAMES:
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
    raise ManifestError(
        os.path.join(d, MANIFEST_NAMES[0]), "-", "no qinglong-package.yaml/.yml/.toml found"
    )


def load_package(directory: str | os.PathLike) -> PackageManifest:
    """Read and validate the manifest in ``directory``.

    Returns a :class:`PackageManifest`; raises :class:`ManifestError` for a
    missing/unreadable file, a YAML/TOML syntax error or any rule violation.
    """
    path = find_manifest(directory)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise ManifestError(path, "-", f"cannot read file: {exc.strerror}") from exc
    if path.endswith(".toml"):
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ManifestError(path, "-", "must be UTF-8") from None
        except tomllib.TOMLDecodeError as exc:
            raise ManifestError(path, "-", f"TOML syntax error: {exc}") from exc
    else:
        try:
            data = yaml.load(raw.decode("utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (safe loader subclass)
        except UnicodeDecodeError:
            raise ManifestError(path, "-", "must be UTF-8") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            problem = getattr(exc, "problem", None)
            if mark is not None and problem:
                detail = f"line {mark.line + 1} column {mark.column + 1}: {problem}"
            else:
                detail = " ".join(str(exc).split())
            raise ManifestError(path, "-", f"YAML syntax error: {detail}") from exc
    return parse_manifest(data, path=path, directory=os.path.dirname(path) or ".")


def parse_manifest(data: Any, *, path: str, directory: str) -> PackageManifest:
    """Validate an already-parsed manifest document (a mapping).

    ``path`` is used in error messages; ``directory`` is the package directory
    against which relative working directories are resolved.
    """
    v = _Validator(path)
    root = v.mapping(data, "", required={"package", "version", "tasks", "workflows"},
                     optional={"publisher", "description"})
    package = v.ident(root["package"], "package")
    version = root["version"]
    if not isinstance(version, str) or not (1 <= len(version) <= MAX_VERSION_LEN) or version.strip() != version:
        v.fail("version", f"must be a non-empty string of at most {MAX_VERSION_LEN} characters without surrounding spaces")
    publisher = v.ident(root.get("publisher", "local"), "publisher")
    description = root.get("description")
    if description is not None and (not isinstance(description, str) or len(description) > MAX_DESCRIPTION_LEN):
        v.fail("description", f"must be a string of at most {MAX_DESCRIPTION_LEN} characters")

    abs_dir = os.path.abspath(directory)

    tasks_raw = root["tasks"]
    if not isinstance(tasks_raw, dict) or not tasks_raw:
        v.fail("tasks", "must be a non-empty mapping of task name -> task")
    if len(tasks_raw) > MAX_TASKS:
        v.fail("tasks", f"must have at most {MAX_TASKS} tasks")
    tasks: dict[str, TaskSpec] = {}
    for name, spec in tasks_raw.items():
        tasks[v.key_id(name, "tasks")] = _task(v, name, spec, abs_dir)

    wf_raw = root["workflows"]
    if not isinstance(wf_raw, dict) or not wf_raw:
        v.fail("workflows", "must be a non-empty mapping of workflow name -> workflow")
    workflows: dict[str, WorkflowSpec] = {}
    for name, spec in wf_raw.items():
        workflows[v.key_id(name, "workflows")] = _workflow(v, name, spec, tasks)

    return PackageManifest(
        package=package,
        version=version,
        publisher=publisher,
        description=description,
        tasks=MappingProxyType(tasks),
        workflows=MappingProxyType(workflows),
        directory=abs_dir,
        source_path=os.path.abspath(path),
    )


class _Validator:
    def __init__(self, path: str):
        self.path = path

    def fail(self, field: str, rule: str):
        raise ManifestError(self.path, field, rule)

    def mapping(self, value: Any, field: str, *, required: set[str], optional: set[str]) -> dict:
        where = field or "-"
        if not isinstance(value, dict):
            self.fail(where, "must be a mapping")
        for k in value:
            if not isinstance(k, str):
                self.fail(where, f"keys must be strings, got {k!r}")
            if k not in required and k not in optional:
                allowed = ", ".join(sorted(required | optional))
                self.fail(_join(field, k), f"unknown key (allowed: {allowed})")
        for k in sorted(required):
            if k not in value:
                self.fail(_join(field, k), "is required")
        return value

    def ident(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not ID_RE.match(value):
            self.fail(field, ID_RULE)
        return value

    def key_id(self, key: Any, parent: str) -> str:
        if not isinstance(key, str) or not ID_RE.match(key):
            self.fail(f"{parent}.{key}", f"name {ID_RULE}")
        return key

    def int_range(self, value: Any, field: str, lo: int, hi: int | None) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            self.fail(field, f"must be an integer in {lo}..{hi}" if hi is not None else f"must be an integer >= {lo}")
        return value

    def boolean(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            self.fail(field, "must be a boolean (true or false)")
        return value


def _join(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key


def _task(v: _Validator, name: str, spec: Any, pkg_dir: str) -> TaskSpec:
    base = f"tasks.{name}"
    spec = v.mapping(spec, base, required={"command"},
                     optional={"working_directory", "timeout_ms", "env_names", "max_output_bytes", "enabled"})

    cmd = spec["command"]
    if not isinstance(cmd, list):
        v.fail(f"{base}.command", "must be a list of strings (argv; no shell)")
    if not cmd:
        v.fail(f"{base}.command", "must be a non-empty list of strings (argv; no shell)")
    if len(cmd) > MAX_ARGV:
        v.fail(f"{base}.command", f"must have at most {MAX_ARGV} elements")
    for i, arg in enumerate(cmd):
        if not isinstance(arg, str) or not arg:
            v.fail(f"{base}.command[{i}]", "must be a non-empty string")
        if "\x00" in arg or len(arg) > MAX_ARG_LEN:
            v.fail(f"{base}.command[{i}]", f"must not contain NUL and be at most {MAX_ARG_LEN} characters")

    wd = spec.get("working_directory")
    if wd is not None:
        if not isinstance(wd, str) or not wd or "\x00" in wd:
            v.fail(f"{base}.working_directory", "must be a non-empty path string")
        resolved = os.path.normpath(os.path.join(pkg_dir, wd))
        if not os.path.isdir(resolved):
            v.fail(f"{base}.working_directory", f"must be an existing directory (resolved to {resolved})")
        wd = resolved

    timeout = v.int_range(spec.get("timeout_ms", DEFAULT_TIMEOUT_MS), f"{base}.timeout_ms",
                          TIMEOUT_MIN_MS, TIMEOUT_MAX_MS)

    names_raw = spec.get("env_names", [])
    if not isinstance(names_raw, list):
        v.fail(f"{base}.env_names", "must be a list of environment variable names (values never go in the manifest)")
    if len(names_raw) > MAX_ENV_NAMES:
        v.fail(f"{base}.env_names", f"must have at most {MAX_ENV_NAMES} names")
    seen: set[str] = set()
    for i, n in enumerate(names_raw):
        if isinstance(n, str) and "=" in n:
            v.fail(f"{base}.env_names[{i}]", "must be a variable name, not NAME=value (values never go in the manifest)")
        if not isinstance(n, str) or not ENV_NAME_RE.match(n):
            v.fail(f"{base}.env_names[{i}]", "must be an environment variable name matching ^[A-Za-z_][A-Za-z0-9_]*$")
        if n in seen:
            v.fail(f"{base}.env_names[{i}]", f"duplicate name {n!r}")
        seen.add(n)

    max_out = v.int_range(spec.get("max_output_bytes", DEFAULT_MAX_OUTPUT_BYTES), f"{base}.max_output_bytes",
                          MIN_OUTPUT_BYTES, None)
    enabled = v.boolean(spec.get("enabled", True), f"{base}.enabled")
    return TaskSpec(
        name=name,
        command=tuple(cmd),
        working_directory=wd,
        timeout_ms=timeout,
        env_names=tuple(names_raw),
        max_output_bytes=max_out,
        enabled=enabled,
    )


def _workflow(v: _Validator, name: str, spec: Any, tasks: Mapping[str, TaskSpec]) -> WorkflowSpec:
    base = f"workflows.{name}"
    spec = v.mapping(spec, base, required={"steps"}, optional={"enabled"})
    enabled = v.boolean(spec.get("enabled", True), f"{base}.enabled")
    steps_raw = spec["steps"]
    if not isinstance(steps_raw, dict) or not steps_raw:
        v.fail(f"{base}.steps", "must be a non-empty mapping of step key -> {task, needs}")
    if len(steps_raw) > MAX_STEPS:
        v.fail(f"{base}.steps", f"must have at most {MAX_STEPS} steps (has {len(steps_raw)})")

    steps: dict[str, StepSpec] = {}
    for key, s in steps_raw.items():
        if not isinstance(key, str) or not STEP_KEY_RE.match(key):
            v.fail(f"{base}.steps.{key}", STEP_KEY_RULE)
        sb = f"{base}.steps.{key}"
        s = v.mapping(s, sb, required={"task"}, optional={"needs"})
        task = s["task"]
        if not isinstance(task, str):
            v.fail(f"{sb}.task", "must be a task name")
        if task not in tasks:
            v.fail(f"{sb}.task", f"refers to unknown task {task!r} (known: {', '.join(tasks)})")
        needs = s.get("needs", [])
        if not isinstance(needs, list):
            v.fail(f"{sb}.needs", "must be a list of step keys")
        seen: set[str] = set()
        for i, n in enumerate(needs):
            if not isinstance(n, str):
                v.fail(f"{sb}.needs[{i}]", "must be a step key string")
            if n == key:
                v.fail(f"{sb}.needs[{i}]", "a step must not depend on itself")
            if n in seen:
                v.fail(f"{sb}.needs[{i}]", f"duplicate dependency {n!r}")
            if n not in steps_raw:
                v.fail(f"{sb}.needs[{i}]", f"refers to unknown step {n!r} of workflow {name!r}")
            seen.add(n)
        steps[key] = StepSpec(key=key, task=task, needs=tuple(needs))

    if _topo(steps) is None:
        cycle = _find_cycle(steps)
        v.fail(f"{base}.steps", "dependency cycle: " + " -> ".join(cycle))
    return WorkflowSpec(name=name, enabled=enabled, steps=MappingProxyType(steps))


def _topo(steps: Mapping[str, StepSpec]) -> tuple[str, ...] | None:
    indeg = {k: len(s.needs) for k, s in steps.items()}
    dependents: dict[str, list[str]] = {k: [] for k in steps}
    for k, s in steps.items():
        for n in s.needs:
            dependents[n].append(k)
    pos = {k: i for i, k in enumerate(steps)}
    ready = [k for k in steps if indeg[k] == 0]
    out: list[str] = []
    while ready:
        ready.sort(key=pos.__getitem__)
        k = ready.pop(0)
        out.append(k)
        for d in dependents[k]:
            indeg[d] -= 1
            if indeg[d] == 0:
                ready.append(d)
    return tuple(out) if len(out) == len(steps) else None


def _find_cycle(steps: Mapping[str, StepSpec]) -> list[str]:
    """Return one cycle as a closed path ``[a, b, ..., a]`` (a needs b needs ... a)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {k: WHITE for k in steps}
    stack: list[str] = []

    def visit(k: str) -> list[str] | None:
        color[k] = GREY
        stack.append(k)
        for n in steps[k].needs:
            if color[n] == GREY:
                return stack[stack.index(n):] + [n]
            if color[n] == WHITE:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        color[k] = BLACK
        return None

    for k in steps:
        if color[k] == WHITE:
            found = visit(k)
            if found:
                return found
    return []  # pragma: no cover - only called when a cycle exists
