"""The package's layering: one direction of knowledge, no import cycle.

Public modules -> ``_core`` -> ``_bridge`` (and ``_loopside``, the owner's
async library it drives: asyncio or trio) -> ``_native`` (through
``_loader``). Every import statement counts, at any depth of the file
(function-level and ``TYPE_CHECKING`` ones too): they are found by parsing the
sources, not by importing them.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import aiokvcache

PKG = Path(aiokvcache.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = mod.split(".")
        if not is_pkg:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    out = [base]
    for alias in node.names:
        out.append(f"{base}.{alias.name}")  # `from pkg import module`
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (every import statement)."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = _resolve(mod, is_pkg, node)
            for name in names:
                # The deepest known module the name is or lies in.
                while name and name not in known:
                    name = name.rpartition(".")[0]
                if name and name != mod and name.startswith("aiokvcache"):
                    deps.add(name)
        # A package's parents are imported implicitly, not by this file.
        graph[mod] = {d for d in deps if not mod.startswith(d + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


#: Cross-cutting modules at the bottom: UCX's log capture, the per-call timing
#: hooks. The standard library and the native module only, so any layer may
#: call them.
LEAVES = ("_ucxlog", "_telemetry")


def _absolute_imports(path: Path) -> set[str]:
    """Every name a file's absolute imports name: modules, and
    ``module.name`` for each ``from module import name``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_the_leaves_import_only_the_native_module() -> None:
    graph = import_graph()
    native = {"aiokvcache._loader", "aiokvcache._native"}
    missing = [leaf for leaf in LEAVES if f"aiokvcache.{leaf}" not in graph]
    assert not missing, f"a leaf the rule names is gone: {missing}"
    bad = []
    for leaf in LEAVES:
        mod = f"aiokvcache.{leaf}"
        if graph[mod] - native:
            bad.append(f"{mod} imports {sorted(graph[mod] - native)}")
        tops = {n.split(".")[0] for n in _absolute_imports(PKG / f"{leaf}.py")}
        foreign = {n for n in tops if n not in sys.stdlib_module_names and n != "aiokvcache"}
        if foreign:
            bad.append(f"{mod} imports {sorted(foreign)} (not the standard library)")
    assert not bad, f"a leaf imports more than the standard library and the native module: {bad}"


def test_the_leaf_check_rejects_a_third_party_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """import_graph() keeps aiokvcache's own modules only: a leaf importing
    numpy or prometheus_client passed a check that read nothing else."""
    pkg = tmp_path / "aiokvcache"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_loader.py").write_text("native = None\n")
    (pkg / "_ucxlog.py").write_text("from ._loader import native\n")
    # A leaf that pulls a third-party package in (and with it, its import
    # time and its failure modes, into every layer that uses the leaf).
    (pkg / "_telemetry.py").write_text("import logging\nimport prometheus_client\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    assert "aiokvcache._telemetry" in import_graph()
    with pytest.raises(AssertionError):
        test_the_leaves_import_only_the_native_module()


def _short(mod: str) -> str:
    return mod.removeprefix("aiokvcache").lstrip(".")


def _layer(mod: str) -> int:
    short = _short(mod)
    # _ucxlog and _telemetry are leaves every layer may use: they import
    # nothing but the native module (test_the_leaves_import_only_the_native_module).
    if short in LEAVES or short in ("_native", "_loader"):
        return 0
    if short == "_bridge" or short == "_loopside" or short.startswith("_loopside."):
        return 1
    if short == "_core" or short.startswith("_core."):
        return 2
    return 3  # public (and the tools beside them)


@pytest.mark.parametrize("layer,name", [(0, "native"), (1, "bridge"), (2, "core")])
def test_nothing_below_knows_what_is_above(layer: int, name: str) -> None:
    graph = import_graph()
    bad = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        if _layer(m) == layer
        for d in deps
        if _layer(d) > layer
    ]
    assert not bad, f"the {name} layer imports upward: {bad}"


#: The core's planes, bottom up: each imports only the planes before it
#: (its ``__init__`` says what it holds). The modules at the core's top
#: (``runtime``, ``caches``) assemble them.
CORE_PLANES = ("model", "config", "wire", "memory", "peers", "transfer")
MAX_CORE_TOP_MODULES = 6


def _plane(mod: str) -> str | None:
    parts = mod.split(".")
    if len(parts) < 3 or parts[1] != "_core":
        return None
    return parts[2]


def test_the_core_is_cut_into_its_planes() -> None:
    core = PKG / "_core"
    packages = sorted(p.name for p in core.iterdir() if (p / "__init__.py").is_file())
    assert packages == sorted(CORE_PLANES), f"the core's subpackages are not its planes: {packages}"
    top = sorted(p.name for p in core.glob("*.py"))
    assert len(top) <= MAX_CORE_TOP_MODULES, f"too many modules at the core's top: {top}"
    assert all((core / p / "__init__.py").read_text().startswith('"""') for p in CORE_PLANES)


