"""The import picture of a source tree, made from the code's own imports (read with `ast`; nothing is imported).

    python -m tests.support.import_graph server/src/loraswap/server          # floors, arrows, circles
    python -m tests.support.import_graph server/src/loraswap/server --dot    # the same as Graphviz: | dot -Tsvg

Each module is a node; an arrow runs from a module to each module of the tree it imports, anywhere in it (at the
top, inside a function, under TYPE_CHECKING): `from a.b import c` points at a.b.c where that is a module, else at
a.b. A circle is a set of modules that reach each other. Floors are counted from the bottom: a module stands one
floor above the highest module it imports, so an arrow that runs back up (to its own floor or above) exists only
inside a circle.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path


def source_root(folder: Path) -> Path:
    """The folder module names count from: the nearest `src` above `folder`, else the one above its packages."""
    for parent in folder.parents:
        if parent.name == "src":
            return parent
    while (folder / "__init__.py").exists():
        folder = folder.parent
    return folder


def module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` (the text of `module`) imports, anywhere in it, by absolute name.

    `from a.b import c` gives both a.b and a.b.c, as c may be a module; relative imports are resolved.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def import_targets(source: str, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of `modules` that `source` imports: `from a.b import c` points at a.b.c where that is one of
    them, else at a.b."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.update({name} if name in modules else {base} & modules)
    return found


@dataclass(frozen=True)
class ImportGraph:
    arrows: dict[str, set[str]]  # module -> the modules of the tree it imports

    @classmethod
    def of(cls, root: Path) -> ImportGraph:
        """The modules under `root` (a package folder) and their imports of each other."""
        src = source_root(root.resolve())
        paths = {module_name(path, src): path for path in sorted(root.resolve().rglob("*.py"))}
        arrows: dict[str, set[str]] = {}
        for module, path in paths.items():
            arrows[module] = import_targets(path.read_text(), module, path.name == "__init__.py", set(paths)) - {module}
        return cls(arrows)

    def circles(self) -> list[list[str]]:
        """The sets of modules that reach each other (strongly connected, more than one module), each sorted."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[list[str]] = []

        def visit(node: str) -> None:
            index[node] = low[node] = len(index)
            stack.append(node)
            on_stack.add(node)
            for target in sorted(self.arrows[node]):
                if target not in index:
                    visit(target)
                    low[node] = min(low[node], low[target])
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))

        for node in sorted(self.arrows):
            if node not in index:
                visit(node)
        return sorted(found)

    def floors(self) -> dict[str, int]:
        """Each module's floor: 1 for one that imports nothing of the tree, else one above its highest import
        (a circle's modules share the floor above everything they import from outside it)."""
        circle_of = {member: tuple(circle) for circle in self.circles() for member in circle}
        floors: dict[str, int] = {}

        def floor(node: str) -> int:
            if node not in floors:
                members = circle_of.get(node, (node,))
                for member in members:
                    floors[member] = 0  # in progress: an arrow inside the circle adds nothing
                below = [floor(t) for member in members for t in self.arrows[member] if t not in members]
                for member in members:
                    floors[member] = 1 + max(below, default=0)
            return floors[node]

        for node in sorted(self.arrows):
            floor(node)
        return floors

    def arrows_back_up(self) -> list[tuple[str, str]]:
        """The arrows from a module to one on its own floor or above."""
        floors = self.floors()
        return sorted(
            (source, target)
            for source, targets in self.arrows.items()
            for target in targets
            if floors[target] >= floors[source]
        )

    def dot(self) -> str:
        lines = ["digraph imports {", "  rankdir=BT;"]
        lines += [
            f'  "{source}" -> "{target}";' for source in sorted(self.arrows) for target in sorted(self.arrows[source])
        ]
        return "\n".join([*lines, "}"])

    def report(self) -> str:
        floors = self.floors()
        arrows = sum(map(len, self.arrows.values()))
        summary = (
            f"{len(self.arrows)} modules, {arrows} arrows, {max(floors.values(), default=0)} floors,"
            f" {len(self.circles())} circles, {len(self.arrows_back_up())} arrows back up"
        )
        lines = [summary]
        lines += [f"circle: {' <-> '.join(circle)}" for circle in self.circles()]
        lines += [f"back up: {source} -> {target}" for source, target in self.arrows_back_up()]
        for number in sorted(set(floors.values()), reverse=True):
            lines.append(f"floor {number:2d}: " + ", ".join(sorted(m for m, f in floors.items() if f == number)))
        return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a package folder, e.g. server/src/loraswap/server")
    parser.add_argument("--dot", action="store_true", help="print Graphviz instead of floors")
    args = parser.parse_args()
    graph = ImportGraph.of(args.root)
    print(graph.dot() if args.dot else graph.report())


if __name__ == "__main__":
    main()
