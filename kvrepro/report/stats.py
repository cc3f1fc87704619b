"""How much a handful of repetitions proves: numbers a maintainer can quote.

Three crashes out of three against zero out of three is p = 0.05 (one-sided Fisher exact): the
report says so, so that nobody ships a fix on a 1-of-1 coincidence. What is computed here:

* per build and per kind of failure (:class:`FailureKind`: any failure, the target crash, each
  named corruption defect), the failure rate (for "any failure" a run fails when it CRASHes or
  is CORRUPT and passes when it SURVIVED; every other verdict proves nothing about the code and
  is not counted; each kind says what it counts), its exact
  Clopper-Pearson and its Wilson 95% interval, and for zero failures the one-sided upper bound
  ``1 - alpha ** (1 / n)`` ("0 of 3 is consistent with a rate up to 63%");
* failures per 1,000 occurrences of the bug's state, with an exact Poisson interval: how often the
  state, once reached, ends in a crash;
* for every pair of builds one patch apart, the one-sided Fisher exact p-value that adding the
  patch lowered the failure rate by chance;
* for every 2x2 (a stack, plus patch P, plus patch Q, plus both), each patch's main effect and the
  interaction on the risk-difference scale with adjusted-Wald intervals (Price & Bonett 2004: add
  2/m failures and 4/m runs to each cell of an m-cell contrast, which stays sensible at 0/3 and 3/3);
* the adaptive-repetition stopping rule (:func:`decisive`) stated in docs/statistics.md.

scipy does the distributions; the code here only says which question each number answers. The
quantiles come from ``scipy.special`` (the functions scipy.stats' ``norm``, ``beta`` and ``chi2``
call themselves), not from ``scipy.stats``: importing scipy.stats costs about 1.3 CPU seconds,
scipy.special about 0.4, and every command that writes a report pays it (measured in
benchmarks/cli_start.py). Fisher's exact test is the hypergeometric tail summed in exact integer
arithmetic (``math.comb``): what ``scipy.stats.fisher_exact`` computes, without its import;
tests/test_stats.py checks both against scipy.stats on every small table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..records import Outcome, RunResult, Verdict


def _special():
    """scipy.special, imported on first use: a command that reaches this module only through
    another (``suite list``, a bad-input exit of ``matrix run``) computes nothing with it."""
    from scipy import special

    return special


def _normal_quantile(q: float) -> float:
    return float(_special().ndtri(q))  # scipy.stats.norm.ppf


def _chi2_quantile(q: float, df: float) -> float:
    return 2 * float(_special().gammaincinv(df / 2, q))  # scipy.stats.chi2.ppf


def _beta_quantile(q: float, a: float, b: float) -> float:
    return float(_special().betaincinv(a, b, q))  # scipy.stats.beta.ppf


def _hypergeometric(table: Sequence[Sequence[int]]) -> tuple[int, list[int]]:
    """The 2x2 table's top-left count and the weights comb(r1, x) * comb(r2, c1 - x) of every
    top-left count x its margins allow, from x = lo upwards (proportional to the probabilities)."""
    (a, b), (c, d) = table
    r1, r2, c1 = a + b, c + d, a + c
    lo, hi = max(0, c1 - r2), min(r1, c1)
    return a - lo, [math.comb(r1, x) * math.comb(r2, c1 - x) for x in range(lo, hi + 1)]


def _fisher_greater(table: Sequence[Sequence[int]]) -> float:
    """scipy.stats.fisher_exact(table, alternative="greater"): P(top-left count >= observed)."""
    at, weights = _hypergeometric(table)
    return sum(weights[at:]) / sum(weights)


def _fisher_two_sided(table: Sequence[Sequence[int]]) -> float:
    """scipy.stats.fisher_exact(table): the probability of every table of these margins no more
    likely than the observed one (exact, so ties are ties without scipy's 1e-7 tolerance)."""
    at, weights = _hypergeometric(table)
    return min(1.0, sum(w for w in weights if w <= weights[at]) / sum(weights))


FAILED = (Verdict.CRASH, Verdict.CORRUPT)  # the bug showed: the engine died or served wrong KV
PASSED = (Verdict.SURVIVED,)  # the bug's path ran and the engine got through it
COUNTED = FAILED + PASSED  # VACUOUS, UNREACHED, STALL, INFRA, INTERRUPTED prove nothing either way
CONFIDENCE = 0.95
SIGNIFICANT = 0.05  # the p-value below which the report says a patch changed a failure rate


@dataclass(frozen=True)
class FailureKind:
    """One question a run answers: "did it fail this way?". ``outcome(run)`` is True (it did),
    False (it ran far enough to show it and did not) or None (the run says nothing about it: it
    is not counted).

    * :data:`ANY_FAILURE`: CRASH or CORRUPT against SURVIVED, the matrix's overall question;
    * :data:`TARGET_CRASH`: the target signature's crash. A run that served its budget (CORRUPT
      or SURVIVED) did not hit it; another crash ended the run before it could: not counted;
    * :func:`corruption_kind`: one named corruption defect (kvrepro.classify.corruption). A run
      that showed it failed, whatever its verdict; a run that served its budget with the shadow
      KV checking (CORRUPT, SURVIVED or UNREACHED) and did not show it passed; a crash that
      did not show it ended the run first and is censored, not counted.
    """

    name: str
    label: str
    outcome: Callable[[RunResult], bool | None]


def _any_outcome(run: RunResult) -> bool | None:
    return run.verdict in FAILED if run.verdict in COUNTED else None


def _target_outcome(run: RunResult) -> bool | None:
    if run.verdict is Verdict.CRASH:
        return True if run.outcome is Outcome.TARGET else None
    return False if run.verdict in (Verdict.CORRUPT, Verdict.SURVIVED) else None


ANY_FAILURE = FailureKind("any", "any failure (crash or corruption)", _any_outcome)
TARGET_CRASH = FailureKind("target", "the target crash", _target_outcome)


def corruption_kind(name: str, label: str) -> FailureKind:
    def outcome(run: RunResult) -> bool | None:
        if run.kv_defects.get(name):
            return True
        if run.verdict in (Verdict.CORRUPT, Verdict.SURVIVED, Verdict.UNREACHED) and run.kv_check != "off":
            return False
        return None
    return FailureKind(name, label, outcome)


@dataclass(frozen=True)
class Rate:
    """Failures out of counted runs of one build."""

    crashes: int
    trials: int  # CRASH + CORRUPT + SURVIVED runs

    @property
    def value(self) -> float | None:
        return self.crashes / self.trials if self.trials else None

    def wilson(self, confidence: float = CONFIDENCE) -> tuple[float, float]:
        """Wilson score interval: good coverage at small n, never outside [0, 1]."""
        if self.trials == 0:
            return (0.0, 1.0)
        z = _normal_quantile(1 - (1 - confidence) / 2)
        n, p = self.trials, self.crashes / self.trials
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        # at 0/n and n/n the bound is exactly 0 or 1; rounding would print 5.6e-17
        low = 0.0 if self.crashes == 0 else max(0.0, centre - half)
        high = 1.0 if self.crashes == self.trials else min(1.0, centre + half)
        return (low, high)

    def clopper_pearson(self, confidence: float = CONFIDENCE) -> tuple[float, float]:
        """Exact (conservative) binomial interval from the beta distribution."""
        if self.trials == 0:
            return (0.0, 1.0)
        k, n, alpha = self.crashes, self.trials, 1 - confidence
        # what scipy.stats.binomtest(k, n).proportion_ci(method="exact") computes
        low = 0.0 if k == 0 else _beta_quantile(alpha / 2, k, n - k + 1)
        high = 1.0 if k == n else _beta_quantile(1 - alpha / 2, k + 1, n - k)
        return (low, high)

    def zero_event_upper(self, confidence: float = CONFIDENCE) -> float | None:
        """With no failure in n runs, the largest failure rate not ruled out: 1 - alpha^(1/n).

        This is the one-sided Clopper-Pearson bound (about 3/n, the "rule of three"). None when
        there was a failure or no run.
        """
        if self.crashes or not self.trials:
            return None
        return 1 - (1 - confidence) ** (1 / self.trials)


def rate(runs: Iterable[RunResult], kind: FailureKind = ANY_FAILURE) -> Rate:
    outcomes = [kind.outcome(r) for r in runs]
    counted = [o for o in outcomes if o is not None]
    return Rate(crashes=sum(counted), trials=len(counted))


@dataclass(frozen=True)
class StateRate:
    """Failures per 1,000 occurrences of the bug's state (summed over a build's counted runs)."""

    failures: int
    occurrences: int

    @property
    def per_1000(self) -> float | None:
        return 1000 * self.failures / self.occurrences if self.occurrences else None

    def interval(self, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
        """Exact Poisson (Garwood) interval of the per-1,000 rate, from the chi-square quantiles."""
        if not self.occurrences:
            return None
        alpha = 1 - confidence
        k = self.failures
        low = 0.0 if k == 0 else _chi2_quantile(alpha / 2, 2 * k) / 2
        high = _chi2_quantile(1 - alpha / 2, 2 * k + 2) / 2
        return (1000 * low / self.occurrences, 1000 * high / self.occurrences)


def state_rate(runs: Iterable[RunResult]) -> StateRate:
    counted = [r for r in runs if r.verdict in COUNTED]
    return StateRate(failures=sum(r.verdict in FAILED for r in counted),
                     occurrences=sum(r.state_count for r in counted))


def fisher_one_sided(a_crash: int, a_n: int, b_crash: int, b_n: int) -> float:
    """P(B fails this rarely or less | both have the same failure probability): Fisher's exact test,
    one-sided, for "B's rate is lower than A's"."""
    if a_n == 0 or b_n == 0 or a_crash + b_crash == 0:
        return 1.0
    table = [[a_crash, a_n - a_crash], [b_crash, b_n - b_crash]]
    return _fisher_greater(table)


def fisher_two_sided(a_crash: int, a_n: int, b_crash: int, b_n: int) -> float:
    """P(a difference at least this large by chance): Fisher's exact test, two-sided, for "the
    two runs' failure rates differ" (``kvrepro results compare``)."""
    table = [[a_crash, a_n - a_crash], [b_crash, b_n - b_crash]]
    return _fisher_two_sided(table)


def fisher_raised(a_crash: int, a_n: int, b_crash: int, b_n: int) -> float:
    """The other side: P(B fails this often or more by chance), for "the patch brought a failure in"."""
    return fisher_one_sided(b_crash, b_n, a_crash, a_n)


@dataclass(frozen=True)
class PatchEffect:
    patch: str
    without: str  # build without the patch
    with_: str  # build with it
    without_rate: Rate
    with_rate: Rate
    p_value: float  # that adding the patch lowered the failure rate by chance
    kind: FailureKind = ANY_FAILURE
    p_raised: float = 1.0  # that adding the patch raised it by chance

    @property
    def measured(self) -> bool:
        """Both builds have counted runs for this kind of failure."""
        return bool(self.without_rate.trials and self.with_rate.trials)

    @property
    def lowered(self) -> bool:
        return self.measured and self.p_value <= SIGNIFICANT + 1e-9  # 3/3 vs 0/3 is 0.05 up to rounding

    @property
    def raised(self) -> bool:
        return self.measured and self.p_raised <= SIGNIFICANT + 1e-9


def _adds_one(a_stack: Sequence[str], b_stack: Sequence[str]) -> str | None:
    """The patch b adds to a, when b is a plus exactly one patch (order aside)."""
    added = [p for p in b_stack if p not in a_stack]
    if len(b_stack) == len(a_stack) + 1 and len(added) == 1 and all(p in b_stack for p in a_stack):
        return added[0]
    return None


def stack_effects(builds: Mapping[str, Sequence[str]], runs: Mapping[str, Sequence[RunResult]],
                  kind: FailureKind = ANY_FAILURE) -> list[PatchEffect]:
    """For a build that no other build reaches by one patch (E = D + two backports), the effect of
    what it adds to its closest build below it (the largest stack it contains); ``patch`` names
    the added patches joined by " + "."""
    effects = []
    for b, b_stack in builds.items():
        if any(_adds_one(a_stack, b_stack) for a_stack in builds.values()):
            continue  # patch_effects covers it one patch at a time
        below = [(len(a_stack), a) for a, a_stack in builds.items()
                 if a != b and len(a_stack) < len(b_stack) and all(p in b_stack for p in a_stack)]
        if not below:
            continue
        a = max(below)[1]
        added = " + ".join(p for p in b_stack if p not in builds[a])
        ra, rb = rate(runs.get(a, []), kind), rate(runs.get(b, []), kind)
        effects.append(PatchEffect(added, a, b, ra, rb, fisher_one_sided(ra.crashes, ra.trials, rb.crashes, rb.trials),
                                   kind, fisher_raised(ra.crashes, ra.trials, rb.crashes, rb.trials)))
    return effects


def patch_effects(builds: Mapping[str, Sequence[str]], runs: Mapping[str, Sequence[RunResult]],
                  bases: Mapping[str, str] | None = None, kind: FailureKind = ANY_FAILURE) -> list[PatchEffect]:
    """One entry per pair of builds (on the same base, when ``bases`` says) whose stacks differ by
    exactly one added patch, for one kind of failure."""
    effects = []
    bases = bases or {}
    for a, a_stack in builds.items():
        for b, b_stack in builds.items():
            if bases.get(a) != bases.get(b):
                continue  # across releases more than one patch differs
            patch = _adds_one(a_stack, b_stack)
            if patch is not None:
                ra, rb = rate(runs.get(a, []), kind), rate(runs.get(b, []), kind)
                effects.append(PatchEffect(patch, a, b, ra, rb,
                                           fisher_one_sided(ra.crashes, ra.trials, rb.crashes, rb.trials), kind,
                                           fisher_raised(ra.crashes, ra.trials, rb.crashes, rb.trials)))
    return effects


@dataclass(frozen=True)
class Contrast:
    """A difference of failure rates with its adjusted-Wald 95% interval."""

    estimate: float
    low: float
    high: float


def _contrast(cells: Sequence[tuple[Rate, float]], confidence: float = CONFIDENCE) -> Contrast | None:
    """sum(c_i * p_i) with the Price-Bonett adjusted-Wald interval; None if a cell has no run."""
    if any(r.trials == 0 for r, _ in cells):
        return None
    m = sum(1 for _, c in cells if c)
    z = _normal_quantile(1 - (1 - confidence) / 2)
    estimate = sum(c * r.crashes / r.trials for r, c in cells)
    adjusted = [((r.crashes + 2 / m) / (r.trials + 4 / m), r.trials + 4 / m, c) for r, c in cells]
    centre = sum(c * p for p, _, c in adjusted)
    half = z * math.sqrt(sum(c * c * p * (1 - p) / n for p, n, c in adjusted))
    return Contrast(estimate, max(-1.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class Factorial:
    """A 2x2 of builds: ``none`` (the common stack), ``p`` (+P), ``q`` (+Q) and ``both``.

    Effects are changes of the failure rate (negative: the patch lowers it). ``effect_p`` is P's
    average effect over Q absent and present; ``p_alone``/``p_with_q`` are the two simple
    effects; ``interaction`` is ``p_with_q - p_alone`` (0: P does the same with or without Q).
    """

    patch_p: str
    patch_q: str
    none: str
    p: str
    q: str
    both: str
    effect_p: Contrast
    effect_q: Contrast
    p_alone: Contrast
    p_with_q: Contrast
    q_alone: Contrast
    q_with_p: Contrast
    interaction: Contrast
    kind: FailureKind = ANY_FAILURE


def factorials(builds: Mapping[str, Sequence[str]], runs: Mapping[str, Sequence[RunResult]],
               kind: FailureKind = ANY_FAILURE) -> list[Factorial]:
    """Every 2x2 among the builds (each found once, patches in the order the builds are listed),
    for one kind of failure."""
    found: list[Factorial] = []
    seen: set[frozenset[str]] = set()
    names = list(builds)
    for none in names:
        for p_build in names:
            patch_p = _adds_one(builds[none], builds[p_build])
            if patch_p is None:
                continue
            for q_build in names:
                patch_q = _adds_one(builds[none], builds[q_build])
                if patch_q is None or patch_q == patch_p:
                    continue
                both = next((b for b in names if _adds_one(builds[p_build], builds[b]) == patch_q
                             and _adds_one(builds[q_build], builds[b]) == patch_p), None)
                key = frozenset((none, p_build, q_build, both or ""))
                if both is None or key in seen:
                    continue
                seen.add(key)
                r0, rp, rq, rb = (rate(runs.get(n, []), kind) for n in (none, p_build, q_build, both))
                contrasts = {
                    "effect_p": _contrast([(r0, -0.5), (rp, 0.5), (rq, -0.5), (rb, 0.5)]),
                    "effect_q": _contrast([(r0, -0.5), (rp, -0.5), (rq, 0.5), (rb, 0.5)]),
                    "p_alone": _contrast([(r0, -1), (rp, 1)]),
                    "p_with_q": _contrast([(rq, -1), (rb, 1)]),
                    "q_alone": _contrast([(r0, -1), (rq, 1)]),
                    "q_with_p": _contrast([(rp, -1), (rb, 1)]),
                    "interaction": _contrast([(r0, 1), (rp, -1), (rq, -1), (rb, 1)]),
                }
                if any(c is None for c in contrasts.values()):
                    continue
                found.append(Factorial(patch_p, patch_q, none, p_build, q_build, both, **contrasts,  # type: ignore[arg-type]
                                       kind=kind))
    return found


@dataclass(frozen=True)
class Decision:
    """The adaptive-repetition rule's call for one build after some runs."""

    decisive: bool
    reason: str


def decisive(r: Rate, expected_failure: bool | None, *, confidence: float = CONFIDENCE,
             max_rate_if_fixed: float = 0.5) -> Decision:
    """The stopping rule for adaptive repetitions (stated in docs/statistics.md).

    A build whose expectation is a failure (CRASH/CORRUPT) is decided once it has failed in every
    counted run so far and at least ``min_runs`` of them (3: 3/3 against 0/3 is what reaches
    Fisher p = 0.05), or as soon as any run passed (the expectation is then already broken).
    A build expected to SURVIVE is decided once the zero-event upper bound of its failure rate
    drops below ``max_rate_if_fixed`` (at 95%: 5 clean runs give 45%), or at its first failure.
    A build with no expectation is decided once its Clopper-Pearson interval excludes 0.5.
    """
    min_runs = 3
    if expected_failure is True:
        if r.trials - r.crashes > 0:
            return Decision(True, f"{r.trials - r.crashes} of {r.trials} counted runs passed")
        if r.crashes >= min_runs:
            return Decision(True, f"{r.crashes}/{r.trials} failed")
        return Decision(False, f"{r.crashes}/{r.trials} failed, {min_runs} needed")
    if expected_failure is False:
        if r.crashes:
            return Decision(True, f"{r.crashes} of {r.trials} counted runs failed")
        bound = r.zero_event_upper(confidence)
        if bound is not None and bound < max_rate_if_fixed:
            return Decision(True, f"0/{r.trials} failed: rate < {bound:.0%} at {confidence:.0%}")
        return Decision(False, f"0/{r.trials} failed, bound {bound if bound is not None else 1:.0%} "
                               f">= {max_rate_if_fixed:.0%}")
    low, high = r.clopper_pearson(confidence)
    if r.trials and (high < 0.5 or low > 0.5):
        return Decision(True, f"{r.crashes}/{r.trials}: interval {low:.0%}-{high:.0%} excludes 50%")
    return Decision(False, f"{r.crashes}/{r.trials}: interval {low:.0%}-{high:.0%} includes 50%")
