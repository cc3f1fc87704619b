"""Porting a vLLM release: what a release needs that kvrepro/versions.py does not give it, named by
the porting step it needs, with the vLLM ``file:line``.

Two readings, both of the release's own code:

* **static** (:func:`read_release`, no engine): every worker RPC its EngineCore and executor ask by
  name against the answers the release runs with; the ``Executor`` abstract methods the sim
  executor does not define; every ``vllm`` name kvrepro's engine imports that the release lacks;
  the raises of the CPU platform's ``check_and_update_config`` that the release it is compared
  with does not have; each crash signature's statement (found, renamed, or gone).
* **dynamic** (:func:`diagnose`): the engine log of a run that did not reach a verdict, reduced to
  the one porting step it needs (a new worker RPC, a platform check, an executor interface), from
  the traceback that stopped it.

A static finding is what the release *would* need if a run reached it (0.34.0 asks eight RPCs the
sim never answers, none of them on the paths a run takes); a dynamic one is what it *does* need.
Why our own reader: the question is "does this code call what our table answers", which is a walk
of a few files' syntax trees (``ast``); no linter or import checker answers it.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field
from pathlib import Path

from .. import versions

# the porting steps (kvrepro/versions.py's checklist), as outputs name them
WORKER_RPC = "a new worker RPC"
PLATFORM_CHECK = "a platform check"
EXECUTOR_INTERFACE = "an executor interface"
RENAMED_IDENTIFIER = "a renamed identifier in a signature"
UNKNOWN = "not a porting step kvrepro knows"
STEPS = (WORKER_RPC, PLATFORM_CHECK, EXECUTOR_INTERFACE, RENAMED_IDENTIFIER)

# where EngineCore and the executor base class ask workers by name
_RPC_FILES = ("vllm/v1/engine/core.py", "vllm/v1/executor/abstract.py")
_EXECUTOR_BASE = "vllm/v1/executor/abstract.py"
_CPU_PLATFORM = "vllm/platforms/cpu.py"
_ENGINE = Path(__file__).resolve().parent.parent / "engine"
_SIM_EXECUTOR = _ENGINE / "executor.py"


@dataclass(frozen=True)
class Finding:
    """One thing a release needs: the porting step, what, where in vLLM, what to change."""

    step: str
    what: str
    where: str  # vllm file:line (or kvrepro file:line for an import of ours)
    fix: str
    reached: bool = False  # a run stopped on it (dynamic); False: read in the code, not (yet) reached

    def line(self) -> str:
        return f"{self.step}: {self.what} ({self.where}); {self.fix}"


@dataclass
class Reading:
    """The static reading of one release against the settings it runs with."""

    release: str
    compared_with: str | None  # the release whose platform checks and signatures it is compared with
    findings: list[Finding] = field(default_factory=list)
    signatures: dict[str, str] = field(default_factory=dict)  # crash signature -> "file:line" / "renamed" / "absent"

    def by_step(self, step: str) -> list[Finding]:
        return [f for f in self.findings if f.step == step]


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return None


def _functions(tree: ast.AST):
    """(function node, its enclosing class name or None) for every function of a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield item, node.name
        elif isinstance(node, ast.Module):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield item, None


