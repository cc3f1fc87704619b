"""From run verdicts to good / bad / skip, and when a point has been run often enough.

The table (mozregression-style: verdicts are data, not code paths):

=================  ============  ==================================================
run verdict         evidence      why
=================  ============  ==================================================
CRASH(target)       bad           the crash we bisect: one is enough
CORRUPT             bad           the bug's silent form (wrong data, no death)
SURVIVED            handled       the code path ran, the bug's state occurred, no crash
UNREACHED           unreached     the code path ran, the bug's state never occurred
VACUOUS             skip          the code path never ran: proves nothing
STALL               skip          the engine stopped making progress: says nothing
INFRA               skip          build / start failed: says nothing about the code
CRASH(other)        skip          an unrelated crash must not derail the bisection
INTERRUPTED         (dropped)     Ctrl-C: the run is redone on --resume
=================  ============  ==================================================

A run whose load was stopped by Ctrl-C is dropped whatever its verdict, unless it is bad: a
crash seen before the stop is real, a shutdown traceback logged by the stop is not.

**Wrong KV is bad whatever ended the run.** The run verdict ranks a crash above corruption, so a
run in which the shadow KV caught wrong KV (``kv_check: corrupt``) and that then died on an
unrelated crash is ``CRASH(other)``, and one stopped by Ctrl-C is ``INTERRUPTED``. Without
``--title`` such a run is **bad**, not a skip: the corruption was observed. (``INFRA`` stays a
skip: wrong code ran, or the load did not test the engine.) So a good point means no crash and
no corruption, on a run whose trigger path ran. A run without a shadow KV (``kv_check: off``,
e.g. a real GPU) cannot show corruption; its clean verdict only speaks for the crash.

With ``--title TEXT`` a crash is bad when its title contains TEXT (any outcome) and a skip
otherwise, and a CORRUPT run counts as clean ("handled"): the engine lived and the crash named
by TEXT did not happen (use this to ask which change removed an assertion even where the
engine then serves stale KV).

A point is **bad** as soon as one run is bad. It is **good** after ``N`` clean exposed runs
(handled or unreached) and no bad one, where ``N`` is the smallest number with
``(1 - p_bad)^N < alpha``: if the point still had the crash rate measured at the bad end, all
``N`` runs would come out clean with probability below ``alpha``. ``p_bad`` is the rule of
succession over the bad end's runs, ``(crashes + 1) / (exposed runs + 2)``, so that a handful
of runs never claims certainty. A point that reaches ``max_runs`` runs (default ``3N + 6``)
without either is a **skip**.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


class Evidence(str, enum.Enum):
    BAD = "bad"
    HANDLED = "handled"
    UNREACHED = "unreached"
    SKIP = "skip"
    DROPPED = "dropped"


RUN_EVIDENCE: dict[str, Evidence] = {
    "CRASH(target)": Evidence.BAD,
    "CORRUPT": Evidence.BAD,
    "SURVIVED": Evidence.HANDLED,
    "UNREACHED": Evidence.UNREACHED,
    "VACUOUS": Evidence.SKIP,
    "STALL": Evidence.SKIP,
    "INFRA": Evidence.SKIP,
    "CRASH(other)": Evidence.SKIP,
    "INTERRUPTED": Evidence.DROPPED,
}


class PointVerdict(str, enum.Enum):
    GOOD = "good"
    BAD = "bad"
    SKIP = "skip"


@dataclass(frozen=True)
class RunSummary:
    """What the point rule reads of one run (``bisect.json`` keeps it; the run folder keeps the rest)."""

    verdict: str = "?"  # "?": a run bisect.json recorded without one (read by kvrepro.bisect.state)
    outcome: str = "none"
    title: str = ""
    rep: int | None = None
    trigger_count: int | None = None
    state_count: int | None = None
    requests: int | None = None
    kv_check: str | None = None
    kv_violations: int | None = None
    seconds: float | None = None
    run_dir: str | None = None
    stopped_because: str | None = None

    @property
    def label(self) -> str:
        """The run's verdict label: CRASH(target) / CRASH(other) / SURVIVED / ..."""
        if self.verdict == "CRASH":
            return "CRASH(target)" if self.outcome == "target" else "CRASH(other)"
        return self.verdict


def run_label(run: RunSummary) -> str:
    """A recorded run's verdict label: CRASH(target) / CRASH(other) / SURVIVED / ..."""
    return run.label