def test_each_core_plane_imports_only_the_planes_below() -> None:
    graph = import_graph()
    bad = []
    for m, deps in graph.items():
        here = _plane(m)
        if here not in CORE_PLANES:
            continue
        for d in deps:
            there = _plane(d)
            if there is None or there == here:
                continue
            if there not in CORE_PLANES or CORE_PLANES.index(there) > CORE_PLANES.index(here):
                bad.append(f"{m} ({here}) imports {d} ({there})")
    assert not bad, f"a core plane imports upward: {bad}"


# The tools beside the library: they use it as a user would, through its public
# modules only.
TOOLS = ("aiokvcache.bench", "aiokvcache.__main__", "aiokvcache._benchpeer")
#: What the tools share beside the public API: the JSON-lines protocol of
#: their child processes (standard library only, nothing of the library).
PLUMBING = ("aiokvcache._child",)
PUBLIC = (
    "aiokvcache",
    "aiokvcache.errors",
    "aiokvcache.options",
    "aiokvcache.layerwise",
    "aiokvcache.info",
    "aiokvcache.metrics",
    "aiokvcache.testing",
    "aiokvcache.testing.vllm",
    "aiokvcache.testing.netns",
    "aiokvcache.bench",
)


def _public(mod: str) -> bool:
    return (
        mod in PUBLIC
        or mod in PLUMBING
        or mod in TOOLS
        or mod == "aiokvcache.integrations.vllm"
    )


def test_the_tools_use_only_the_public_api() -> None:
    graph = import_graph()
    bad = [f"{m} imports {d}" for m in TOOLS for d in graph[m] if not _public(d)]
    assert not bad, f"a tool reaches past the public API: {bad}"


def test_the_plumbing_knows_nothing_of_the_library() -> None:
    graph = import_graph()
    bad = [f"{m} imports {d}" for m in PLUMBING for d in graph[m]]
    assert not bad, f"the tools' plumbing imports the library: {bad}"


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        m = todo.pop()
        for d in graph.get(m, ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_the_cli_does_not_import_the_test_harness() -> None:
    # bench and its decode side are product: they run without the testing
    # module (nor anyio, nor the pytest plugin).
    graph = import_graph()
    for tool in TOOLS:
        harness = {
            m
            for m in _reachable(graph, tool)
            if m.startswith(("aiokvcache.testing", "aiokvcache.pytest_plugin"))
        }
        assert not harness, f"{tool} imports {sorted(harness)}"


def test_the_examples_use_only_the_public_api() -> None:
    examples = PKG.parents[1] / "examples"
    known = set(import_graph())
    bad = []
    for path in sorted(examples.rglob("*.py")):
        for name in _absolute_imports(path):
            if name.split(".")[0] != "aiokvcache":
                continue
            # `from aiokvcache import LLMRole` names an object, not a module.
            while name not in known and "." in name:
                name = name.rpartition(".")[0]
            if not _public(name):
                bad.append(f"{path.relative_to(examples)} imports {name}")
    assert not bad, f"an example reaches past the public API: {bad}"


def test_no_class_name_is_defined_twice_in_the_package() -> None:
    # One name, one thing: a reader (and a traceback) never has to ask which
    # Registry, which Links.
    where: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(PKG)))
    twice = {name: files for name, files in where.items() if len(files) > 1}
    assert not twice, f"class names defined more than once: {twice}"


#: What no part of the transfer agent may import: a serving engine, or the
#: glue of one (the agent is the seam every engine's glue uses).
ENGINES = ("vllm", "sglang", "torch")


def test_the_transfer_agent_knows_no_serving_engine() -> None:
    graph = import_graph()
    agent = "aiokvcache.integrations.agent"
    bad = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        if m == agent or m.startswith(agent + ".")
        for d in deps
        if d.startswith("aiokvcache.integrations") and not d.startswith(agent)
    ]
    for path in (PKG / "integrations" / "agent").rglob("*.py"):
        tops = {n.split(".")[0] for n in _absolute_imports(path)}
        bad += [f"{path.name} imports {t}" for t in sorted(tops) if t in ENGINES]
    assert not bad, f"the transfer agent imports an engine or its glue: {bad}"


# The size rule: a class, a function or a file past these is doing more than
# one job; cut it along its seams.
MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_FILE_LINES = 450, 60, 800


def oversized(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(root.parent)
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{rel}: {lines} lines (file)")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            else:
                continue
            assert node.end_lineno is not None
            size = node.end_lineno - node.lineno + 1
            if size > limit:
                found.append(f"{rel}:{node.lineno} {node.name}: {size} lines")
    return found


def test_no_class_function_or_file_in_the_package_is_oversized() -> None:
    found = oversized(PKG)
    assert not found, "over the size rule:\n" + "\n".join(found)


def test_the_size_rule_finds_oversized_code(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (pkg / "big.py").write_text(f"def f():\n{body}\n")
    (pkg / "small.py").write_text("def g():\n    return 1\n")
    assert oversized(pkg) == [f"pkg/big.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
