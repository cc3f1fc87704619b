"""The bisection's decision rules and searches, with a scripted oracle in place of engine runs.

The oracle is a test double for running engines (which the e2e tests in test_bisect_e2e.py do
for real): these tests check the search logic alone -- which points it asks for, in what order,
and what it concludes -- where engine runs would take minutes and could not script skips.
"""

from __future__ import annotations

import pytest

from kvrepro.bisect.rules import (Evidence, PointRule, PointVerdict, RunSummary, Tally, confidence, estimate_p_bad, evidence,
                                  runs_needed_for_good)
from kvrepro.bisect.search import bisect_linear, ddmin, next_midpoint

G, B, S = PointVerdict.GOOD, PointVerdict.BAD, PointVerdict.SKIP


def run(verdict: str, outcome: str = "none", title: str = "", **more) -> RunSummary:
    return RunSummary(verdict=verdict, outcome=outcome, title=title, **more)


@pytest.mark.parametrize("record, expected", [
    (run("CRASH", "target"), Evidence.BAD),
    (run("CORRUPT"), Evidence.BAD),
    (run("SURVIVED"), Evidence.HANDLED),
    (run("UNREACHED"), Evidence.UNREACHED),
    (run("CRASH", "other_crash"), Evidence.SKIP),
    (run("VACUOUS"), Evidence.SKIP),
    (run("STALL"), Evidence.SKIP),
    (run("INFRA", "infra"), Evidence.SKIP),
    (run("INTERRUPTED"), Evidence.DROPPED),
    (run("SOMETHING_NEW"), Evidence.SKIP),
])
def test_run_evidence_table(record, expected):
    assert evidence(record) is expected


@pytest.mark.parametrize("record, expected", [
    # the shadow KV caught wrong KV, then something unrelated ended the run: corruption was seen
    (run("CRASH", "other_crash", kv_check="corrupt"), Evidence.BAD),
    (run("INTERRUPTED", kv_check="corrupt", stopped_because="interrupted"), Evidence.BAD),
    (run("CRASH", "other_crash", kv_check="ok"), Evidence.SKIP),
    (run("UNREACHED", kv_check="ok"), Evidence.UNREACHED),
    # INFRA stays a skip: wrong code ran, or the load did not test the engine
    (run("INFRA", "infra", kv_check="corrupt"), Evidence.SKIP),
])
def test_wrong_kv_is_bad_whatever_ended_the_run(record, expected):
    assert evidence(record) is expected


def test_with_a_title_corruption_does_not_decide():
    crashed = run("CRASH", "other_crash", "AssertionError in _apply_cow: x", kv_check="corrupt")
    assert evidence(crashed, title="update_state_after_alloc") is Evidence.SKIP
    assert evidence(run("CORRUPT", kv_check="corrupt"), title="x") is Evidence.HANDLED


def test_title_selects_the_crash_and_other_crashes_are_skips():
    other = run("CRASH", "other_crash", "AssertionError in _apply_cow: block_idx < len(req_blocks)")
    target = run("CRASH", "target", "AssertionError in update_state_after_alloc: x")
    assert evidence(other, title="_apply_cow") is Evidence.BAD
    assert evidence(target, title="_apply_cow") is Evidence.SKIP
    assert evidence(run("CORRUPT")) is Evidence.BAD
    assert evidence(run("CORRUPT"), title="_apply_cow") is Evidence.HANDLED  # lived; the named crash did not happen


@pytest.mark.parametrize("p, alpha, n", [(0.8, 0.05, 2), (0.5, 0.05, 5), (0.4, 0.05, 6), (0.99, 0.05, 1),
                                         (0.5, 0.01, 7)])
def test_runs_needed_for_good_is_the_smallest_n_below_alpha(p, alpha, n):
    assert runs_needed_for_good(p, alpha) == n
    assert (1 - p) ** n < alpha <= (1 - p) ** (n - 1)


def test_p_bad_never_claims_certainty():
    assert estimate_p_bad(3, 0) == pytest.approx(0.8)
    assert estimate_p_bad(1, 2) == pytest.approx(0.4)


