"""A build's failures its base does not show: introduced by its stack (issue 51).

A patch stack's build and its base ran the same load with the same seeds (a matrix's builds on one
release; a suite entry on ``--base X --patch P`` and on X alone). Every failure is keyed as explore
keys it (kvrepro/classify/failures.py: a crash by its signature, a corruption by its defect, a stall by
where the engine waits, an invariant by its name), so a stall of the stack and another stall of the
base are two failures, not one "STALL" each. Per build and failure key:

* ``introduced``: the build showed it in at least two runs and the base, in every run that could
  show it (at least one), did not (explore's rule, kvrepro/explore/origin.py);
* ``in the base``: the base showed it too;
* ``undecided``: the build showed it once only, or the base has no run that could show it (not run,
  not judged, or each of its runs ended first on a failure the build's repetition with the same
  seeds did not have: 0.26.0's target crash ends build A's load before the wrong KV its fixes
  expose on B).

Each with its counts and Fisher's exact p (one-sided: the stack raised the rate by chance), the
statistics per failure kind the report prints next to the patch effects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..classify.failures import Failure, all_failures, ending
from ..records import RunResult, Verdict
from ..results.store import MatrixRun
from . import stats

INTRODUCED, IN_BASE, UNDECIDED = "introduced", "in the base", "undecided"
_UNJUDGED = (Verdict.INFRA, Verdict.INTERRUPTED, Verdict.INCOMPLETE, Verdict.DAMAGED)


@dataclass(frozen=True)
class StackFailure:
    """One failure key of one build against its base build."""

    build: str
    base_build: str | None  # the build it is compared with; None: there is none
    key: str
    kind: str  # crash | corruption | stall | invariant
    title: str  # the first instance's
    with_failed: int
    with_runs: int
    without_failed: int
    without_runs: int  # the base's runs that could show it (judged, and not cut short by another failure)
    origin: str  # introduced | in the base | undecided
    p_value: float | None  # one-sided Fisher: P(the stack raised it this much by chance); None: no base run

    @property
    def significant(self) -> bool:
        return self.p_value is not None and self.p_value <= stats.SIGNIFICANT + 1e-9

    def counts(self) -> str:
        base = f"{self.without_failed}/{self.without_runs}" if self.base_build else "not run"
        p = f", p = {self.p_value:.2g}" if self.p_value is not None else ""
        return f"{self.with_failed}/{self.with_runs} with the stack, {base} on {self.base_build or 'the base'}{p}"


def judged(runs: Sequence[RunResult]) -> list[RunResult]:
    return [r for r in runs if r.verdict not in _UNJUDGED]


def compare(build: str, runs: Sequence[RunResult], base_build: str | None,
            base_runs: Sequence[RunResult]) -> list[StackFailure]:
    """Every failure key ``runs`` showed, against ``base_runs`` (the same load and seeds without the stack)."""
    mine = judged(runs)
    theirs = judged(base_runs)
    per_run = [{f.key: f for f in all_failures(r)} for r in mine]
    shown = {k: f for keys in per_run for k, f in keys.items()}
    # repetition i of both builds ran the same load and seeds: a base run is held against its own
    # repetition's failures (against every one of the build's when that repetition is missing)
    by_rep = {r.rep: set(keys) for r, keys in zip(mine, per_run)}
    base_keys = [({f.key for f in all_failures(r)}, ending(r), by_rep.get(r.rep, set(shown))) for r in theirs]
    out = []
    for key, failure in sorted(shown.items()):
        with_failed = sum(1 for keys in per_run if key in keys)
        # a base run cut short by a failure its repetition with the stack never had could not show this one
        usable = [keys for keys, ended, own in base_keys if key in keys or ended is None or ended in own]
        without_failed = sum(1 for keys in usable if key in keys)
        p = None
        if base_build is not None and usable and not without_failed:
            p = stats.fisher_raised(without_failed, len(usable), with_failed, len(mine))
        if without_failed:
            origin = IN_BASE
        elif p is not None and with_failed >= 2:  # explore's rule: twice with the stack, never without
            origin = INTRODUCED
        else:
            origin = UNDECIDED
        out.append(StackFailure(build, base_build, key, failure.kind, failure.title, with_failed, len(mine),
                                without_failed, len(usable), origin, p))
    return out


def base_of(stacks: Mapping[str, Sequence[str]]) -> str | None:
    """The base build of builds on one release: the one whose stack every other stack contains (the
    shortest such); None when there is none (no build without the stacks' patches)."""
    candidates = [(len(s), b) for b, s in stacks.items() if all(set(s) <= set(o) for o in stacks.values())]
    return min(candidates)[1] if candidates else None


def stack_failures(run: MatrixRun, build_key: Callable[[MatrixRun, Any], str]) -> list[StackFailure]:
    """For each build with a stack on top of its release's base build, its failures against the
    base build's (a matrix that runs no base build on a release leaves them undecided); builds named
    by ``build_key`` (the report's render.build_key)."""
    out = []
    for release in dict.fromkeys(b.base for b in run.builds):
        members = [b for b in run.builds if b.base == release]
        stacks = {build_key(run, b): list(b.patches) for b in members}
        root = base_of(stacks)
        runs = {build_key(run, b): b.runs for b in members}
        for name in stacks:
            if name == root:
                continue
            out += compare(name, runs[name], root, runs[root] if root else ())
    return out


def lines(found: Sequence[StackFailure]) -> list[str]:
    """One sentence per build that fails: what its stack introduced, what its base shows too, what
    stays undecided (the matrix's "proved" lines and the suite's)."""
    by_build: dict[str, list[StackFailure]] = {}
    for f in found:
        by_build.setdefault(f.build, []).append(f)
    out = []
    for build, failures in by_build.items():
        parts = []
        for origin, words in ((INTRODUCED, "introduced by its stack"), (IN_BASE, "already in the base"),
                              (UNDECIDED, "undecided")):
            mine = [f for f in failures if f.origin == origin]
            if mine:
                parts.append(f"{words}: " + "; ".join(f"{f.key} ({f.counts()})" for f in mine))
        base = failures[0].base_build
        out.append(f"{build} against {base or 'no base build'}: " + ". ".join(parts) + ".")
    return out


def as_json(found: Sequence[StackFailure]) -> list[dict[str, object]]:
    return [{"build": f.build, "base_build": f.base_build, "key": f.key, "kind": f.kind, "title": f.title,
             "origin": f.origin, "with": [f.with_failed, f.with_runs], "without": [f.without_failed, f.without_runs],
             "p_raised": f.p_value} for f in found]


__all__ = ["IN_BASE", "INTRODUCED", "UNDECIDED", "Failure", "StackFailure", "as_json", "base_of", "compare",
           "lines", "stack_failures"]
