"""The house's shape in numbers, this checkout against an earlier commit, side by side.

    python scripts/house_numbers.py --before house-before
    python scripts/house_numbers.py --before 1f4c62d --json

Why: issue 49 asks for `farm-studio`-style numbers before and after a restructuring (rooms,
arrows, longest functions), measured by the same code on both trees. Everything here is read
with ``ast`` from the source files of each tree (the earlier commit is exported with
``git archive`` into a temporary folder, removed at the end); nothing is imported or run.

Rooms are the stage folders of ``kvrepro/`` and its modules; arrows are the imports between
modules (``scripts/import_graph.py`` resolves them: later-stage imports and circles must stay
0). The rest are the smells the issue named: long functions and the closures inside them,
imports inside functions, record types outside their stage, hand-written JSON methods, string
constants that are Python or YAML source and are filled or edited (a generator by template; a fixed
script run as ``python -c`` is not one), and the largest test file.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_graph  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Function:
    name: str
    lines: int
    closures: int


def _functions(tree: ast.AST, module: str) -> list[Function]:
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str, inside_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                if not inside_function:
                    nested = sum(1 for n in ast.walk(child) if n is not child
                                 and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
                    found.append(Function(f"{module}:{name}", child.end_lineno - child.lineno + 1, nested))
                visit(child, name + ".", True)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", inside_function)
            else:
                visit(child, prefix, inside_function)

    visit(tree, "", False)
    return found


def _looks_like_source(text: str) -> bool:
    """A string constant of a few lines that is itself Python (a def, an import, an assert) or YAML."""
    if text.count("\n") < 2:
        return False
    lines = text.splitlines()
    if any(line.startswith(("def ", "import ", "from ", "class ", "    def ", "    assert ")) for line in lines):
        return True  # Python (a template with {placeholders} need not parse as it stands)
    keyed = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return len(keyed) >= 5 and not any(c in text for c in "{};") \
        and all(":" in line or line.lstrip().startswith("- ") for line in keyed)


def _edited(tree: ast.Module, name: str) -> bool:
    """Whether the module fills or edits the constant ``name`` (format, replace, %, partition...)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name \
                and node.attr in ("format", "format_map", "replace", "partition", "split", "substitute"):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("replace", "partition") \
                and any(isinstance(a, ast.Name) and a.id == name for a in node.args):
            return True
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Name) \
                and node.left.id == name:
            return True
    return False


def measure(root: Path) -> dict:
    package = root / "kvrepro"
    modules = {import_graph.module_name(p, package): p for p in sorted(package.rglob("*.py")) if "data" not in p.parts}
    graph = import_graph.edges(modules, package)
    later = import_graph.later_stage(graph)
    cycles = import_graph.circles(sorted(modules), graph)
    # an arrow into another package's submodule, past its face (its __init__)
    past_face = [e for e in graph if e.imported.count(".") >= 2 and import_graph.stage_of(e.imported) != import_graph.stage_of(e.importer)
                 and (package / e.imported.split(".")[1] / "__init__.py").exists()]
    functions: list[Function] = []
    imports_total = imports_in_functions = 0
    record_types: dict[str, int] = {}
    json_methods = 0
    source_constants: list[str] = []
    lines = 0
    for name, path in modules.items():
        text = path.read_text()
        lines += text.count("\n")
        tree = ast.parse(text, str(path))
        functions += _functions(tree, name.removeprefix("kvrepro."))
        function_nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inner = {id(i) for f in function_nodes for i in ast.walk(f) if isinstance(i, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and import_graph.resolve(name, path.name == "__init__.py", node, set(modules)):
                imports_total += 1
                imports_in_functions += id(node) in inner
            if isinstance(node, ast.ClassDef) and any(
                    (isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass"
                     and any(k.arg == "frozen" for k in d.keywords)) for d in node.decorator_list):
                record_types[name] = record_types.get(name, 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("to_json", "from_json"):
                json_methods += 1
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(value, ast.Constant) and isinstance(value.value, str) and _looks_like_source(value.value) \
                    and isinstance(target, ast.Name) and _edited(tree, target.id):
                source_constants.append(f"{name}:{node.lineno} {target.id}")
    functions.sort(key=lambda f: -f.lines)
    tests = sorted(((p.read_text().count("\n"), p.name) for p in (root / "tests").glob("test_*.py")), reverse=True)
    records_py = package / "records.py"
    return {
        "lines_in_kvrepro": lines,
        "rooms_stage_folders": len({m.split(".")[1] for m in modules if m.count(".") >= 2}),
        "modules": len(modules),
        "arrows_imports_between_modules": len(graph),
        "arrows_into_another_package_past_its_face": len(past_face),
        "later_stage_imports": len(later),
        "circles": len(cycles),
        "functions": len(functions),
        "functions_over_100_lines": sum(f.lines > 100 for f in functions),
        "functions_over_60_lines": sum(f.lines > 60 for f in functions),
        "closures_in_functions_over_60_lines": sum(f.closures for f in functions if f.lines > 60),
        "longest_functions": [f"{f.name} {f.lines} ({f.closures} inner)" for f in functions[:10]],
        "internal_imports": imports_total,
        "internal_imports_inside_functions_pct": round(100 * imports_in_functions / max(imports_total, 1), 1),
        "records_py_lines": records_py.read_text().count("\n") if records_py.exists() else 0,
        "frozen_record_types_in_records_py": record_types.get("kvrepro.records", 0),
        "frozen_record_types_total": sum(record_types.values()),
        "hand_written_to_json_from_json": json_methods,
        "source_templates_filled_or_edited": source_constants,
        "test_files": len(tests),
        "largest_test_files": [f"{n} {c}" for c, n in tests[:3]],
    }


def _export(rev: str, into: Path) -> Path:
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kvrepro", "tests", "scripts"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="HEAD~1", help="the earlier commit (default HEAD~1)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = measure(_export(args.before, Path(tmp)))
    after = measure(ROOT)
    if args.json:
        print(json.dumps({"before": args.before, "numbers": {"before": before, "after": after}}, indent=2))
        return 0
    print(f"{'':48} {'before (' + args.before + ')':>22} {'after (this checkout)':>24}")
    for key, value in before.items():
        if isinstance(value, list):
            print(f"{key}:")
            for side, items in (("before", value), ("after", after[key])):
                print(f"  {side} ({len(items)}):")
                for item in items:
                    print(f"    {item}")
        else:
            print(f"{key:48} {value!s:>22} {after[key]!s:>24}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
