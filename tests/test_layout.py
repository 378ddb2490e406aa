"""The house's shape, read from the code: arrows point one way (flows -> tasks -> trainer -> lmforge), no module
imports itself back through others, and no module outside tests/ grows past what one sitting can read.

Imports inside functions and `if TYPE_CHECKING:` blocks count: they are arrows a reader has to follow too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("lmforge", "trainer", "tasks", "flows")  # lowest first: a module may import its own layer and those below
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in LAYERS:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a `from pkg import name` names the submodule when there is one)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in LAYERS and (target := resolve(name)) and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert cycles(import_graph()) == [], "modules that import each other, directly or through others"


def test_arrows_point_down():
    """flows -> tasks -> trainer -> lmforge: a lower layer never imports a higher one. `tasks/__init__.py` imports
    its own stage modules only."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = sorted(f"{mod} -> {target}" for mod, targets in import_graph().items() for target in targets
                    if rank[target.split(".")[0]] > rank[mod.split(".")[0]])
    assert upward == []


@pytest.mark.parametrize("folder", [*LAYERS, "bench", "docs"])
def test_no_long_modules(folder):
    long = sorted(f"{p.relative_to(ROOT)}: {n}" for p in (ROOT / folder).rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert long == [], f"split these along a real seam (at most {MAX_LINES} lines a module)"


def test_no_test_module_imports_another():
    """What two test modules share lives in tests/helpers.py (or a fixture in tests/conftest.py): an import of one
    test module by another, at any depth of the file, is found here."""
    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name} imports {n}" for n in names if n.startswith("tests.test_")]
    assert found == []
