"""The package's layers import one way (docs/ARCHITECTURE.md): read with `ast` from the source of service/, every
import counts (module level, inside functions, under TYPE_CHECKING, relative, `importlib.import_module("service…")`).
No import cycle between modules; every import goes from a module's layer to its own or a lower one; every module of
service/ has a layer. A package's `__init__` running before its submodules is not an import edge."""

from __future__ import annotations

import ast
import functools
import shutil
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[2] / "service"

# Lowest first. An entry names a module or a package (with everything under it); a module's layer is that of its
# longest matching entry. A module may import its own layer and those below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("service", "service.config", "service.schema", "service.errors", "service.tasks"),
    ("service.imaging", "service.observability", "service.engine.protocol"),
    ("service.admission",),
    ("service.engine",),
    ("service.parsing",),
    ("service.pipeline",),
    ("service.jobs",),
    ("service.http",),
    ("service.serve",),
    # clients of the service. batch (`ocr-serve batch`, where present) starts a Serve cluster and runs the pipeline
    # on it; cli's commands start the service, batch and eval; eval talks HTTP through cli's client, so the two share
    # the top layer
    ("service.batch",),
    ("service.cli", "service.eval"),
)
ROOT = "service"  # matches itself only: the root package's __init__ imports nothing


def find_modules(service: Path) -> dict[str, Path]:
    """Dotted name → source file of every module under `service`."""
    found = {}
    for path in sorted(service.rglob("*.py")):
        parts = path.relative_to(service.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The deepest service module `name` (a module, or an attribute of one) lives in."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every service module that `module` imports anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    wanted: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            wanted += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per dot beyond the first
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import name`: the submodule pkg.name where there is one, else pkg itself
            wanted += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in {"import_module", "__import__"}))):
            wanted.append(node.args[0].value)
    found = {_resolve(name, known) for name in wanted if name == ROOT or name.startswith(ROOT + ".")}
    return {name for name in found if name} - {module}


@functools.cache
def import_graph(service: Path = SERVICE) -> dict[str, set[str]]:
    known = find_modules(service)
    return {module: imports_of(module, path, known) for module, path in known.items()}


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matching entry, layer)
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            matches = module == entry or (entry != ROOT and module.startswith(entry + "."))
            if matches and (best is None or len(entry) > best[0]):
                best = (len(entry), index)
    return None if best is None else best[1]


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_through(group, graph) for group in groups]


def _cycle_through(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself inside the group (breadth first)."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    return group


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
                  for module, targets in graph.items() for target in targets
                  if None not in (layer_of(module), layer_of(target)) and layer_of(target) > layer_of(module))


def test_no_import_cycle_between_modules():
    assert cycles_in(import_graph()) == []


def test_every_import_goes_to_the_same_or_a_lower_layer():
    graph = import_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 200  # the whole package was read
    assert upward_imports(graph) == []


def test_every_service_module_has_a_layer():
    assert [module for module in import_graph() if layer_of(module) is None] == []


def test_the_checks_see_an_upward_import_inside_a_function(tmp_path):
    """The three checks on a copy of service/ with one bad import written inside a function (the kind a module-level
    scan would miss): admission reaching up into the HTTP app, which reaches admission through the pipeline; and a
    module outside every layer."""
    copy = tmp_path / "service"
    shutil.copytree(SERVICE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    limits = copy / "admission" / "limits.py"
    limits.write_text(limits.read_text() + "\n\ndef _upward():\n    from ..http.app import create_app  # noqa\n")
    (copy / "stray.py").write_text("import service.errors\n")
    graph = import_graph(copy)

    assert "service.http.app" in graph["service.admission.limits"]
    assert any("service.admission.limits (layer 2) imports service.http.app (layer 7)" == line
               for line in upward_imports(graph))
    (cycle,) = [c for c in cycles_in(graph) if "service.admission.limits" in c]
    assert cycle[0] == cycle[-1] and "service.http.app" in cycle
    assert all(b in graph[a] for a, b in zip(cycle, cycle[1:]))
    assert [module for module in graph if layer_of(module) is None] == ["service.stray"]
