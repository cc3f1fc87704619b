"""Count kvrepro's modules, the imports between them, import circles and imports of a later stage.

    python scripts/import_graph.py [--json]

The pipeline's order is the folder order (``STAGES`` below): a module may import its own stage,
an earlier one, or the shared base modules; an import of a later stage is a layering defect, and
so is any circle between modules. Function-level imports count too (they are still dependencies).
Exit code 1 if any later-stage import or circle is found, so CI can keep it at zero.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvrepro"

# Shared modules any stage may import (no pipeline knowledge): rank 0.
BASE = {"__init__", "errors", "paths", "secrets", "stopping", "scratch", "lifetime", "versions", "records"}
# Pipeline stages in order; the later-stage rule compares these ranks.
STAGES = ["spec", "builds", "deploy", "engine", "loadgen", "classify", "results", "report",
          "matrix", "bisect", "minimize", "suite", "triage", "explore", "release", "cli"]
# Orchestrators on top may import each other's records but are all "after report".
TOP = {"matrix", "bisect", "minimize", "suite", "triage", "explore", "release"}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "data" not in p.parts}


def resolve(importer: str, is_package: bool, node: ast.ImportFrom | ast.Import, known: set[str]) -> list[str]:
    targets: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = importer.split(".")
            base = base if is_package else base[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [prefix + "." + a.name for a in node.names] + [prefix]
    for name in names:
        # the longest known module the name lies in ("from .x import y" is module x.y or x's attribute y)
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name.startswith("kvrepro") and name not in targets:
            targets.append(name)
    if isinstance(node, ast.ImportFrom) and len(targets) > 1:
        # "from .x import y": keep x.y when it is a module, drop the bare package x
        modules = [t for t in targets if t != targets[-1]] or targets
        targets = list(dict.fromkeys(modules))
    return targets


def edges(modules: dict[str, Path], package: Path = PACKAGE) -> list[Edge]:
    known = set(modules)
    found: set[Edge] = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in resolve(name, path.name == "__init__.py", node, known):
                    if target != name and not (name.startswith(target + ".")):
                        found.add(Edge(name, target))
    return sorted(found, key=lambda e: (e.importer, e.imported))


def stage_of(module: str) -> str:
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    return head


def rank(module: str) -> int:
    stage = stage_of(module)
    if stage in BASE:
        return 0
    if stage in TOP:
        return len(STAGES) - 2
    if stage in STAGES:
        return STAGES.index(stage) + 1
    return -1  # not placed: reported as loose


def later_stage(graph: list[Edge]) -> list[Edge]:
    """The imports of a later stage (orchestrators on top may import each other), and the shared
    base modules' imports of any stage."""
    later = [e for e in graph if rank(e.importer) > 0 and rank(e.imported) > rank(e.importer)
             and not (stage_of(e.importer) in TOP and stage_of(e.imported) in TOP)]
    return later + [e for e in graph if rank(e.importer) == 0 and rank(e.imported) > 0 and e.importer != "kvrepro"]


def circles(names: list[str], graph: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    adjacency: dict[str, list[str]] = {n: [] for n in names}
    for e in graph:
        adjacency[e.importer].append(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in adjacency[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for n in names:
        if n not in index:
            visit(n)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    modules = all_modules()
    graph = edges(modules)
    # package __init__ files that only re-export count as part of their package, not as a circle member
    later = later_stage(graph)
    loose = sorted(m for m in modules if m.count(".") == 1 and modules[m].name != "__init__.py")
    folders = sorted({m.split(".")[1] for m in modules if m.count(".") >= 2})
    cycles = circles(sorted(modules), graph)
    summary = {
        "modules": len(modules),
        "imports_between_modules": len(graph),
        "loose_top_level_modules": len(loose),
        "loose": loose,
        "stage_folders": folders,
        "later_stage_imports": [asdict(e) for e in later],
        "circles": cycles,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"modules: {summary['modules']}  imports between them: {summary['imports_between_modules']}")
        print(f"loose at the top level ({len(loose)}): {', '.join(m.split('.')[1] for m in loose)}")
        print(f"folders: {', '.join(folders)}")
        print(f"imports of a later stage: {len(later)}")
        for e in later:
            print(f"  {e.importer} -> {e.imported}")
        print(f"circles: {len(cycles)}")
        for c in cycles:
            print("  " + " <-> ".join(c))
    return 1 if later or cycles else 0


if __name__ == "__main__":
    raise SystemExit(main())
