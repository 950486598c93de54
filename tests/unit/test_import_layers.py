"""The package's layers (docs/ARCHITECTURE.md): no import cycle, imports inside functions counted, and an engine that
imports none of its extensions. Read from the source with ``ast`` (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_vescale"
ENGINE = "lightning_vescale.engine"
# What the package's top level may hold besides packages: the public entry modules (docs/ARCHITECTURE.md).
TOP_LEVEL_MODULES = {"__init__", "_lightning_hook", "accelerate", "convert", "export"}
# docs/ARCHITECTURE.md's layers, bottom up: a module imports its own layer or lower ones only.
LAYERS = {
    "engine": 0,
    "quant": 1, "optim": 1, "memory": 1, "checkpoint": 1, "plan": 1, "state_dict": 1, "models": 1, "data": 1,
    "parallel": 2, "pipeline": 2,
    "lightning": 3, "accelerate": 3, "_lightning_hook": 3, "export": 3, "convert": 3,
    "recipe": 4,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file (but under ``if TYPE_CHECKING``)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle (as a path of modules), or [] (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for root in graph:
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return []


def test_no_import_cycle_counting_imports_inside_functions() -> None:
    cycle = _cycle(_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_engine_imports_nothing_of_the_package_outside_it() -> None:
    graph = _graph()
    engine = {m for m in graph if m == ENGINE or m.startswith(ENGINE + ".")}
    assert len(engine) > 10, sorted(engine)  # the engine's modules were found
    bad = {m: sorted(i for i in graph[m] if i not in engine) for m in engine}
    assert not any(bad.values()), {m: v for m, v in bad.items() if v}


def _layer(module: str) -> int:
    parts = module.split(".")
    return max(LAYERS.values()) + 1 if len(parts) == 1 else LAYERS[parts[1]]  # the package root: above all


def test_every_import_points_down_the_layers() -> None:
    graph = _graph()
    assert {m.split(".")[1] for m in graph if "." in m} <= set(LAYERS), "give each package a layer"
    up = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                if _layer(d) > _layer(m) and not (d == "lightning_vescale" and _layer(m) == LAYERS["recipe"]))
    assert not up, up


def test_models_import_no_engine_applier_or_integration() -> None:
    # Models are plain PyTorch; the Hugging Face loader may make quantized weights (quant) and check state dicts.
    allowed = ("lightning_vescale.models", "lightning_vescale.state_dict", "lightning_vescale.quant")
    graph = _graph()
    bad = {m: sorted(i for i in deps if not i.startswith(allowed))
           for m, deps in graph.items() if m.startswith("lightning_vescale.models")}
    assert not any(bad.values()), {m: v for m, v in bad.items() if v}


def test_the_top_level_holds_packages_and_entry_modules_only() -> None:
    loose = {path.stem for path in PACKAGE.glob("*.py")}
    assert loose == TOP_LEVEL_MODULES, f"move {sorted(loose - TOP_LEVEL_MODULES)} into a package"


def _private_reach_ins(graph: dict[str, set[str]]) -> list[str]:
    """Imports of another package's private module (``lightning_vescale.plan._compile`` from ``parallel``)."""
    def package(m: str) -> str:
        return ".".join(m.split(".")[:2])

    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if package(d) != package(m) and any(part.startswith("_") and part != "__init__"
                                                      for part in d.split(".")[2:]))


def test_packages_import_each_other_through_their_public_modules() -> None:
    # A package's private modules (``_name``) are its own: the others use what its __init__ (or a public
    # module) exports, so a package can reorganize its insides without breaking its neighbours.
    reach_ins = _private_reach_ins(_graph())
    assert not reach_ins, reach_ins
    assert _private_reach_ins({"lightning_vescale.parallel.spmd": {"lightning_vescale.plan._compile"}})  # control


def test_the_cycle_search_finds_a_cycle() -> None:  # the control: a check that cannot fail proves nothing
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []
