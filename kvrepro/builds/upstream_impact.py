"""Which of the release's tests a build's patch stack can affect (test impact selection).

Running all ~960 selected tests on every build is what made ``kvrepro builds test`` take most of an
hour. A test can only change outcome on a build if it executes code the stack changed, so the
release's baseline runs once under coverage.py with one context per test
(kvrepro/builds/upstream_pytest_plugin.py), and each build then runs only the tests that reach a
change. The rule, unit by unit (kvrepro compares the build's ``vllm/`` with the release's, file by
file, with difflib):

* **inside a function** (the changed lines and their replacement lie in the body of the same
  function, by qualified name, in both versions): the tests that executed any line of that
  function's body on the release. A function is the unit, not a line: new code in a branch the
  release never took is only reachable by entering the function.
* **module level** (imports, constants, class bodies, ``def`` lines, decorators, a new or removed
  function, a deleted file), or a function some line of which runs while modules are imported
  (outside every test): the tests that executed any line of that module, of a module that imports
  it (``import``/``from`` statements in the release's ``vllm/``), or whose test file names it.
* **anything else** (a changed file that is not Python under ``vllm/``): every test.
* **always run**: tests that started a process on the release (a child's lines are not in the
  parent's coverage data), every test of a test file the stack changes, the patches' own
  ``Upstream-Test`` tests, and every test of a file that holds a module-, class- or session-scoped
  fixture whenever one of its tests is selected (a shared fixture's lines are recorded under the
  first test that used it).

Limits (also in docs/upstream-tests.md): a name reached by a string (``getattr``, a registry, an
entry point) or re-exported through a third module is not followed; lines that only a
session-scoped fixture of a ``conftest.py`` executes are recorded under the first test that used
it. ``kvrepro builds test --all`` runs every test on every build (the check of this rule).
"""

from __future__ import annotations

import ast
import difflib
import functools
import re
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .records import ChangedCode

NOT_AFFECTED = "not affected: never ran the code the patch stack changed (impact rule, docs/upstream-tests.md)"
_WIDE_FIXTURE = re.compile(r"""@pytest\.fixture\([^)]*scope\s*=\s*["'](module|class|package|session)["']""")


@dataclass(frozen=True)
class _Function:
    qualname: str
    start: int  # the def line (decorators excluded)
    body_start: int
    end: int


def _functions(text: str) -> list[_Function]:
    found: list[_Function] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                found.append(_Function(name, child.lineno, child.body[0].lineno, child.end_lineno or child.lineno))
                walk(child, name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(text), "")
    return found


def _innermost(functions: list[_Function], first: int, last: int, header_too: bool = False) -> _Function | None:
    """The smallest function whose body (or, with ``header_too``, def line onwards) holds lines first..last."""
    holding = [f for f in functions if (f.start if header_too else f.body_start) <= first and last <= f.end]
    return min(holding, key=lambda f: f.end - f.start, default=None)


def _module_name(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def changed_code(release_root: Path, build_root: Path, files: Iterable[str]) -> list[ChangedCode]:
    """What differs between the release's and the build's copy of ``files`` (paths like ``vllm/x.py``)."""
    units: list[ChangedCode] = []
    for rel in dict.fromkeys(files):
        old_path, new_path = release_root / rel, build_root / rel
        old = old_path.read_text() if old_path.exists() else None
        new = new_path.read_text() if new_path.exists() else None
        if old == new:
            continue
        if not rel.endswith(".py") or not rel.startswith(("vllm/", "tests/")):
            units.append(ChangedCode(rel, "other", "", "not Python under vllm/: every test"))
            continue
        if rel.startswith("tests/"):
            units.append(ChangedCode(rel, "test file", "", "every test of this file"))
            continue
        if old is None:
            units.append(ChangedCode(rel, "new file", "", "reached only through changed importers"))
            continue
        if new is None:
            units.append(ChangedCode(rel, "module", "", "deleted"))
            continue
        old_lines, new_lines = old.splitlines(), new.splitlines()
        old_functions, new_functions = _functions(old), _functions(new)
        seen: set[tuple[str, str]] = set()
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False).get_opcodes():
            if tag == "equal":
                continue
            if i2 > i1 and j2 > j1:  # replaced
                before, after = _innermost(old_functions, i1 + 1, i2), _innermost(new_functions, j1 + 1, j2)
            elif j2 > j1:  # inserted after old line i1
                before, after = _innermost(old_functions, i1, i1, header_too=True), _innermost(new_functions, j1 + 1, j2)
            else:  # deleted; the build's line j1 comes before the gap
                before, after = _innermost(old_functions, i1 + 1, i2), _innermost(new_functions, j1, j1, header_too=True)
            if before is not None and after is not None and before.qualname == after.qualname:
                unit = ChangedCode(rel, "function", before.qualname, "", (before.body_start, before.end))
            else:
                unit = ChangedCode(rel, "module", "", f"line {i1 + 1} of the release's file")
            if (unit.scope, unit.name) not in seen:
                seen.add((unit.scope, unit.name))
                units.append(unit)
    return units


