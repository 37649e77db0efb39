"""The package's layers point one way: no import circle between modules or between packages.

Every ``rlplacement`` import counts, lazy ones (inside functions) included: a lazy import that
closes a circle still ties two layers together. A module importing its own parent package (which
Python does to import any submodule) is not an edge.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rlplacement"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("rlplacement") else None
                if target and target != mod and target != mod.rpartition(".")[0]:
                    graph[mod].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def _layer(mod: str) -> str:
    """``rlplacement.transfer`` for anything under it; a top-level module (``rlplacement.args``) is its own."""
    return ".".join(mod.split(".")[:2])


def test_no_import_circle_between_modules():
    assert _cycles(_imports(_modules())) == []


def test_no_import_circle_between_packages():
    modules = _modules()
    layers: dict[str, set[str]] = {}
    for mod, targets in _imports(modules).items():
        a = _layer(mod)
        for target in targets:
            b = _layer(target)
            if a != b and "rlplacement" not in (a, b):
                layers.setdefault(a, set()).add(b)
    assert _cycles(layers) == []
