"""Branch coverage of the code under test by instrumentation, not by tracing: the cheap variant of
kvrepro/engine/arcs.py (``KVREPRO_SIM_ARCS=instrument``).

Why: ``sys.settrace`` puts Python 3.11's interpreter in its tracing mode for every frame of the
thread, which alone costs the engine about 3x its CPU (benchmarks/arcs_overhead.py). Here the
traced modules' functions get new code objects, compiled from their own source with one statement
added at the head of every branch (``if`` and its ``else``, written in when the source has none,
loop bodies and their ``else``, ``except`` and ``finally`` blocks, each function's entry): a store
of 1 into a bytearray of the module. Nothing else in the process changes.

Each probe is named like an arc of arcs.py: ``<branching line>><first line of the block>``, with
``-<line>`` as the block for an ``if`` that fell through (no ``else`` in the source) and for a
loop that ended without ``break``, so explore reads both the same way (``kvrepro-arcs:`` lines).

The function objects are changed in place (``function.__code__``), so every reference the engine
already holds (bound methods, the scheduler's class) runs the instrumented code. A function whose
new code does not match (other free variables: a decorator's closure) keeps its old code and is
not covered; :func:`instrument` reports how many were.

Runs in the engine process; stdlib only, no vLLM import.
"""

from __future__ import annotations

import ast
import sys
import threading
import types

from .arcs import TAG, TRACED, traced_name

PROBES = "__kvrepro_branches__"
# a scan of the probes costs well under a millisecond; often, so that an engine that dies of a
# crash (no atexit then) has reported nearly everything it ran
REPORT_INTERVAL_S = 0.2
_installed: "BranchRecorder | None" = None  # this process's recorder (one per engine process)


class _Insert(ast.NodeTransformer):
    """Adds ``__kvrepro_branches__[i] = 1`` at the head of every branch; ``probes[i]`` names it."""

    def __init__(self) -> None:
        self.probes: list[tuple[int, int]] = []

    def _probe(self, at: ast.AST, a: int, b: int) -> ast.stmt:
        self.probes.append((a, b))
        node = ast.Assign(targets=[ast.Subscript(value=ast.Name(PROBES, ast.Load()),
                                                  slice=ast.Constant(len(self.probes) - 1), ctx=ast.Store())],
                          value=ast.Constant(1))
        return ast.copy_location(node, at)

    def _head(self, body: list[ast.stmt], a: int) -> list[ast.stmt]:
        return [self._probe(body[0], a, body[0].lineno), *body] if body else body

    def _function(self, node):
        self.generic_visit(node)
        node.body = self._head(node.body, -node.lineno)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_If(self, node: ast.If):
        self.generic_visit(node)
        node.body = self._head(node.body, node.lineno)
        if node.orelse:
            node.orelse = self._head(node.orelse, node.lineno)
        else:
            node.orelse = [self._probe(node, node.lineno, -node.lineno)]
        return node

    def _loop(self, node):
        self.generic_visit(node)
        node.body = self._head(node.body, node.lineno)
        node.orelse = (self._head(node.orelse, node.lineno) if node.orelse
                       else [self._probe(node, node.lineno, -node.lineno)])
        return node

    visit_For = visit_AsyncFor = visit_While = _loop

    def visit_Try(self, node: ast.Try):
        self.generic_visit(node)
        for handler in node.handlers:
            handler.body = self._head(handler.body, handler.lineno)
        if node.orelse:
            node.orelse = self._head(node.orelse, node.lineno)
        if node.finalbody:
            node.finalbody = self._head(node.finalbody, node.lineno)
        return node


def _codes(code: types.CodeType, out: dict) -> None:
    out[(code.co_qualname, code.co_firstlineno)] = code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _codes(const, out)


