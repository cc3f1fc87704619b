"""Statistics of the matrix: how much a few repetitions prove, checked against hand computations."""

import math

import pytest

from kvrepro.builds.records import BuildManifest
from kvrepro.records import Outcome, RunResult, Verdict
from kvrepro.report.stats import (Rate, StateRate, decisive, factorials, fisher_one_sided, patch_effects, rate, state_rate)

Z = 1.959963984540054  # the 97.5% normal quantile


def _runs(verdict: Verdict, n: int, state: int = 0) -> list[RunResult]:
    return [RunResult(build="x", rep=i, verdict=verdict, outcome=Outcome.NONE, title="", trigger_count=1,
                      external_hit_calls=1, requests=10, seconds=1.0, state_count=state) for i in range(n)]


def test_fisher_one_sided_known_values():
    assert fisher_one_sided(3, 3, 0, 3) == pytest.approx(1 / math.comb(6, 3))  # = 0.05
    assert fisher_one_sided(3, 3, 0, 3) == pytest.approx(0.05)
    assert fisher_one_sided(1, 1, 0, 1) == pytest.approx(0.5)
    assert fisher_one_sided(3, 3, 3, 3) == 1.0
    assert fisher_one_sided(10, 10, 0, 10) == pytest.approx(1 / 184756)
    # 2/3 against 0/3: tables at least as extreme are (2,0) and (3,... impossible): C(3,2)C(3,0)/C(6,2)
    assert fisher_one_sided(2, 3, 0, 3) == pytest.approx(3 / 15)


def test_wilson_interval_by_hand():
    lo, hi = Rate(3, 3).wilson()
    assert lo == pytest.approx(3 / (3 + Z * Z)) and hi == 1.0  # p = 1: lower bound n / (n + z^2) = 0.4385
    lo, hi = Rate(0, 3).wilson()
    assert lo == 0.0 and hi == pytest.approx(Z * Z / (3 + Z * Z))
    lo, hi = Rate(1, 2).wilson()  # p = 1/2: centre 1/2, half-width z*sqrt(1/8 + z^2/16)/(1 + z^2/2)
    half = Z * math.sqrt(0.25 / 2 + Z * Z / 16) / (1 + Z * Z / 2)
    assert (lo, hi) == (pytest.approx(0.5 - half), pytest.approx(0.5 + half))


def test_clopper_pearson_and_zero_event_bound_by_hand():
    lo, hi = Rate(3, 3).clopper_pearson()
    assert lo == pytest.approx(0.025 ** (1 / 3)) and hi == 1.0  # all failed: lower = (alpha/2)^(1/n)
    lo, hi = Rate(0, 3).clopper_pearson()
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 3))
    assert Rate(0, 3).zero_event_upper() == pytest.approx(1 - 0.05 ** (1 / 3))  # 0.632
    assert Rate(0, 5).zero_event_upper() == pytest.approx(0.4507, abs=1e-4)
    assert Rate(1, 3).zero_event_upper() is None and Rate(0, 0).zero_event_upper() is None


def test_failures_per_thousand_states_with_an_exact_poisson_interval():
    s = StateRate(failures=0, occurrences=300)
    assert s.per_1000 == 0.0
    lo, hi = s.interval()
    assert lo == 0.0 and hi == pytest.approx(1000 * -math.log(0.025) / 300)  # chi2(2)/2 quantile = -ln(alpha/2)
    s = StateRate(failures=3, occurrences=12)
    assert s.per_1000 == 250.0
    assert StateRate(2, 0).interval() is None
    runs = _runs(Verdict.CRASH, 2, state=3) + _runs(Verdict.SURVIVED, 1, state=30) + _runs(Verdict.VACUOUS, 1, 99)
    assert state_rate(runs) == StateRate(failures=2, occurrences=36)


def test_what_counts_as_a_failure_and_what_is_not_counted():
    runs = (_runs(Verdict.CRASH, 1) + _runs(Verdict.CORRUPT, 1) + _runs(Verdict.SURVIVED, 2)
            + _runs(Verdict.VACUOUS, 1) + _runs(Verdict.UNREACHED, 1) + _runs(Verdict.INFRA, 1))
    assert rate(runs) == Rate(crashes=2, trials=4)


def test_patch_effects_pair_builds_differing_by_one_patch():
    stacks = {"A": ["c"], "B": ["c", "fix"], "C": ["c", "mtp"], "D": ["c", "mtp", "fix"]}
    crash, live = _runs(Verdict.CRASH, 3), _runs(Verdict.SURVIVED, 3)
    runs = {"A": crash, "B": live, "C": crash, "D": live + _runs(Verdict.VACUOUS, 1)}
    effects = {(e.without, e.with_): e for e in patch_effects(stacks, runs)}
    assert set(effects) == {("A", "B"), ("A", "C"), ("B", "D"), ("C", "D")}
    assert effects[("C", "D")].patch == "fix" and effects[("C", "D")].p_value == pytest.approx(0.05)
    assert effects[("B", "D")].with_rate.trials == 3  # VACUOUS proves nothing: not counted
    assert effects[("A", "C")].p_value == 1.0


def test_two_by_two_effects_and_interaction_by_hand():
    stacks = {"A": ["c"], "B": ["c", "fix"], "C": ["c", "mtp"], "D": ["c", "mtp", "fix"]}
    crash, live = _runs(Verdict.CRASH, 3), _runs(Verdict.SURVIVED, 3)
    (f,) = factorials(stacks, {"A": crash, "B": live, "C": crash, "D": live})
    assert (f.patch_p, f.patch_q, f.none, f.p, f.q, f.both) == ("fix", "mtp", "A", "B", "C", "D")
    assert f.effect_p.estimate == -1.0 and f.effect_q.estimate == 0.0 and f.interaction.estimate == 0.0
    # Price-Bonett with m = 4 cells: each 3/3 becomes 3.5/4 = 0.875, each 0/3 becomes 0.5/4 = 0.125
    half = Z * math.sqrt(4 * 0.875 * 0.125 / 4)
    assert (f.interaction.low, f.interaction.high) == (pytest.approx(-half), pytest.approx(half))
    half_main = Z * math.sqrt(4 * 0.25 * 0.875 * 0.125 / 4)
    assert f.effect_p.high == pytest.approx(-0.75 + half_main)  # adjusted centre (0.125 - 0.875)
    # m = 2 (a simple effect) is Agresti-Caffo: 4/5 and 1/5
    assert f.p_alone.high == pytest.approx(-0.6 + Z * math.sqrt(2 * 0.8 * 0.2 / 5))
    # a patch that only works together with the other: interaction -1
    (g,) = factorials(stacks, {"A": crash, "B": crash, "C": crash, "D": live})
    assert g.interaction.estimate == -1.0 and g.p_alone.estimate == 0.0 and g.p_with_q.estimate == -1.0


def test_stopping_rule():
    assert decisive(Rate(3, 3), expected_failure=True).decisive
    assert not decisive(Rate(2, 2), expected_failure=True).decisive
    assert decisive(Rate(1, 2), expected_failure=True).decisive  # a pass already breaks CRASH
    assert not decisive(Rate(0, 4), expected_failure=False).decisive  # 1 - 0.05^(1/4) = 53% >= 50%
    assert decisive(Rate(0, 5), expected_failure=False).decisive  # 45% < 50%
    assert decisive(Rate(1, 1), expected_failure=False).decisive
    assert not decisive(Rate(1, 2), expected_failure=None).decisive
    assert not decisive(Rate(0, 5), expected_failure=None).decisive  # exact interval 0-52% includes 50%
    assert decisive(Rate(0, 6), expected_failure=None).decisive  # 0-46%


def test_adaptive_rounds_stop_each_build_by_the_rule():
    """runner._decided applies the stopping rule per build; INFRA builds stop after one run."""
    from kvrepro.builds.records import BuildArtifact
    from kvrepro.spec.records import BuildPlan
    from kvrepro.matrix.runner import _decided

    ok = BuildArtifact(plan=BuildPlan("B", "0.26.0", ()), ref="/overlay", manifest=BuildManifest())
    broken = BuildArtifact(plan=BuildPlan("X", "0.26.0", ()), ref=None, manifest=BuildManifest(), error="hunk #1 failed")
    assert not _decided(ok, _runs(Verdict.SURVIVED, 4), "SURVIVED")
    assert _decided(ok, _runs(Verdict.SURVIVED, 5), "SURVIVED")
    assert _decided(ok, _runs(Verdict.SURVIVED, 4) + _runs(Verdict.CRASH, 1), "SURVIVED")
    assert not _decided(ok, _runs(Verdict.CRASH, 2), "CRASH(target)")
    assert _decided(ok, _runs(Verdict.CRASH, 3), "CRASH(target)")
    assert not _decided(ok, _runs(Verdict.VACUOUS, 9), "SURVIVED")  # nothing counted yet: go on
    assert not _decided(broken, [], "CRASH(target)") and _decided(broken, _runs(Verdict.INFRA, 1), "CRASH(target)")
    assert _decided(ok, _runs(Verdict.VACUOUS, 3), "VACUOUS")


def test_every_number_matches_scipy_stats_on_every_small_table():
    """The report computes its quantiles with scipy.special and Fisher's test with exact integer
    sums (scipy.stats costs about 1.3 CPU s to import); scipy.stats itself is the oracle here, on
    every table of up to 12 runs a side and every count up to 40 failures."""
    from scipy import stats

    from kvrepro.report.stats import fisher_two_sided

    for a_n in range(0, 13):
        for b_n in range(0, 13):
            for a in range(a_n + 1):
                for b in range(b_n + 1):
                    table = [[a, a_n - a], [b, b_n - b]]
                    if a_n and b_n and a + b:
                        want = stats.fisher_exact(table, alternative="greater").pvalue
                        assert fisher_one_sided(a, a_n, b, b_n) == pytest.approx(want, rel=1e-9), table
                    assert fisher_two_sided(a, a_n, b, b_n) == pytest.approx(stats.fisher_exact(table).pvalue,
                                                                             rel=1e-9), table
    for n in range(1, 41):
        for k in range(n + 1):
            ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
            assert Rate(k, n).clopper_pearson() == pytest.approx((ci.low, ci.high), rel=1e-9, abs=1e-12), (k, n)
    for k in range(41):
        low, high = StateRate(k, 1000).interval()
        want_low = 0.0 if k == 0 else stats.chi2.ppf(0.025, 2 * k) / 2
        assert (low, high) == pytest.approx((want_low, stats.chi2.ppf(0.975, 2 * k + 2) / 2), rel=1e-9), k
    lo, hi = Rate(2, 7).wilson()
    z = stats.norm.ppf(0.975)
    p, n = 2 / 7, 7
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert (lo, hi) == pytest.approx((centre - half, centre + half), rel=1e-12)
