"""The one place that decides whether a run meets the matrix's ``expect:``.

``expect:``'s syntax (``SURVIVED|UNREACHED``, ``CORRUPT(defect, ...)``) is read by
:mod:`kvrepro.spec.matrix` (:func:`~kvrepro.spec.matrix.expected_labels`,
:func:`~kvrepro.spec.matrix.expected_defects`), since validating a matrix needs it. What a
run's verdict means against it is decided here, and only here:

* :func:`meets` -- is a verdict label (and, for CORRUPT, the defects shown) one ``expect:`` accepts;
* :func:`check` -- a repetition against ``expect:``: met, differs, INFRA (says nothing about the
  code: its own exit code, 3) or unfinished (INTERRUPTED, INCOMPLETE, DAMAGED: neither a pass nor
  a failure);
* :func:`mismatches` -- the repetitions of a matrix run that differ (exit code 1, JUnit failures);
* :func:`enough_runs` -- when adaptive repetitions have seen enough of a build, given what it expects.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from . import stats
from ..records import RunResult, Verdict
from ..results.store import MatrixRun
from ..spec.matrix import expected_defects, expected_labels


class Check(str, enum.Enum):
    MET = "met"  # no expect:, or a verdict it accepts
    DIFFERS = "differs"  # a finished verdict expect: does not accept
    INFRA = "infra"  # infrastructure failed (and expect: is not INFRA): says nothing about the code
    UNFINISHED = "unfinished"  # INTERRUPTED / INCOMPLETE / DAMAGED: the repetition did not finish


_UNFINISHED = (Verdict.INTERRUPTED, Verdict.INCOMPLETE, Verdict.DAMAGED)


def meets(expect: str | None, label: str, defects: Iterable[str] = ()) -> bool:
    """Whether a verdict label (and, for CORRUPT, the defects the run showed) is one that
    ``expect:`` accepts; no ``expect:`` accepts anything."""
    if not expect:
        return True
    shown = set(defects)
    return any(accepted == label and shown.issuperset(expected_defects(alternative))
               for accepted, alternative in zip(expected_labels(expect),
                                                (p.strip() for p in expect.split("|") if p.strip())))


def check(run: RunResult, expect: str | None) -> Check:
    """One repetition against its build's ``expect:``."""
    if run.verdict in _UNFINISHED:
        return Check.UNFINISHED
    if run.verdict is Verdict.INFRA and expect != "INFRA":
        # INFRA wins over "differs from expect:": CI must not read a broken host as "the bug is back"
        return Check.INFRA
    return Check.MET if meets(expect, run.label, run.kv_defects) else Check.DIFFERS


def meets_expectation(run: RunResult, expect: str | None) -> bool:
    """Not a failure of ``expect:`` (met, INFRA or unfinished)."""
    return check(run, expect) is not Check.DIFFERS


@dataclass(frozen=True)
class Mismatch:
    base: str
    build: str
    rep: int
    expected: str
    actual: str

    def __str__(self) -> str:
        return f"build {self.build} rep {self.rep}: {self.actual}, expected {self.expected}"


def mismatches(run: MatrixRun) -> list[Mismatch]:
    return [Mismatch(b.base, b.name, r.rep, b.expect or "", r.label)
            for b in run.builds for r in b.runs if check(r, b.expect) is Check.DIFFERS]


def enough_runs(runs: Sequence[RunResult], expect: str | None) -> bool:
    """Adaptive repetitions: has this build seen enough (stats.decisive, the README's rule)? A
    build expected to crash (or be CORRUPT) or to survive stops when the rate is decisive; one
    expecting anything else, or several verdicts, after three agreeing repetitions or the first
    that disagrees."""
    expected_failure = None
    if expect:
        labels = expected_labels(expect)
        expected_failure = all(label.startswith(("CRASH", "CORRUPT")) for label in labels)
        if not expected_failure and labels != ("SURVIVED",):
            return len(runs) >= 3 or any(r.label not in labels for r in runs)
    return stats.decisive(stats.rate(list(runs)), expected_failure).decisive