def _functions(namespace: dict, seen: set[int]):
    for value in list(namespace.values()):
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            yield from (f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType))
            continue
        while hasattr(value, "__wrapped__") and not isinstance(value, type):
            if isinstance(value, types.FunctionType):
                yield value
            value = value.__wrapped__
        if isinstance(value, types.FunctionType):
            yield value
        elif isinstance(value, type):
            yield from _functions(dict(vars(value)), seen)


def instrument(module: types.ModuleType, name: str) -> tuple[bytearray, list[tuple[int, int]], int, int]:
    """Give ``module``'s functions instrumented code. Returns (hits, probes, functions changed, not)."""
    filename = module.__file__
    with open(filename, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename)
    insert = _Insert()
    tree = ast.fix_missing_locations(insert.visit(tree))
    new: dict = {}
    _codes(compile(tree, filename, "exec"), new)
    hits = bytearray(len(insert.probes))
    module.__dict__[PROBES] = hits
    changed = kept = 0
    for fn in _functions(module.__dict__, set()):
        if fn.__module__ != module.__name__:
            continue  # imported from elsewhere
        old = fn.__code__
        code = new.get((old.co_qualname, old.co_firstlineno))
        if code is not None and code.co_freevars == old.co_freevars:
            fn.__code__ = code
            changed += 1
        else:
            kept += 1
    return hits, insert.probes, changed, kept


class BranchRecorder:
    """Instruments the traced modules already imported and reports newly hit probes as arcs."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.modules: list[tuple[str, bytearray, list[tuple[int, int]], bytearray]] = []
        self._lock = threading.Lock()

    @staticmethod
    def import_traced() -> None:
        """Import the code under test now (the connector's modules are imported when the scheduler
        makes the connector, after the executor that installs this): a module imported later would
        keep its plain code."""
        import importlib
        import pkgutil

        for path in TRACED:
            name = "vllm." + path.rstrip("/").removesuffix(".py").replace("/", ".")
            try:
                module = importlib.import_module(name)
                if path.endswith("/"):
                    for info in pkgutil.iter_modules(module.__path__):
                        importlib.import_module(f"{name}.{info.name}")
            except Exception as exc:  # noqa: BLE001 - a release without this module: nothing to cover there
                print(f"{TAG} not imported {name}: {type(exc).__name__}: {exc}", file=sys.stderr)

    def install(self, modules=None) -> None:
        """Instrument once per process (the offline engine builds an EngineCore per job: the code is
        instrumented already, and its probes keep counting for the process)."""
        import atexit
        import time

        global _installed
        if modules is None:
            if _installed is not None:
                return
            _installed = self
            self.import_traced()
        started = time.process_time()
        changed = kept = 0
        for module in list((modules or sys.modules).values()):
            filename = getattr(module, "__file__", None) or ""
            name = traced_name(filename) if filename.endswith(".py") else None
            if name is None:
                continue
            try:
                hits, probes, c, k = instrument(module, name)
            except (OSError, SyntaxError, ValueError) as exc:
                self._write(f"{TAG} not instrumented {name}: {type(exc).__name__}: {exc}")
                continue
            changed, kept = changed + c, kept + k
            self.modules.append((name, hits, probes, bytearray(len(hits))))
        self._write(f"{TAG} instrumented modules={len(self.modules)} functions={changed} kept={kept} "
                    f"cpu_s={time.process_time() - started:.3f}")
        threading.Thread(target=self._reporter, name="kvrepro-branches-reporter", daemon=True).start()
        atexit.register(self.flush)

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def flush(self) -> None:
        with self._lock:
            for name, hits, probes, reported in self.modules:
                new = [i for i, (h, r) in enumerate(zip(hits, reported)) if h and not r]
                if not new:
                    continue
                for i in new:
                    reported[i] = 1
                self._write(f"{TAG} {name} " + " ".join(f"{probes[i][0]}>{probes[i][1]}" for i in new))

    def _reporter(self) -> None:
        while True:
            threading.Event().wait(REPORT_INTERVAL_S)
            self.flush()
