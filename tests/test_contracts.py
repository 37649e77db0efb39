"""Layers talk through declared contracts: no package of ``rlplacement`` reads another package's private
attributes (``x._name`` where only another package defines ``_name``), and none probes another
package's objects by name with ``getattr``/``hasattr`` (what one layer needs of another is declared on
the base classes: ``WeightSender``, ``WeightReceiver``, ``TrainerBackend``, and carried on the reports).

Probes of third-party objects (vLLM's configs, torch's modules) are not this rule's business: a name
counts only where some other ``rlplacement`` package defines it and the accessing package does not.
"""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rlplacement"

# third-party objects' attributes read by name whose spelling one of our layers also uses, each with
# whose object it is
THIRD_PARTY = {
    ("rlplacement/engines/vllm/vllm_backend.py", "world_size"): "vLLM's ParallelConfig (0.26 and 0.32 differ)",
    ("rlplacement/engines/vllm/vllm_backend.py", "rank"): "vLLM's ParallelConfig",
    ("rlplacement/engines/copy_plan.py", "_parameters"): "torch.nn.Module's own parameter dict",
    ("rlplacement/engines/copy_plan.py", "_buffers"): "torch.nn.Module's own buffer dict",
    ("rlplacement/engines/vllm/request_stepper.py", "metrics"): "vLLM's RequestOutput",
    ("rlplacement/integrations/miles.py", "colocate"): "Miles' args namespace",
    ("rlplacement/integrations/miles.py", "init_transfer"): "a Miles engine handle, refused by name unless ours",
    ("rlplacement/backends/megatron/model_build.py", "dtype"): "a Hugging Face config",
    ("rlplacement/transfer/group.py", "shutdown"): "torch's ProcessGroup (the method differs by torch version)",
}


def _package(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _defined_names(tree: ast.AST) -> set[str]:
    """Attribute names a module's classes define: methods, class attributes, ``self.x = ...``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(stmt.name)
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return names


def _trees() -> dict[Path, ast.AST]:
    return {path: ast.parse(path.read_text()) for path in ROOT.rglob("*.py")}


# the packages whose classes carry the contracts between layers (senders, receivers, engines, trainer
# backends and workers); a config or a model description read by field name is data, not a contract
LAYERS = {"transfer", "engines", "runtime", "backends", "placement", "integrations"}


def _definers(trees) -> dict[str, set[str]]:
    by_name: dict[str, set[str]] = defaultdict(set)
    for path, tree in trees.items():
        if _package(path) in LAYERS:
            for name in _defined_names(tree):
                by_name[name].add(_package(path))
    return by_name


def _foreign(name: str, package: str, definers) -> bool:
    return bool(definers.get(name)) and package not in definers[name]


def test_no_package_reads_another_packages_private_attributes():
    trees = _trees()
    definers = _definers(trees)
    found = []
    for path, tree in trees.items():
        package = _package(path)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if (str(path.relative_to(ROOT.parent)), node.attr) in THIRD_PARTY:
                continue
            if _foreign(node.attr, package, definers):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} reads .{node.attr} "
                             f"(defined in {sorted(definers[node.attr])})")
    assert not found, "\n".join(found)


def test_no_package_probes_another_packages_objects_by_name():
    trees = _trees()
    definers = _definers(trees)
    found = []
    for path, tree in trees.items():
        package = _package(path)
        rel = str(path.relative_to(ROOT.parent))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                continue
            name = node.args[1]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue
            if (rel, name.value) in THIRD_PARTY:
                continue
            if _foreign(name.value, package, definers):
                found.append(f"{rel}:{node.lineno} {node.func.id}(..., {name.value!r}) "
                             f"(defined in {sorted(definers[name.value])})")
    assert not found, "\n".join(found)


def test_the_rule_catches_a_cross_package_private_read(tmp_path):
    """The walk above sees what it is meant to see: a private name another package defines."""
    tree = ast.parse("def f(sender):\n    return sender._in_flight, getattr(sender, 'exports', None)\n")
    definers = _definers(_trees())
    reads = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    probes = [n.args[1].value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "getattr"]
    assert _foreign(reads[0], "runtime", definers) and _foreign(probes[0], "runtime", definers)