def test_point_rule_bad_at_first_crash_good_after_n_clean_skip_at_max():
    rule = PointRule(runs_for_good=2, max_runs=4)
    assert rule.decide(Tally.of([run("SURVIVED")])) is None
    assert rule.decide(Tally.of([run("SURVIVED"), run("CRASH", "target")])) is B
    assert rule.decide(Tally.of([run("SURVIVED"), run("UNREACHED")])) is G
    skips = [run("VACUOUS"), run("INFRA"), run("CRASH", "other_crash"), run("SURVIVED")]
    assert rule.decide(Tally.of(skips)) is S
    assert rule.next_batch(Tally.of([run("SURVIVED")])) == 1
    assert rule.next_batch(Tally.of([])) == 2


def test_interrupted_runs_do_not_count():
    rule = PointRule(runs_for_good=1, max_runs=1)
    assert rule.decide(Tally.of([run("INTERRUPTED")])) is None
    # the shutdown traceback of an engine stopped by Ctrl-C is no crash; a target crash before it is
    stopped = run("CRASH", "other_crash", "EngineDeadError", stopped_because="interrupted")
    assert evidence(stopped) is Evidence.DROPPED
    assert evidence(run("CRASH", "target", stopped_because="interrupted")) is Evidence.BAD


def test_good_step_keeps_handled_and_unreached_apart():
    assert Tally.of([run("SURVIVED"), run("SURVIVED")]).state == "handled"
    assert Tally.of([run("UNREACHED")]).state == "unreached"
    assert Tally.of([run("UNREACHED"), run("SURVIVED")]).state == "mixed"


def test_bad_end_calibrates_before_deciding():
    rule = PointRule(runs_for_good=10**6, max_runs=6, min_runs=3)
    assert rule.decide(Tally.of([run("CRASH", "target")])) is None
    assert rule.next_batch(Tally.of([run("CRASH", "target")])) == 2
    assert rule.decide(Tally.of([run("CRASH", "target"), run("SURVIVED"), run("CRASH", "target")])) is B


def test_confidence_multiplies_each_good_verdicts_chance_of_being_right():
    assert confidence(0.8, [2, 2]) == pytest.approx((1 - 0.2 ** 2) ** 2)
    assert confidence(0.8, []) == 1.0


def scripted(verdicts: list[PointVerdict]):
    asked: list[int] = []

    def oracle(i: int) -> PointVerdict:
        asked.append(i)
        return verdicts[i]

    return oracle, asked


@pytest.mark.parametrize("change_at", range(1, 9))
def test_linear_finds_the_first_changed_point_for_a_fix(change_at):
    verdicts = [B] * change_at + [G] * (9 - change_at)
    oracle, asked = scripted(verdicts)
    outcome = bisect_linear(9, B, oracle)
    assert outcome.decided and outcome.first_new == change_at and outcome.last_old == change_at - 1
    assert 0 not in asked and 8 not in asked  # the ends were checked by the caller
    assert len(asked) <= 3  # log2(9) rounded up


def test_linear_finds_a_regression_too():
    oracle, _ = scripted([G, G, G, B, B, B])
    outcome = bisect_linear(6, G, oracle)
    assert outcome.first_new == 3


def test_linear_goes_around_skipped_points():
    oracle, asked = scripted([B, B, S, B, G, G, G])
    outcome = bisect_linear(7, B, oracle)
    assert outcome.decided and outcome.first_new == 4
    assert 2 not in asked or asked.count(2) == 1


def test_linear_reports_a_range_when_skips_hide_the_change():
    oracle, _ = scripted([B, S, S, G])
    outcome = bisect_linear(4, B, oracle)
    assert not outcome.decided
    assert (outcome.last_old, outcome.first_new, outcome.skipped) == (0, 3, [1, 2])


def test_prefetch_names_both_possible_next_midpoints():
    told: list[list[int]] = []
    oracle, asked = scripted([B] * 5 + [G] * 12)
    bisect_linear(17, B, oracle, prefetch=told.append)
    assert told[0] == sorted({next_midpoint(8, 16, set()), next_midpoint(0, 8, set())})
    for step, nxt in zip(told, asked[1:]):
        assert nxt in step  # the point probed next was always one of those prepared


def test_ddmin_finds_the_one_patch_that_removes_the_crash():
    def removes(subset):
        return G if "fix" in subset else B

    assert ddmin(["a", "b", "fix", "c"], removes) == ["fix"]


def test_ddmin_finds_a_pair_that_only_works_together_and_skips_unbuildable_subsets():
    def removes(subset):
        if "needs-base" in subset and "base" not in subset:
            return S  # would not apply
        return G if {"base", "needs-base"} <= set(subset) else B

    assert ddmin(["x", "base", "y", "needs-base"], removes) == ["base", "needs-base"]
