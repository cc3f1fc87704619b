"""Every failure of one run against the catalogue: known, new, or a regression.

A run's failures, their keys and titles are read by kvrepro/classify/failures.py (a crash by its
signature, a corruption by its defect, a stall by where the engine waits, an invariant by which one
broke; the key is the title without counts, so the same failure seen in two runs is one finding).
Here each is counted against the catalogue entry with its signature that expects it on the build.
A campaign with patches then asks the base too (origin.py): the catalogue's word is not the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..classify.failures import (CORRUPTION, CRASH, INVARIANT, PREFIX_CONTENT, STALL, Failure, crash_failure,
                                 engine_invariant_failures, invariant_failures, run_failures, stall_failure)
from ..records import RunResult
from ..suite.catalogue import Catalogue, counter_value, expected_state

__all__ = ["CORRUPTION", "CRASH", "INVARIANT", "KNOWN", "NEW", "PREFIX_CONTENT", "REGRESSION", "STALL", "Failure",
           "Judged", "crash_failure", "engine_invariant_failures", "invariant_failures", "judge_failure",
           "run_failures", "stall_failure"]

NEW, KNOWN, REGRESSION = "new", "known", "regression"


@dataclass(frozen=True)
class Judged:
    """A failure against the catalogue on the run's build."""

    failure: Failure
    status: str  # new | known | regression (an entry says it is fixed on this build)
    entry: str | None = None  # the catalogue entry it counts against
    expected: str | None = None  # what that entry expects of the build: present | fixed | None


def judge_failure(failure: Failure, catalogue: Catalogue, release: str, patches: tuple[str, ...],
                  run: RunResult | None = None, seeded_from: tuple[str, ...] = ()) -> Judged:
    """Count ``failure`` against the catalogue entry with its signature that expects it on this build;
    an entry that says the build is fixed makes it a regression; no entry with the signature: new.

    Several entries share a signature (every stall is ``stall``): those whose path counter ``run``
    reached come first, so a stall with loads behind a deferred lookup counts against the
    skipped-waiting deadlock rather than another stall of the same release. Within that, the
    entries a seed-corpus run replays or descends from (``seeded_from``: RunSpec.seed_entries)
    come first: a stall of recompute-failed-load-stall's own load is that entry's, not whichever
    stall entry the catalogue lists first."""
    if failure.signature is None:
        return Judged(failure, NEW)
    candidates = [e for e in catalogue.entries if e.signature == failure.signature and e.kind == failure.kind]
    candidates.sort(key=lambda e: e.name not in seeded_from)  # stable: catalogue order otherwise
    if not candidates:
        return Judged(failure, NEW)
    reached = [e for e in candidates if run is not None and e.path_counter and counter_value(run, e.path_counter) > 0]
    # the entries whose path ran decide first: a stall on 0.31.0 with loads behind a deferred lookup is
    # the fixed skipped-waiting deadlock back (a regression), even though another stall entry (no fault
    # injected here) is present on 0.31.0
    for group in ((reached, candidates) if reached else (candidates,)):
        states = [(e, expected_state(e, release, patches)) for e in group]
        for entry, state in states:
            if state == "present":
                return Judged(failure, KNOWN, entry.name, state)
        for entry, state in states:
            if state == "fixed":
                return Judged(failure, REGRESSION, entry.name, state)
    # the catalogue knows the signature but claims nothing of this release: known, not checked
    return Judged(failure, KNOWN, candidates[0].name, None)