def evidence(run: RunSummary, title: str | None = None) -> Evidence:
    """What one recorded run says about its point (unknown verdicts are skips)."""
    label = run.label
    if title is not None and label.startswith("CRASH"):
        found = RUN_EVIDENCE["CRASH(target)"] if title.lower() in (run.title or "").lower() else Evidence.SKIP
    elif title is not None and label == "CORRUPT":
        found = Evidence.HANDLED
    elif title is None and run.kv_check == "corrupt" and label != "INFRA":
        found = Evidence.BAD  # wrong KV was read, whatever ended the run (see the module docstring)
    else:
        found = RUN_EVIDENCE.get(label, Evidence.SKIP)
    if found is not Evidence.BAD and run.stopped_because == "interrupted":
        # cut short by Ctrl-C: whatever the engine logged while being stopped proves nothing
        return Evidence.DROPPED
    return found


def runs_needed_for_good(p_bad: float, alpha: float) -> int:
    """Smallest N with (1 - p_bad)^N < alpha."""
    if not 0 < alpha < 1:
        raise ValueError("alpha must be between 0 and 1")
    if p_bad >= 1:
        return 1
    if p_bad <= 0:
        raise ValueError("p_bad must be above 0")
    return max(1, math.floor(math.log(alpha) / math.log(1 - p_bad)) + 1)


def default_max_runs(runs_for_good: int) -> int:
    """Runs after which an undecided point is a skip: room for N clean runs when up to about
    two runs in three are skips (unrelated crashes, vacuous or infrastructure runs)."""
    return 3 * runs_for_good + 6


def estimate_p_bad(bad: int, clean: int) -> float:
    """Rule of succession: the crash rate per exposed run, never 0 or 1 from finite evidence."""
    return (bad + 1) / (bad + clean + 2)


@dataclass(frozen=True)
class Tally:
    """The runs of one point, counted by evidence and by verdict label."""

    labels: Counter
    evidence: Counter

    @classmethod
    def of(cls, runs: Iterable[RunSummary], title: str | None = None) -> "Tally":
        labels: Counter = Counter()
        kinds: Counter = Counter()
        for run in runs:
            labels[run_label(run)] += 1
            kinds[evidence(run, title)] += 1
        return cls(labels, kinds)

    @property
    def bad(self) -> int:
        return self.evidence[Evidence.BAD]

    @property
    def clean(self) -> int:
        return self.evidence[Evidence.HANDLED] + self.evidence[Evidence.UNREACHED]

    @property
    def attempts(self) -> int:
        return self.bad + self.clean + self.evidence[Evidence.SKIP]

    @property
    def state(self) -> str | None:
        """For clean runs: did the bug's state occur (handled), never (unreached), or both."""
        handled, unreached = self.evidence[Evidence.HANDLED], self.evidence[Evidence.UNREACHED]
        if handled and unreached:
            return "mixed"
        return "handled" if handled else "unreached" if unreached else None


@dataclass(frozen=True)
class PointRule:
    """When a point's runs are decisive."""

    runs_for_good: int
    max_runs: int
    min_runs: int = 1  # the bad end runs at least this many (to measure p_bad)

    def decide(self, tally: Tally) -> PointVerdict | None:
        """good / bad / skip once decisive, None while more runs are needed."""
        if tally.bad and tally.attempts >= self.min_runs:
            return PointVerdict.BAD
        if tally.clean >= self.runs_for_good and tally.attempts >= self.min_runs:
            return PointVerdict.GOOD
        if tally.attempts >= self.max_runs:
            return PointVerdict.BAD if tally.bad else PointVerdict.SKIP
        return None

    def next_batch(self, tally: Tally) -> int:
        """How many runs to start next (they run in parallel): just enough for the earliest decision."""
        # a rule that can never say good (the bad end) just runs its minimum, then one by one
        good_in_reach = self.runs_for_good <= self.max_runs
        wanted = max(self.min_runs - tally.attempts, self.runs_for_good - tally.clean if good_in_reach else 1)
        return max(1, min(wanted, self.max_runs - tally.attempts))


def skip_reason(tally: Tally, rule: PointRule) -> str:
    shown = ", ".join(f"{n}x {label}" for label, n in sorted(tally.labels.items())) or "no runs"
    return (f"{tally.attempts} runs without a decision ({shown}): needs one target crash or "
            f"{rule.runs_for_good} clean exposed runs")


def false_good_probability(p_bad: float, clean: int) -> float:
    """P(a point that still crashes at rate p_bad showed `clean` clean runs in a row)."""
    return (1 - p_bad) ** clean


def confidence(p_bad: float, clean_runs_of_good_points: Iterable[int]) -> float:
    """P(no good verdict of the bisection was a crashing point that happened to stay clean).

    Bad verdicts are certain (a target crash is observed, not inferred); each good verdict is
    wrong with probability at most (1 - p_bad)^clean.
    """
    value = 1.0
    for clean in clean_runs_of_good_points:
        value *= 1 - false_good_probability(p_bad, clean)
    return value
