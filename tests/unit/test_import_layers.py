"""The package's layers (docs/ARCHITECTURE.md): no import cycle, imports inside functions counted, and an engine that
imports none of its extensions. Read from the source with ``ast`` (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_vescale"
ENGINE = {
    "lightning_vescale._api", "lightning_vescale._groups", "lightning_vescale._init", "lightning_vescale._optim_states",
    "lightning_vescale._param_group", "lightning_vescale.clip_grad", "lightning_vescale.collectives",
    "lightning_vescale.dbuffer", "lightning_vescale.fully_shard", "lightning_vescale.group_plan",
    "lightning_vescale.placement", "lightning_vescale.planner", "lightning_vescale.tensor",
}
EXTENSIONS = ("plan", "optim", "quant", "memory", "pipeline", "recipe", "lightning", "accelerate", "checkpoint",
              "parallel", "models", "parallelize")


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


def test_the_engine_imports_none_of_its_extensions() -> None:
    graph = _graph()
    assert set(graph) >= ENGINE, ENGINE - set(graph)
    bad = {m: sorted(i for i in graph[m] if i.removeprefix("lightning_vescale.").split(".")[0] in EXTENSIONS)
           for m in ENGINE}
    assert not any(bad.values()), {m: v for m, v in bad.items() if v}


def test_the_cycle_search_finds_a_cycle() -> None:  # the control: a check that cannot fail proves nothing
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []
