"""The package's import directions (STYLE.md, "Dependency direction"), read from the source with
`ast` — every `import`, at the top of a module or inside a function, counts: a lazy import that
closes a circle is still a circle.

- no circles between d3d's modules;
- training (`d3d.train`) imports neither the benchmark nor the engines' loops (`d3d data` decodes
  through the continuous batch, `d3d.batch` and `d3d.run`, which the engines share);
- the benchmark is imported by the CLI only;
- the gate's costs (`d3d.costs`) time the target's step without calling the engines.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "d3d"
ENGINES = ("d3d.engine", "d3d.async_engine", "d3d.generation")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module → the d3d modules it imports (a `from package import name` counts as the submodule
    when `name` is one)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {other for other in found if other in modules and other != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def imports_of(graph: dict[str, set[str]], prefix: str) -> dict[str, list[str]]:
    return {name: sorted(others) for name, others in graph.items() if name == prefix or name.startswith(prefix + ".")}


def test_the_graph_sees_lazy_imports():
    """Calibration: an import inside a function is an edge (the CLI imports its handlers lazily)."""
    assert "d3d.bench.harness" in import_graph()["d3d.cli.bench"]


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_training_imports_neither_the_benchmark_nor_the_engines():
    offending = {name: [other for other in others if other.startswith("d3d.bench") or other in ENGINES]
                 for name, others in imports_of(import_graph(), "d3d.train").items()}
    assert {name: others for name, others in offending.items() if others} == {}


def test_only_the_cli_imports_the_benchmark():
    graph = import_graph()
    users = {name for name, others in graph.items() if any(o.startswith("d3d.bench") for o in others)}
    assert {name for name in users if not name.startswith(("d3d.bench", "d3d.cli"))} == set()


def test_costs_time_the_target_step_without_the_engines():
    assert not set(import_graph()["d3d.costs"]) & set(ENGINES)
    assert "d3d.target_step" in import_graph()["d3d.costs"]