def _nums(numbits: bytes) -> list[int]:
    """coverage.py's numbits: bit i of byte b set means line b * 8 + i was executed."""
    return [b * 8 + i for b, byte in enumerate(numbits) if byte for i in range(8) if byte & (1 << i)]


class CoverageIndex:
    """Which test (coverage context = pytest node id) executed which line of the release's vllm/."""

    def __init__(self, databases: Sequence[Path], release_root: Path):
        self.lines: dict[str, dict[str, set[int]]] = {}  # rel file -> context -> lines
        prefix = str(release_root).rstrip("/") + "/"
        for database in databases:
            with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
                files = {fid: path.removeprefix(prefix) for fid, path in db.execute("select id, path from file")}
                contexts = dict(db.execute("select id, context from context"))
                for fid, cid, bits in db.execute("select file_id, context_id, numbits from line_bits"):
                    self.lines.setdefault(files[fid], {}).setdefault(contexts[cid], set()).update(_nums(bits))

    def tests_in(self, rel: str, first: int = 0, last: int = 10**9) -> tuple[set[str], bool]:
        """(tests that executed a line of ``rel`` in first..last, whether import time did too)."""
        tests, at_import = set(), False
        for context, lines in self.lines.get(rel, {}).items():
            if any(first <= line <= last for line in lines):
                if context:
                    tests.add(context)
                else:
                    at_import = True
        return tests, at_import


@functools.lru_cache(maxsize=None)
def _text(path: Path) -> str:
    return path.read_text(errors="replace")


@functools.lru_cache(maxsize=4)
def _sources(release_root: Path) -> tuple[Path, ...]:
    return tuple(sorted((release_root / "vllm").rglob("*.py")))


def _importers(release_root: Path, module: str) -> list[str]:
    """Files of the release's vllm/ with an import statement naming ``module``."""
    parent, _, leaf = module.rpartition(".")
    pattern = re.compile(rf"^\s*(import\s+{re.escape(module)}\b|from\s+{re.escape(module)}\s+import\b|"
                         rf"from\s+{re.escape(parent)}\s+import\s+(\([^)]*|[^(#\n]*)\b{re.escape(leaf)}\b)", re.M)
    return [str(path.relative_to(release_root)) for path in _sources(release_root) if pattern.search(_text(path))]


def affected_tests(units: Sequence[ChangedCode], index: CoverageIndex, release_root: Path, tests_root: Path,
                   candidates: Sequence[str], spawned: Iterable[str]) -> dict[str, str]:
    """The candidates the rule selects for a build, each with why."""
    why: dict[str, str] = {}
    candidate_set = set(candidates)

    def add(tests: Iterable[str], reason: str) -> None:
        for test in tests:
            if test in candidate_set:
                why.setdefault(test, reason)

    for test in spawned:
        add([test], "started a process on the release (its child is not measured)")
    for unit in units:
        label = f"{unit.file}" + (f" {unit.name}" if unit.name else "")
        if unit.scope == "other":
            add(candidates, f"{label} changed: not Python, every test")
        elif unit.scope == "test file":
            add([c for c in candidates if c.split("::")[0] == unit.file], f"{label}: the stack changes this test file")
        elif unit.scope == "function":
            tests, at_import = index.tests_in(unit.file, *unit.lines)
            if not at_import:
                add(tests, f"ran {label} (changed)")
                continue
        if unit.scope in ("module", "function", "new file"):
            module = _module_name(unit.file)
            files = [unit.file] + _importers(release_root, module)
            for rel in files:
                add(index.tests_in(rel)[0], f"ran {rel}, which is or imports {module} (module-level change)")
            naming = {file for file in {c.split("::")[0] for c in candidates} if module in _text(tests_root / file)}
            add([c for c in candidates if c.split("::")[0] in naming], f"its test file names {module}")
    # a wider-scoped fixture's lines belong to the first test that used it: keep such files whole
    for file in {t.split("::")[0] for t in why}:
        if _WIDE_FIXTURE.search(_text(tests_root / file)):
            add([c for c in candidates if c.split("::")[0] == file], f"{file} shares a module/session fixture")
    return why
