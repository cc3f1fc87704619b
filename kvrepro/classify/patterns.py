"""The table of known crash signatures (syzkaller's pkg/report, in small).

Each known crash is one module under ``kvrepro/classify/signatures/`` that defines ``PATTERN``,
a :class:`Pattern`. Modules are discovered by listing the package, so adding a signature is
adding one file (plus its test log under ``tests/data/logs/``, which the tests require).

A pattern gives a crash a stable title: the same bug gets the same title whether or not the
build's source was at hand and whichever line of a wrapped statement the interpreter printed.
It also records why the crash matters and where it was reported, for the person reading the
results. Crashes no pattern knows get a generic title from the classifier.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from ..records import Signature
from .source import canonical


@dataclass(frozen=True)
class Pattern:
    """One known crash.

    ``exception``/``function`` compare with the traceback's exception class (without module)
    and the innermost vLLM function; ``file`` is a suffix of its path (from ``vllm/`` on).

    ``expressions`` are the statement texts that identify the crash, compared layout-blind
    (see :func:`~kvrepro.classify.source.canonical`): the whole expression first (used in the
    title), then the single lines of it that Python 3.11/3.12 print for a wrapped statement when
    the source is not available. Leave it empty to match any statement of the function.

    ``other_statements`` are further whole statements of the same check (the next ``assert`` on the
    same state, which a variant of the defect reaches instead): each matches as "full" and titles
    the crash with its own text, so one defect keeps one signature and every face its true title.

    ``message`` is an optional regex searched in the exception's message.

    ``never_target``: this crash shares the target's site but is a different bug (typically an
    assertion added by the fix under test). Unless the matrix's target signature names an
    expression, a crash matching it is reported as other_crash, not as the target.
    """

    name: str
    exception: str
    function: str
    file: str
    why: str
    title: str = "{exception} in {function}: {expression}"
    expressions: tuple[str, ...] = ()
    other_statements: tuple[str, ...] = ()
    message: str | None = None
    upstream: tuple[str, ...] = ()
    test_log: str | None = None  # file name under tests/data/logs/
    never_target: bool = False
    _canon: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _other: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_canon", tuple(canonical(e) for e in self.expressions))
        object.__setattr__(self, "_other", tuple(canonical(e) for e in self.other_statements))

    def match(self, sig: Signature, message: str = "") -> str | None:
        """How this pattern matches: "full", "fragment" (one line of the statement), "any" (the
        pattern names no expression), or None."""
        if sig.exception != self.exception or _short(sig.function) != self.function:
            return None
        if not sig.file.endswith(self.file):
            return None
        if self.message is not None and not re.search(self.message, message):
            return None
        if not self._canon:
            return "any"
        got = canonical(_shown_part(sig.expression))
        if got == self._canon[0] or (got and got in self._other):
            return "full"
        if got and got in self._canon[1:]:
            return "fragment"
        return None

    def render_title(self, sig: Signature) -> str:
        expression = self.expressions[0] if self.expressions else sig.expression
        if self._other and canonical(sig.expression) in self._other:
            expression = sig.expression
        return self.title.format(exception=sig.exception, function=_short(sig.function), file=sig.file,
                                 line=sig.line, expression=expression)


_CUT = " ... (statement cut;"


def _shown_part(expression: str) -> str:
    """What the traceback printed of a statement it cut (the classifier marks the cut, naming the
    file and line): the printed first line is a fragment a pattern can name (`assert x == 0, (`, the
    line Python prints of an assert whose message is wrapped onto the next lines)."""
    return expression.split(_CUT, 1)[0] if _CUT in expression else expression


def _short(function: str) -> str:
    return function.rsplit(".", 1)[-1]


@functools.lru_cache(maxsize=1)
def known_patterns() -> tuple[Pattern, ...]:
    """Every pattern under kvrepro/classify/signatures/, by name."""
    from . import signatures

    from .tables import table_entries

    return table_entries(signatures, "PATTERN", Pattern, "signature")


_RANK = {"full": 0, "fragment": 1, "any": 2}


def match_pattern(sig: Signature, message: str = "") -> Pattern | None:
    """The known pattern for a signature.

    The most specific wins: the whole expression, then one line of it, then a pattern that names
    no expression at all; between equals, the first by name.
    """
    best: tuple[int, Pattern] | None = None
    for pattern in known_patterns():
        how = pattern.match(sig, message)
        if how is not None and (best is None or _RANK[how] < best[0]):
            best = (_RANK[how], pattern)
    return best[1] if best else None
