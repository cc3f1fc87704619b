"""A patch's regression tests, taken from the later release whose ``tests/`` carries them.

A backport's own upstream test lives in a newer release's test file, next to helpers that the base
release may not have. kvrepro runs the test unchanged on the base's tree: it writes one test module
per patch into the base's ``tests/`` (beside the file the test came from, so the same conftest
files apply) holding the test functions as written upstream and, for every name they use:

* an import exactly as the later file has it (vLLM, pytest, torch, the standard library);
* ``from <module> import name`` when the base release's test helper module defines that name
  with identical source (the base's own helper);
* otherwise the later release's definition, copied, and listed as a :class:`CopiedHelper` with
  why (not in the base's ``tests/``, or different there). Nothing is edited: a test that needs an
  API the base lacks fails, and says so.

Also here: :func:`later_change`, what a newer release changed in a test function's source.
"""

from __future__ import annotations

import ast
import builtins
import difflib
from dataclasses import dataclass, field
from pathlib import Path

from .records import CopiedHelper

_BUILTINS = set(dir(builtins))


@dataclass
class _Module:
    rel: str  # tests/v1/core/test_scheduler.py
    tree: ast.Module
    text: str
    defs: dict[str, ast.stmt] = field(default_factory=dict)
    imports: dict[str, tuple[ast.stmt, str | None, str]] = field(default_factory=dict)  # name -> (node, tests module, original)

    def source(self, node: ast.stmt) -> str:
        lines = self.text.splitlines(keepends=True)
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return "".join(lines[start - 1:node.end_lineno])


