"""The packages' import graph: no cycles (counting imports inside functions, which would otherwise hide one), no
module too long to read, and every module importable first in a fresh interpreter."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("inkling_jax", "pallas_kernels", "serve", "train", "plan", "benchmarks")
MAX_LINES = 360


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else ():
            if path.name.startswith("test_") or path.name == "conftest.py":
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """The project modules `name` imports, anywhere in its file; `from pkg import mod` counts as importing mod."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _find_cycle(graph) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycles():
    graph = _graph()
    assert len(graph) > 50  # the walk found the packages
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# What each package may import besides itself: the kernels and the model know nothing of serving, training or
# the tools built on them (serve and train use each other: the engine reads train's adapters, RL runs the engine).
MAY_IMPORT = {"pallas_kernels": set(), "inkling_jax": {"pallas_kernels"},
              "serve": {"pallas_kernels", "inkling_jax", "train"}, "train": {"pallas_kernels", "inkling_jax", "serve"},
              "plan": {"pallas_kernels", "inkling_jax", "serve", "train"}, "benchmarks": set(PACKAGES)}


def test_packages_import_only_the_layers_below_them():
    wrong = sorted(f"{name} -> {target}" for name, targets in _graph().items() for target in targets
                   if (low := target.split(".")[0]) != name.split(".")[0] and low not in MAY_IMPORT[name.split(".")[0]])
    assert not wrong, "imports against the layering: " + ", ".join(wrong)


def test_modules_are_short():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("package", [p for p in PACKAGES if (ROOT / p).is_dir()])
def test_every_module_imports(package):
    """Every module of the package imported in one fresh interpreter, those that import the most first (with no
    cycles, the order cannot matter; this catches a broken import in a module no test touches)."""
    graph = _graph()
    names = sorted((n for n in graph if n.split(".")[0] == package and not n.endswith("__main__")),
                   key=lambda n: (-len(graph[n]), n))  # a __main__ runs its command when imported
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
