"""overlapkit's import graph read from the source with ``ast``, and the two rules it must keep.

An edge is one ``import`` statement of one module naming another module of the same package,
at module level, inside a function or class, or under ``if TYPE_CHECKING:``: an import for a
type hint never runs, but a reader still follows it, and a circle closed by one is a circle of
concepts (give the lower module a Protocol, or move the shared type below both). Such edges are
marked, and named so in the messages. Relative imports are resolved against the importing
module's package.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.

The rules (``tests/test_import_layers.py``):

- **direction**, by unit: a unit is a sub-package of the root (``overlapkit.ddp``) or a module
  at the root (``overlapkit.cli``); every unit has a layer, and no edge may run from a unit to one
  of a higher layer. Inside a package the same holds among its own sub-packages and root
  modules (``within`` the package, ``unit_of`` relative to it);
- **no circle**: neither among modules (an import circle, even through function-level imports)
  nor among the units of one layer (two packages leaning on each other sideways).

Each violation is reported with the ``file:line`` of the import statements involved.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Edge:
    """``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int
    type_checking: bool = False
    """The import is under ``if TYPE_CHECKING:`` (for type hints only)."""

    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def note(self) -> str:
        return " (under TYPE_CHECKING)" if self.type_checking else ""


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package rooted at ``root`` (the directory holding ``__init__.py``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, each with whether it lies under ``if TYPE_CHECKING:``."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, type_checking = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_checking
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, True) for child in node.body)
            stack.extend((child, type_checking) for child in node.orelse)
            continue
        stack.extend((child, type_checking) for child in ast.iter_child_nodes(node))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """The deepest module of the package that ``name`` (a dotted path) is or lies in."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_edges(root: Path, package: str) -> list[Edge]:
    """Every edge between the modules of ``package`` (see the module docstring)."""
    modules = module_files(root, package)
    edges = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        shown = str(path.relative_to(root.parent))
        is_package = path.name == "__init__.py"
        for node, type_checking in _import_nodes(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = _resolve(module, is_package, node)
                names = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for name in dict.fromkeys(names):
                target = _known(name, modules)
                if target is not None and target != module:
                    edges.append(Edge(module, target, shown, node.lineno, type_checking))
    return edges


def unit_of(module: str, package: str) -> str:
    """The unit of ``module`` among ``package``'s: ``overlapkit.ddp.hooks`` -> ``overlapkit.ddp``
    (package ``overlapkit``); ``overlapkit.train.run.loop`` -> ``overlapkit.train.run`` (package
    ``overlapkit.train``); a module at the package's root is its own unit, the package itself too.
    """
    if module == package:
        return package
    return f"{package}.{module[len(package) + 1 :].split('.')[0]}"


def within(edges: Iterable[Edge], package: str) -> list[Edge]:
    """The edges between two modules of ``package`` (itself or below it)."""

    def inside(module: str) -> bool:
        return module == package or module.startswith(f"{package}.")

    return [e for e in edges if inside(e.source) and inside(e.target)]


def layer_of(unit: str, layers: Mapping[str, int], package: str) -> int | None:
    """``unit``'s layer: its own entry, else the package's default for root modules
    (``"<package>.*"``), else None."""
    if unit in layers:
        return layers[unit]
    if unit != package and "." not in unit[len(package) + 1 :]:
        return layers.get(f"{package}.*")
    return None


def unlayered(modules: Iterable[str], layers: Mapping[str, int], package: str) -> list[str]:
    """Units that have no layer (a new package or root module must be given one)."""
    units = {unit_of(m, package) for m in modules}
    return sorted(u for u in units if layer_of(u, layers, package) is None)


def stale_layers(modules: Iterable[str], layers: Mapping[str, int], package: str) -> list[str]:
    """Units that have a layer but no longer exist (a package was moved or removed)."""
    return sorted(set(layers) - {unit_of(m, package) for m in modules} - {f"{package}.*"})


def upward_imports(edges: Iterable[Edge], layers: Mapping[str, int], package: str) -> list[str]:
    """One message per edge that runs from a unit to a unit of a higher layer."""
    found = []
    for e in edges:
        low, high = unit_of(e.source, package), unit_of(e.target, package)
        low_layer, high_layer = layer_of(low, layers, package), layer_of(high, layers, package)
        if high_layer > low_layer:
            found.append(
                f"{e.where()}: {e.source} (layer {low_layer}, {low}) imports {e.target} "
                f"(layer {high_layer}, {high}){e.note}: an import runs upward"
            )
    return found


def _cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _circle_messages(edges: list[Edge], key: Callable[[str], str], what: str) -> list[str]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        a, b = key(e.source), key(e.target)
        if a != b:
            graph.setdefault(a, set()).add(b)
    messages = []
    for component in _cycles(graph):
        members = set(component)
        inside = [
            e
            for e in edges
            if key(e.source) in members
            and key(e.target) in members
            and key(e.source) != key(e.target)
        ]
        lines = "; ".join(f"{e.where()}: {e.source} imports {e.target}{e.note}" for e in inside)
        messages.append(f"{what} circle {' <-> '.join(component)}: {lines}")
    return messages


def module_circles(edges: Iterable[Edge]) -> list[str]:
    """One message per import circle among modules, naming every import in it."""
    return _circle_messages(list(edges), lambda m: m, "import")


def unit_circles(edges: Iterable[Edge], package: str) -> list[str]:
    """One message per circle among units (packages leaning on each other sideways)."""
    return _circle_messages(list(edges), lambda m: unit_of(m, package), "package")