def _read(root: Path, rel: str) -> _Module | None:
    path = root / rel
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    module = _Module(rel, tree, text)
    package = rel.rsplit("/", 1)[0].split("/")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            module.defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        module.defs[name.id] = node
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                dotted = ".".join(base + ([node.module] if node.module else []))
            else:
                dotted = node.module or ""
            tests_module = dotted if dotted.split(".")[0] == "tests" else None
            for alias in node.names:
                module.imports[alias.asname or alias.name] = (node, tests_module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module.imports[alias.asname or alias.name.split(".")[0]] = (node, None, alias.name)
    return module


def _module_file(root: Path, dotted: str) -> str | None:
    rel = dotted.replace(".", "/")
    for candidate in (f"{rel}.py", f"{rel}/__init__.py"):
        if (root / candidate).is_file():
            return candidate
    return None


def _used_names(node: ast.AST) -> list[str]:
    names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # fixtures are parameters
        names += [a.arg for a in node.args.args]
    return list(dict.fromkeys(names))


def _import_node(node: ast.stmt, name: str, original: str) -> ast.stmt:
    """The import of ``name`` as the later file has it (``node``), for that one name."""
    alias = None if name == original.split(".")[0] or name == original else name
    if isinstance(node, ast.Import):
        return ast.Import([ast.alias(original, alias)])
    assert isinstance(node, ast.ImportFrom)
    return ast.ImportFrom(node.module, [ast.alias(original, alias)], node.level)


@dataclass(frozen=True)
class GeneratedModule:
    """A test module written into the base's ``tests/`` for one patch's upstream tests."""

    rel: str  # where it goes, relative to the folder holding tests/
    release: str  # the later release the tests come from
    text: str
    tests: tuple[str, ...]  # node ids in the generated module
    upstream_ids: tuple[str, ...]  # the same tests' ids in the later release
    helpers: tuple[CopiedHelper, ...]
    problems: tuple[str, ...]  # names that could not be carried over (listed, never guessed)


class _Copier:
    """What one generated module holds, gathered name by name: a later release's test and each
    helper it uses, imported from the base where the base has the same code, copied otherwise."""

    def __init__(self, later_root: Path, later_release: str, base_root: Path, base_release: str,
                 rel: str, source: _Module, wanted: set[str]):
        self.later_root, self.later_release = later_root, later_release
        self.base_root, self.base_release = base_root, base_release
        self.rel = rel  # the upstream test file
        self.wanted = wanted  # the tests asked for (top-level names of rel)
        self.modules: dict[str, _Module | None] = {rel: source}
        self.base_modules: dict[str, _Module | None] = {}
        self.imports: list[ast.stmt] = []  # built as nodes; written with ast.unparse
        self.bodies: list[str] = []
        self.helpers: list[CopiedHelper] = []
        self.problems: list[str] = []
        self.emitted: dict[str, str] = {}  # name -> module it was taken from
        self.visiting: set[tuple[str, str]] = set()

    def _later(self, mod_rel: str) -> _Module | None:
        if mod_rel not in self.modules:
            self.modules[mod_rel] = _read(self.later_root, mod_rel)
        return self.modules[mod_rel]

    def _base(self, mod_rel: str) -> _Module | None:
        if mod_rel not in self.base_modules:
            self.base_modules[mod_rel] = _read(self.base_root, mod_rel)
        return self.base_modules[mod_rel]

    def _import(self, node: ast.stmt) -> None:
        if ast.dump(node) not in map(ast.dump, self.imports):
            self.imports.append(node)

    def resolve(self, mod: _Module, name: str) -> None:
        """Carry ``name`` of ``mod`` over, with what it uses."""
        key = (mod.rel, name)
        if key in self.visiting or name in _BUILTINS and name not in mod.defs and name not in mod.imports:
            return
        self.visiting.add(key)
        if name in mod.defs:
            self._definition(mod, name)
        elif name in mod.imports:
            self._imported(mod, name)

    def _definition(self, mod: _Module, name: str) -> None:
        """A name ``mod`` defines: imported from the base when the base has the same code, else copied."""
        node = mod.defs[name]
        text = mod.source(node)
        base_mod = self._base(mod.rel)
        if mod.rel != self.rel and base_mod is not None and name in base_mod.defs \
                and base_mod.source(base_mod.defs[name]) == text:
            self._import(ast.ImportFrom(mod.rel[:-3].replace("/", ".").removesuffix(".__init__"), [ast.alias(name)], 0))
            self.emitted.setdefault(name, mod.rel)
            return
        if self.emitted.get(name, mod.rel) != mod.rel:
            self.problems.append(f"{name}: defined in both {self.emitted[name]} and {mod.rel} of vllm {self.later_release}")
            return
        for used in _used_names(node):
            if used != name:
                self.resolve(mod, used)
        if name not in self.emitted:
            self.emitted[name] = mod.rel
            self.bodies.append(text)
            in_base = base_mod is not None and name in base_mod.defs
            if not (mod.rel == self.rel and name in self.wanted):
                self.helpers.append(CopiedHelper(
                    name=name, release=self.later_release, file=mod.rel,
                    why=f"differs from vllm {self.base_release}'s" if in_base
                    else f"not in vllm {self.base_release}'s tests/"))

    def _imported(self, mod: _Module, name: str) -> None:
        """A name ``mod`` imports: the import kept, or (from vLLM's tests/) what it names carried over."""
        node, tests_module, original = mod.imports[name]
        if tests_module is None:
            self._import(_import_node(node, name, original))
            return
        target = _module_file(self.later_root, f"{tests_module}.{original}") or _module_file(self.later_root, tests_module)
        target_mod = self._later(target) if target else None
        if target_mod is None:
            self.problems.append(f"{name}: vllm {self.later_release} has no module {tests_module}")
            return
        if original != name:
            self.problems.append(f"{name}: imported as an alias of {original} from {tests_module}; not carried over")
            return
        self.resolve(target_mod, original)


def generate(later_root: Path, later_release: str, base_root: Path, base_release: str,
             nodeids: list[str], module_name: str) -> GeneratedModule:
    """Write (as text) a module holding ``nodeids`` (``<file>::<test>``, all of one file) of the later
    release, runnable in the base's ``tests/``, named ``module_name`` beside the upstream file."""
    files = {nodeid.split("::")[0] for nodeid in nodeids}
    if len(files) != 1:
        raise ValueError(f"the tests of one generated module must come from one file, got {sorted(files)}")
    rel = files.pop()
    source = _read(later_root, rel)
    if source is None:
        raise FileNotFoundError(f"vllm {later_release} has no {rel} in its tests/")
    wanted = {nodeid.split("::")[1].split("[")[0] for nodeid in nodeids}
    copier = _Copier(later_root, later_release, base_root, base_release, rel, source, wanted)
    tests: list[str] = []
    for nodeid in nodeids:
        top = nodeid.split("::")[1].split("[")[0]
        if top not in source.defs:
            copier.problems.append(f"{nodeid}: not in vllm {later_release}'s {rel}")
            continue
        copier.resolve(source, top)
        tests.append(nodeid.split("::", 1)[1])
    helpers = copier.helpers
    target_rel = f"{rel.rsplit('/', 1)[0]}/{module_name}.py"
    doc = (f"Written by kvrepro: tests from vllm {later_release} {rel}, run on vllm {base_release}.\n\n"
           "Helpers copied from the later release:\n" + "".join(f"  {h.name} ({h.file}: {h.why})\n" for h in helpers))
    # the docstring and the imports are built as nodes; the tests and helpers are the later release's
    # own statements, copied verbatim (their source segments, comments kept); the whole must parse
    head = ast.unparse(ast.Module([ast.Expr(ast.Constant(doc)), *copier.imports], []))
    text = head + "\n\n\n" + "\n\n".join(copier.bodies) + "\n"
    ast.parse(text)
    return GeneratedModule(rel=target_rel, release=later_release, text=text, tests=tuple(f"{target_rel}::{t}" for t in tests),
                           upstream_ids=tuple(nodeids), helpers=tuple(helpers), problems=tuple(copier.problems))


def test_source(root: Path, nodeid: str) -> str | None:
    """The source of the test function (or class) ``nodeid`` names in ``root``'s tests/, else None."""
    rel, _, name = nodeid.partition("::")
    module = _read(root, rel)
    parts = [part.split("[")[0] for part in name.split("::")]
    if module is None or parts[0] not in module.defs:
        return None
    node = module.defs[parts[0]]
    for part in parts[1:]:  # Class::method: the method only
        node = next((n for n in getattr(node, "body", []) if getattr(n, "name", None) == part), None)
        if node is None:
            return None
    return module.source(node)


def later_change(base_root: Path, newer_root: Path, nodeid: str) -> list[str] | None:
    """The lines a newer release changed in the test ``nodeid`` (``-``/``+`` lines), [] when unchanged,
    None when the newer release has no such test."""
    before, after = test_source(base_root, nodeid), test_source(newer_root, nodeid)
    if before is None or after is None:
        return None
    return [line.rstrip() for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
