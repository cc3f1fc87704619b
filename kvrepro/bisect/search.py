"""The searches, free of engines and files: they ask an oracle for a point's verdict.

Both are deterministic functions of the oracle's answers, which is what makes ``--resume``
finish with the same answer: the session replays the recorded answers and only runs the points
that have none yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .rules import PointVerdict

T = TypeVar("T")


@dataclass
class LinearOutcome:
    """Where the verdict changes along an ordered list of points (indices into it).

    ``first_new``: the first point whose verdict is the newer end's (the answer) when
    ``last_old`` is right before it; when points between them were skipped, both are set and
    ``skipped`` names the ones that could not be decided.
    """

    last_old: int
    first_new: int
    skipped: list[int] = field(default_factory=list)

    @property
    def decided(self) -> bool:
        return self.first_new - self.last_old == 1


def _middle(candidates: Sequence[int], lo: int, hi: int) -> int:
    """The candidate nearest the middle of (lo, hi); ties go to the lower one (mozregression)."""
    centre = (lo + hi) / 2
    return min(candidates, key=lambda i: (abs(i - centre), i))


def next_midpoint(lo: int, hi: int, skipped: set[int]) -> int | None:
    candidates = [i for i in range(lo + 1, hi) if i not in skipped]
    return _middle(candidates, lo, hi) if candidates else None


def bisect_linear(count: int, old_verdict: PointVerdict, oracle: Callable[[int], PointVerdict],
                  prefetch: Callable[[list[int]], None] | None = None) -> LinearOutcome:
    """Find where points 0..count-1 change from ``old_verdict`` (point 0's) to the other one
    (point count-1's). Both ends are known already; a skipped point is left out and the next
    midpoint tried, as git bisect does.

    ``prefetch`` is told, before each probe, the midpoints that could come next (one per
    possible answer), so their builds can be prepared while this one runs.
    """
    lo, hi = 0, count - 1
    skipped: set[int] = set()
    while True:
        mid = next_midpoint(lo, hi, skipped)
        if mid is None:
            return LinearOutcome(lo, hi, sorted(i for i in skipped if lo < i < hi))
        if prefetch is not None:
            upcoming = {next_midpoint(mid, hi, skipped), next_midpoint(lo, mid, skipped)}
            prefetch(sorted(i for i in upcoming if i is not None))
        verdict = oracle(mid)
        if verdict is PointVerdict.SKIP:
            skipped.add(mid)
        elif verdict is old_verdict:
            lo = mid
        else:
            hi = mid


def _split(items: Sequence[T], n: int) -> list[list[T]]:
    chunks, start = [], 0
    for i in range(n):
        end = start + (len(items) - start) // (n - i)
        chunks.append(list(items[start:end]))
        start = end
    return [c for c in chunks if c]


def ddmin(items: Sequence[T], removes_crash: Callable[[list[T]], PointVerdict],
          prefetch: Callable[[list[list[T]]], None] | None = None) -> list[T]:
    """Zeller's delta debugging: a 1-minimal subset of ``items`` for which ``removes_crash`` says
    GOOD (every subset with one item fewer is BAD or SKIP). ``items`` itself must be GOOD and
    the empty set BAD (the caller checks both ends first). Subsets keep the items' order.
    """
    current = list(items)
    n = 2
    while len(current) >= 2:
        chunks = _split(current, n)
        complements = [[x for x in current if x not in chunk] for chunk in chunks] if n > 2 else []
        if prefetch is not None:
            prefetch(chunks + complements)
        reduced = False
        for chunk in chunks:
            if removes_crash(chunk) is PointVerdict.GOOD:
                current, n, reduced = chunk, 2, True
                break
        if not reduced:
            for complement in complements:
                if removes_crash(complement) is PointVerdict.GOOD:
                    current, n, reduced = complement, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(current):
                break
            n = min(len(current), 2 * n)
    return current