def _sim_executor_methods() -> set[str]:
    tree = _parse(_SIM_EXECUTOR)
    names: set[str] = set()
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == "SimExecutor":
            names |= {i.name for i in node.body if isinstance(i, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def rpc_calls(tree_root: Path) -> list[tuple[str, str, int, str | None]]:
    """(rpc name, vllm file, line, calling method) of every ``collective_rpc("name", ...)`` in
    EngineCore and the executor base class."""
    calls = []
    for rel in _RPC_FILES:
        module = _parse(tree_root / rel)
        if module is None:
            continue
        for func, _cls in _functions(module):
            for node in ast.walk(func):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "collective_rpc" and node.args
                        and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                    calls.append((node.args[0].value, rel, node.lineno, func.name))
    return sorted(set(calls), key=lambda c: (c[1], c[2]))


def _unanswered_rpcs(tree_root: Path, settings: versions.Release, before_root: Path | None) -> list[Finding]:
    """RPCs the release asks that the sim does not answer; with ``before_root``, only those the
    earlier release did not ask (the others were there, unanswered and never reached, before)."""
    answers = settings.worker_rpc_answers()
    overridden = _sim_executor_methods()
    asked_before = {c[0] for c in rpc_calls(before_root)} if before_root is not None else set()
    found = []
    for name, rel, line, method in rpc_calls(tree_root):
        if name in answers or name in overridden or name in asked_before:
            continue  # answered from the table, or the sim executor's own method of that name runs instead
        if rel == _EXECUTOR_BASE and method in overridden:
            continue  # the executor base's method that asks it is the sim executor's own
        found.append(Finding(WORKER_RPC, f"collective_rpc({name!r}) in {method}() has no answer", f"{rel}:{line}",
                             f"add {name!r} to Release({settings.version!r}).rpc_answers in kvrepro/versions.py "
                             "(what one GPU worker answers) if a run reaches it"))
    return found


def _abstract_methods(tree_root: Path) -> list[Finding]:
    module = _parse(tree_root / _EXECUTOR_BASE)
    if module is None:
        return [Finding(EXECUTOR_INTERFACE, "the executor base class is not where the sim executor imports it",
                        _EXECUTOR_BASE, "find vLLM's Executor and adapt kvrepro/engine/executor.py")]
    defined = _sim_executor_methods()
    found = []
    for node in ast.walk(module):
        if isinstance(node, ast.ClassDef) and node.name == "Executor":
            for item in node.body:
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                abstract = any((isinstance(d, ast.Name) and d.id == "abstractmethod")
                               or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod")
                               for d in item.decorator_list)
                if abstract and item.name not in defined:
                    found.append(Finding(EXECUTOR_INTERFACE, f"Executor.{item.name} is abstract and SimExecutor does "
                                         "not define it", f"{_EXECUTOR_BASE}:{item.lineno}",
                                         f"define {item.name} in kvrepro/engine/executor.py (what one GPU worker does)"))
    return found


def _module_names(module_path: Path) -> set[str] | None:
    """Top-level names a module defines (None: no such module)."""
    file = module_path.with_suffix(".py")
    init = module_path / "__init__.py"
    source = file if file.is_file() else init if init.is_file() else None
    if source is None:
        return None
    tree = _parse(source)
    names: set[str] = set()
    for node in tree.body if tree is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):  # names bound under `if TYPE_CHECKING` / try-import
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
                elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, ast.Assign):
                    names |= {n.id for t in sub.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if "__getattr__" in names:
        return {"*"}  # a module-level __getattr__ answers names lazily: any may exist
    if source == init:  # a package: its submodules are importable names too
        names |= {p.stem for p in module_path.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    return names


def _guarded(module: ast.Module, node: ast.AST, text: str, name: str) -> bool:
    """Whether an import is behind an interface check: inside ``try`` with an ImportError handler,
    or its module is named in a ``find_spec`` of the same file (kvrepro/engine/executor.py's checks)."""
    for parent in ast.walk(module):
        inside = [*parent.body, *(h for h in parent.handlers)] if isinstance(parent, ast.Try) else []
        if inside and any(node in ast.walk(stmt) for stmt in inside):
            for handler in parent.handlers:
                caught = handler.type
                names = [caught] if not isinstance(caught, ast.Tuple) else list(caught.elts) if caught else []
                if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names):
                    return True
    return f'find_spec("{name}")' in text


def _engine_imports(tree_root: Path) -> list[Finding]:
    found = []
    for source in sorted(_ENGINE.glob("*.py")):
        text = source.read_text()
        module = _parse(source)
        for node in ast.walk(module) if module is not None else ():
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("vllm"):
                continue
            names = _module_names(tree_root.joinpath(*node.module.split(".")))
            where = f"kvrepro/engine/{source.name}:{node.lineno}"
            if _guarded(module, node, text, node.module):
                continue
            if names is None:
                found.append(Finding(EXECUTOR_INTERFACE, f"{node.module} is gone", where,
                                     f"adapt kvrepro/engine/{source.name} behind a check of the interface"))
                continue
            missing = [a.name for a in node.names if a.name != "*" and a.name not in names and "*" not in names]
            if missing:
                found.append(Finding(EXECUTOR_INTERFACE, f"{node.module} has no {', '.join(missing)}", where,
                                     f"adapt kvrepro/engine/{source.name} behind a check of the interface"))
    return found


_OVERRIDES = (  # kvrepro's subclass, its file, vLLM's classes it overrides (file, class) in lookup order
    ("SimCpuPlatform", _ENGINE / "platform.py",
     (("vllm/platforms/cpu.py", "CpuPlatform"), ("vllm/platforms/interface.py", "Platform"))),
    ("SimExecutor", _SIM_EXECUTOR, ((_EXECUTOR_BASE, "Executor"),)),
)


def _class_methods(module: ast.Module | None, name: str) -> dict[str, int]:
    for node in ast.walk(module) if module is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {i.name: i.lineno for i in node.body if isinstance(i, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return {}


def _stale_overrides(tree_root: Path) -> list[Finding]:
    """Methods kvrepro's platform and executor override that the release's classes no longer have: vLLM
    renamed or dropped them, so the override is never called (a silent change of behaviour)."""
    found = []
    for ours, file, bases in _OVERRIDES:
        mine = _class_methods(_parse(file), ours)
        theirs: dict[str, tuple[str, int]] = {}
        for rel, cls in reversed(bases):
            theirs.update({m: (rel, line) for m, line in _class_methods(_parse(tree_root / rel), cls).items()})
        if not theirs:
            continue
        for method, line in mine.items():
            if method.startswith("__") or method in theirs:
                continue
            near = closest(method, list(theirs), cutoff=0.9)
            if near is None:
                continue  # our own helper (no vLLM method of a name this close): not an override
            rel, their_line = theirs[near]
            found.append(Finding(EXECUTOR_INTERFACE, f"{ours}.{method} overrides nothing in this release: vLLM has "
                                 f"{near} instead, so the override is never called", f"{rel}:{their_line}",
                                 f"override {near} in kvrepro/engine/{file.name} (line {line}), by the interface"))
    return found


def _platform_raises(tree_root: Path) -> dict[str, int]:
    """``raise`` statements of the CPU platform's check_and_update_config: one-line text -> line."""
    module = _parse(tree_root / _CPU_PLATFORM)
    raises: dict[str, int] = {}
    for func, cls in _functions(module) if module is not None else ():
        if cls == "CpuPlatform" and func.name == "check_and_update_config":
            for node in ast.walk(func):
                if isinstance(node, ast.Raise) and node.exc is not None:
                    raises.setdefault(ast.unparse(node.exc), node.lineno)
    return raises


def _new_platform_checks(tree_root: Path, before_root: Path | None, before: str | None) -> list[Finding]:
    if before_root is None:
        return []
    old = _platform_raises(before_root)
    found = []
    for text, line in _platform_raises(tree_root).items():
        if text not in old:
            found.append(Finding(PLATFORM_CHECK, f"CpuPlatform.check_and_update_config raises {text[:90]} (not in "
                                 f"{before})", f"{_CPU_PLATFORM}:{line}",
                                 "if a run stops on it, answer it in kvrepro/engine/platform.py (a platform method)"))
    return found


# -- crash signatures -----------------------------------------------------------------------------

def _shape(node: ast.AST) -> tuple[str, list[str]]:
    """An expression's shape with every identifier blanked, and the identifiers in order."""
    import copy

    names: list[str] = []
    blank = copy.deepcopy(node)
    for sub in ast.walk(blank):
        if isinstance(sub, ast.Name):
            names.append(sub.id)
            sub.id = "_"
        elif isinstance(sub, ast.Attribute):
            names.append(sub.attr)
            sub.attr = "_"
    return ast.dump(blank, include_attributes=False), names


def signature_statement(tree_root: Path, pattern) -> tuple[str, int | None, dict[str, str]]:
    """Where a crash pattern's statement is in a release: ("found", line, {}), ("renamed", line,
    {new name: the pattern's name}) for a statement of the same shape whose identifiers differ only
    by renames, ("absent", None, {}) when its function has no such statement (or is gone)."""
    from ..classify.source import canonical

    if not pattern.expressions:
        return "absent", None, {}
    wanted_text = pattern.expressions[0]
    try:  # an assert's condition, or (a KeyError's, an IndexError's) the statement that raised
        wanted, is_statement = ast.parse(canonical(wanted_text), mode="eval").body, False
    except SyntaxError:
        try:
            body = ast.parse(canonical(wanted_text), mode="exec").body
        except SyntaxError:
            return "absent", None, {}
        if len(body) != 1:
            return "absent", None, {}
        wanted, is_statement = body[0], True
    wanted_shape, wanted_names = _shape(wanted)
    module = _parse(tree_root / pattern.file)
    shaped: list[tuple[int, dict[str, str]]] = []
    for func, _cls in _functions(module) if module is not None else ():
        if func.name != pattern.function:
            continue
        for node in ast.walk(func):
            if is_statement:
                test = node if isinstance(node, ast.stmt) and not isinstance(node, ast.FunctionDef) else None
            else:
                test = node.test if isinstance(node, ast.Assert) else None
            if test is None:
                continue
            if canonical(ast.unparse(test)) == canonical(wanted_text):
                return "found", node.lineno, {}
            shape, names = _shape(test)
            if shape == wanted_shape and len(names) == len(wanted_names):
                renames = {new: old for new, old in zip(names, wanted_names, strict=True)
                           if versions.IDENTIFIER_ALIASES.get(new, new) != old}
                if renames and all(not new.startswith("_") for new in renames):
                    shaped.append((node.lineno, renames))
    if shaped:
        line, renames = shaped[0]
        return "renamed", line, renames
    return "absent", None, {}


def _signatures(tree_root: Path, before_root: Path | None, before: str | None,
                reading: Reading) -> list[Finding]:
    from ..classify.patterns import known_patterns

    found = []
    for pattern in known_patterns():
        state, line, renames = signature_statement(tree_root, pattern)
        reading.signatures[pattern.name] = f"{pattern.file}:{line}" if state == "found" else state
        if state == "renamed":
            pairs = ", ".join(f"{new!r}: {old!r}" for new, old in renames.items())
            found.append(Finding(RENAMED_IDENTIFIER, f"{pattern.name}'s statement is there with other names",
                                 f"{pattern.file}:{line}", f"add {{{pairs}}} to IDENTIFIER_ALIASES in kvrepro/versions.py"))
        elif state == "absent" and before_root is not None:
            was, _, _ = signature_statement(before_root, pattern)
            if was != "absent":
                reading.signatures[pattern.name] = f"absent (present in {before})"
    return found


def read_release(release: str, tree_root: Path, before: str | None = None,
                 before_root: Path | None = None) -> Reading:
    """The static reading of ``release``'s ``vllm/`` tree (``tree_root`` holds ``vllm/``) against the
    settings it runs with; ``before`` / ``before_root``: the release whose platform checks and
    crash statements it is compared with (the newest ported one, or the previous release)."""
    settings = versions.settings_for(release)
    reading = Reading(release, before)
    reading.findings += _unanswered_rpcs(tree_root, settings, before_root)
    reading.findings += _abstract_methods(tree_root)
    reading.findings += _engine_imports(tree_root)
    reading.findings += _stale_overrides(tree_root)
    reading.findings += _new_platform_checks(tree_root, before_root, before)
    reading.findings += _signatures(tree_root, before_root, before, reading)
    return reading


# -- dynamic: the log of a run that stopped -------------------------------------------------------

def _vllm_rel(path: str) -> str | None:
    marker = "/vllm/"
    if path.startswith("vllm/"):
        return path
    i = path.rfind(marker)
    # the innermost "/vllm/" is the package (site-packages/vllm/..., an overlay's vllm/...)
    return path[i + 1:] if i >= 0 else None


def _kvrepro_rel(path: str) -> str | None:
    i = path.rfind("/kvrepro/")
    return path[i + 1:] if i >= 0 else None


def diagnose(log_text: str, settings: versions.Release | None = None) -> Finding | None:
    """The porting step an engine log's fatal traceback needs (None: no traceback, or one that is not
    a porting problem, such as a crash of vLLM's own code under test)."""
    import re

    from ..classify.classifier import fatal_traceback

    tb = fatal_traceback(log_text)
    if tb is None:
        return None
    segment = tb.root()
    exception = segment.short_exception or ""
    message = segment.message_lines[0] if segment.message_lines else ""
    frames = segment.frames
    release = settings.version if settings is not None else "this release"
    rpc = re.search(r"collective_rpc\('([^']+)'\)", message)
    if exception == "NotImplementedError" and rpc:
        caller = next((f for f in reversed(frames) if _vllm_rel(f.path) and "collective_rpc" not in f.function), None)
        where = f"{_vllm_rel(caller.path)}:{caller.line}" if caller else "vllm/v1/engine/core.py"
        return Finding(WORKER_RPC, f"EngineCore asks the workers {rpc[1]!r}, which the sim executor does not answer",
                       where, f"add {rpc[1]!r} to Release({release!r}).rpc_answers in kvrepro/versions.py (what one "
                       "GPU worker answers: a constant, or Computed(...))", reached=True)
    if exception == "TypeError" and "abstract" in message and "SimExecutor" in message:
        return Finding(EXECUTOR_INTERFACE, message[:160], _EXECUTOR_BASE,
                       "define the method in kvrepro/engine/executor.py", reached=True)
    inner_vllm = next((f for f in reversed(frames) if _vllm_rel(f.path)), None)
    inner_ours = next((f for f in reversed(frames) if _kvrepro_rel(f.path)), None)
    if inner_vllm is not None and (_vllm_rel(inner_vllm.path) or "").startswith("vllm/platforms/") and \
            frames and frames[-1] is inner_vllm:
        return Finding(PLATFORM_CHECK, f"{exception}: {message[:140]}", f"{_vllm_rel(inner_vllm.path)}:{inner_vllm.line}",
                       "answer it in kvrepro/engine/platform.py with a platform method (not a version branch)",
                       reached=True)
    if inner_ours is not None and exception in ("ModuleNotFoundError", "ImportError", "AttributeError", "TypeError",
                                                "NameError", "KeyError"):
        ours = f"{_kvrepro_rel(inner_ours.path)}:{inner_ours.line}"
        where = f"{_vllm_rel(inner_vllm.path)}:{inner_vllm.line}" if inner_vllm is not None and \
            frames.index(inner_vllm) > frames.index(inner_ours) else ours
        return Finding(EXECUTOR_INTERFACE, f"{exception}: {message[:140]} (from {ours})", where,
                       f"adapt {_kvrepro_rel(inner_ours.path)} behind a check of the interface, not the version",
                       reached=True)
    return None


def closest(name: str, names: list[str], cutoff: float = 0.6) -> str | None:
    """The name in ``names`` that ``name`` most likely is, renamed (None: none close enough)."""
    match = difflib.get_close_matches(name, names, n=1, cutoff=cutoff)
    return match[0] if match else None
