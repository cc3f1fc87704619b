"""Turn ``file:line`` into the whole statement, using the build's own source.

Python 3.11/3.12 print only the line of the failing instruction: for the target crash the
traceback shows ``num_locally_computed_tokens`` -- one line of a four-line ``assert``. Titles
must not depend on which line the interpreter happened to print, so when the source of the build
is at hand the statement is recovered with :mod:`ast` and printed on one line.
"""

from __future__ import annotations

import ast
import functools
import threading
import re
from pathlib import Path

from ..versions import IDENTIFIER_ALIASES

_SPACE = re.compile(r"\s+")
_OPEN_SPACE = re.compile(r"([(\[{]) ")
_SPACE_CLOSE = re.compile(r" ([)\]}])")


# CPython 3.11's parser is not safe to call from two threads at once (it raised "SystemError: AST
# constructor recursion depth mismatch" when parallel runs classified their logs together), so
# every parse here goes through one lock.
_PARSE_LOCK = threading.Lock()


def one_line(text: str) -> str:
    """Collapse whitespace (newlines and indentation of a wrapped expression) to single spaces."""
    text = _SPACE.sub(" ", text).strip()
    text = _OPEN_SPACE.sub(r"\1", text)
    return _SPACE_CLOSE.sub(r"\1", text)


class _Renames(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.Name:
        node.id = IDENTIFIER_ALIASES.get(node.id, node.id)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        node.attr = IDENTIFIER_ALIASES.get(node.attr, node.attr)
        return node


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def canonical(expression: str) -> str:
    """A form of an expression for comparing: what it computes and compares, not how it is laid out.

    Whole statements and expressions go through ``ast.unparse`` (layout and redundant
    parentheses vanish); a fragment (one line of a wrapped expression, which does not parse) is
    only whitespace-collapsed. ``assert`` is dropped so that ``assert a == b`` and the test
    ``a == b`` compare equal. Identifiers that vLLM renamed between releases are mapped to one
    name (``kvrepro.versions.IDENTIFIER_ALIASES``), so a crash keeps its signature across a
    refactor while any other difference (another operator, another operand) stays a different
    statement.
    """
    text = one_line(expression)
    try:
        with _PARSE_LOCK:
            tree = _Renames().visit(ast.parse(text))
    except SyntaxError:
        renamed = _WORD.sub(lambda m: IDENTIFIER_ALIASES.get(m.group(0), m.group(0)), text)
        return renamed.removeprefix("assert ")
    if len(tree.body) == 1:
        node = tree.body[0]
        if isinstance(node, ast.Assert):
            return ast.unparse(node.test)
        if isinstance(node, ast.Expr):
            return ast.unparse(node.value)
    return ast.unparse(tree)


@functools.lru_cache(maxsize=32)
def _parse(path: str, mtime_ns: int) -> tuple[ast.Module, list[str], str] | None:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        with _PARSE_LOCK:
            return ast.parse(text), text.splitlines(), text
    except (OSError, SyntaxError, ValueError):
        return None


def statement_at(source_root: Path, rel_path: str, line: int, shown_line: str | None) -> str | None:
    """The statement at ``rel_path:line`` under ``source_root``, on one line, or None.

    For an ``assert`` that is its test expression. For a compound statement whose header holds
    the line (``if``/``while``/``for``/``with``) only the header's expression. ``shown_line`` is
    the text the traceback printed for that line: when given and it differs from the file, the
    source belongs to another build and is not used (None is returned).
    """
    path = source_root / rel_path
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    parsed = _parse(str(path), mtime)
    if parsed is None:
        return None
    tree, lines, text = parsed
    if not 1 <= line <= len(lines):
        return None
    if shown_line and one_line(lines[line - 1]) != one_line(shown_line):
        return None
    node = _innermost_statement(tree, line)
    if node is None:
        return None
    return one_line(_statement_text(node, line, text))


def _innermost_statement(tree: ast.AST, line: int) -> ast.stmt | None:
    best: ast.stmt | None = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        end = node.end_lineno or node.lineno
        if node.lineno <= line <= end:
            # ties go to the later (deeper, ast.walk is breadth-first) node: `if x: y()` -> `y()`
            if best is None or (end - node.lineno) <= ((best.end_lineno or best.lineno) - best.lineno):
                best = node
    return best


def _statement_text(node: ast.stmt, line: int, text: str) -> str:
    if isinstance(node, ast.Assert):
        return ast.get_source_segment(text, node.test) or ""
    if isinstance(node, (ast.If, ast.While)):
        return ast.get_source_segment(text, node.test) or ""
    if isinstance(node, (ast.For, ast.AsyncFor)):
        target = ast.get_source_segment(text, node.target) or ""
        iterable = ast.get_source_segment(text, node.iter) or ""
        return f"for {target} in {iterable}"
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return "with " + ", ".join(ast.get_source_segment(text, item.context_expr) or "" for item in node.items)
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
        # some other compound statement (try, def, class, match): its first line is the header
        return text.splitlines()[node.lineno - 1]
    return ast.get_source_segment(text, node) or ""


def shown_expression(lines: list[str]) -> str:
    """The expression to report when only the traceback's own text is available.

    The printed lines are joined on one line; for ``assert test, message`` only ``test`` is kept,
    so that the title reads the same as when the statement was resolved from the source.
    """
    text = one_line(" ".join(lines))
    if not text.startswith("assert "):
        return text
    try:
        with _PARSE_LOCK:
            tree = ast.parse(text)
    except SyntaxError:
        return text.removeprefix("assert ")
    node = tree.body[0] if len(tree.body) == 1 else None
    if isinstance(node, ast.Assert):
        return ast.get_source_segment(text, node.test) or text.removeprefix("assert ")
    return text


def is_cut(text: str) -> bool:
    """Whether a statement as the traceback printed it is only its first part: more brackets open
    than closed (Python 3.10 prints ``assert (`` for a wrapped ``assert``)."""
    depth = 0
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
    return depth > 0
