"""When one run's verdict is settled, so that its load may end before ``runs.requests``.

The rule (docs/statistics.md, "Sequential stopping per run") treats each occurrence of an event
(the bug's state, by default) as one trial of "does the engine die of it / read wrong KV on it".
``n`` trials without that failure bound its rate per trial below ``1 - (1 - 0.95)^(1/n)`` at 95%
(the zero-event Clopper-Pearson bound); :func:`events_needed` is the smallest ``n`` that puts it
below ``RATE_BOUND``. A run is settled when both of its questions are:

* crash: the event arose ``n`` times and the engine still lives (its crash rate per event is
  below the bound), or the path it arises on ran ``n`` times and it never arose (its rate per
  path call is below the bound: the crash's precondition is not reached on this code);
* corruption: the shadow KV named one (CORRUPT needs no more), or ``n`` of the same events
  passed without a violation, or the engine has no shadow KV to ask.

A build whose first state crashes (A) never reports more than one state from a live engine, so
the crash question can never settle there. A stall has no count that settles it: a build whose
question is a stall runs its whole load (the caller passes no rule).

:class:`LogFollower` reads the engine's log while the load runs, so that each look costs what was
written since the last one (the runner itself follows its run's log with the one parser of
kvrepro/classify/report.py, which this wraps for a caller that only wants the exposure).
"""

from __future__ import annotations

import math
from pathlib import Path

from .records import Exposure, StopRule
from .corruption import defects_of
from .report import LogParser, LogTail

CONFIDENCE = 0.95
RATE_BOUND = 0.10  # a crash (or corruption) rate per event that a settled run rules out
_EXPOSURE_NAMES = {"trigger_count": "trigger_calls", "state_count": "state_calls"}


def events_needed(bound: float = RATE_BOUND, confidence: float = CONFIDENCE) -> int:
    """The fewest failure-free trials whose one-sided upper bound of the failure rate is below ``bound``."""
    return math.ceil(math.log(1.0 - confidence) / math.log(1.0 - bound))


def upper_bound(trials: int, confidence: float = CONFIDENCE) -> float:
    """One-sided upper bound of a rate after ``trials`` trials without the event."""
    return 1.0 - (1.0 - confidence) ** (1.0 / trials) if trials > 0 else 1.0


EVENTS = events_needed()  # 29: 1 - 0.05^(1/29) = 9.8%


def count(exposure: Exposure, name: str) -> int:
    """A RunResult counter (``state_count``, ``kv_hit_reads.mamba``) read from live exposure."""
    field_name, _, key = name.partition(".")
    value = getattr(exposure, _EXPOSURE_NAMES.get(field_name, field_name), None)
    if key:
        value = value.get(key, 0) if isinstance(value, dict) else 0
    return int(value) if isinstance(value, int) else 0


def settled(exposure: Exposure, rule: StopRule) -> str | None:
    """Why the run's verdict is settled (the words the report shows), or None while it is not.

    The caller asks only while the engine lives: a count read here is of events it survived."""
    n = count(exposure, rule.counter)
    if n >= rule.events:
        crash = f"{rule.counter} {n} with the engine alive: crash rate per event < {upper_bound(n):.1%} (95%)"
        trials, per = n, rule.counter
    elif n == 0 and rule.path_counter and (m := count(exposure, rule.path_counter)) >= rule.events:
        crash = (f"{rule.path_counter} {m} with {rule.counter} 0: {rule.counter} per {rule.path_counter} "
                 f"< {upper_bound(m):.1%} (95%)")
        trials, per = m, rule.path_counter
    else:
        return None
    if exposure.kv_violations:
        shown = defects_of(exposure.kv_violations, exposure.kv_violations_by, exposure.kv_first_violation_class,
                           exposure.kv_groups)
        corruption = "corruption seen: " + ", ".join(sorted(shown))
    elif not exposure.shadow_seen:
        corruption = "no shadow KV on this engine"
    else:
        corruption = f"no KV violation in {trials} {per}: rate < {upper_bound(trials):.1%} (95%)"
    return f"{crash}; {corruption}"


class LogFollower:
    """The exposure of a growing engine log, read a piece at a time (a :class:`~.report.LogTail`:
    each look costs what was written since the last one)."""

    def __init__(self, path: Path):
        self._tail = LogTail(path, LogParser())

    def exposure(self) -> Exposure:
        return self._tail.read().exposure()
