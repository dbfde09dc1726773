"""The package drawn by its imports: ``python -m tests.import_graph`` prints its floors, arrows and
circles, and the rooms' diagram that docs/architecture.md shows (tests/test_architecture.py keeps
the page equal to it).

A module is a node; each ``import`` of another of the package's modules (anywhere in the file, also
under ``TYPE_CHECKING``) is an arrow. A circle is a group of modules that reach each other; a floor
is a step of the longest path down to a module that imports none of the others. A room is a
private package (``_core``, ``_guard``, ...) or a module at the top.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import swe_flush_sync

PACKAGE = Path(swe_flush_sync.__file__).resolve().parent  # the package under test: the checkout, or a wheel


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name below it (``_core.flusher``, ``__init__``)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path
    return names


def _imported(tree: ast.Module, name: str, is_package: bool) -> Iterator[str]:
    """The dotted names (below the package) that a module's imports name."""
    here = [] if name == "__init__" else name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1] if node.level > 1 else here
                base = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == PACKAGE.name:
                base = node.module.split(".")[1:]
            else:
                continue
            yield ".".join(base)
            yield from (".".join([*base, alias.name]) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (".".join(alias.name.split(".")[1:]) for alias in node.names
                        if alias.name.split(".")[0] == PACKAGE.name)


def arrows(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module and the package's modules it imports (a package's ``__init__`` by the package's name)."""
    names = module_names(package)
    graph = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = {target for target in _imported(tree, name, path.name == "__init__.py")
                   if target in names and target != name}
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of two or more nodes that reach each other (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's floor: 1 for one that imports none of the others, else one above its highest import
    (the members of a circle share one floor)."""
    group_of = {member: tuple(group) for group in circles(graph) for member in group}
    floor: dict[str, int] = {}

    def of(node: str) -> int:
        if node not in floor:
            group = group_of.get(node, (node,))
            for member in group:
                floor[member] = 0  # (a circle's own arrows are not counted)
            below = {target for member in group for target in graph[member]} - set(group)
            height = 1 + max((of(target) for target in below), default=0)
            for member in group:
                floor[member] = height
        return floor[node]

    for node in graph:
        of(node)
    return floor


def room(name: str) -> str:
    """The room a module stands in: its private package, else itself."""
    return name.split(".")[0]


def rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of rooms: an arrow where a module of one imports a module of another."""
    between: dict[str, set[str]] = {}
    for name, targets in graph.items():
        between.setdefault(room(name), set()).update(room(target) for target in targets if room(target) != room(name))
    return between


def summary(graph: dict[str, set[str]]) -> str:
    """Floors, arrows and circles of modules and of rooms."""
    lines = []
    for what, drawn in (("modules", graph), ("rooms", rooms(graph))):
        found = circles(drawn)
        lines.append(f"{len(drawn)} {what}: {max(floors(drawn).values())} floors, "
                     f"{sum(map(len, drawn.values()))} arrows, {len(found)} circles"
                     + "".join(f"\n  circle: {' <-> '.join(group)}" for group in found))
    return "\n".join(lines)


DRAWN_TOP: Final = ("_hooks", "_recover", "_stub")  # the top modules drawn beside the packages
# What each room may import (docs/architecture.md shows it): each room only rooms below it.
MAY_IMPORT: Final = {
    "_core": {"_version"},
    "_process": {"_core"},
    "_watchdog": {"_core", "_process"},
    "_recover": {"_core", "_process"},
    "_hooks": {"_core", "_watchdog"},
    "_guard": {"_core", "_process", "_watchdog", "_recover"},
    "_cli": {"_core", "_process", "_watchdog", "_recover", "_guard", "_hooks", "_stub", "_version"},
    "_stub": set(),
}


def drawn_rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The rooms the diagram shows (the private packages and ``DRAWN_TOP``) and their arrows, without
    an arrow that two others imply (the public facade, ``_version`` and the test helpers left out)."""
    between = rooms(graph)
    shown = {room(module) for module in graph if "." in module} | set(DRAWN_TOP)
    kept = {name: between[name] & shown for name in shown}

    def reaches(start: str, goal: str, skip: tuple[str, str]) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            for target in kept[node]:
                if (node, target) != skip and target not in seen:
                    if target == goal:
                        return True
                    seen.add(target)
                    todo.append(target)
        return False

    return {name: {target for target in targets if not reaches(name, target, (name, target))}
            for name, targets in kept.items()}


def mermaid(graph: dict[str, set[str]]) -> str:
    """The drawn rooms as a Mermaid flowchart, the lowest floor at the bottom."""
    drawn = drawn_rooms(graph)
    height = floors(drawn)
    lines = ["flowchart BT"]
    for name in sorted(drawn, key=lambda name: (height[name], name)):
        lines.extend(f"    {name} --> {target}" for target in sorted(drawn[name]))
    return "\n".join(lines)


def allowed_table() -> str:
    """``MAY_IMPORT`` as the Markdown table docs/architecture.md shows."""
    rows = ["| room | may import |", "| --- | --- |"]
    order = sorted(MAY_IMPORT, key=lambda name: (len(MAY_IMPORT[name]), name))
    rows.extend(f"| `{name}` | {', '.join(f'`{target}`' for target in sorted(MAY_IMPORT[name])) or 'nothing'} |"
                for name in order)
    return "\n".join(rows)


if __name__ == "__main__":
    drawn = arrows()
    print(summary(drawn))
    print()
    print(mermaid(drawn))
