"""Statistics of the matrix: how much a few repetitions prove."""

from kvrepro.stats import Rate, fisher_one_sided, patch_effects


def test_fisher_one_sided_known_values():
    assert fisher_one_sided(3, 3, 0, 3) == 0.05  # 1 / C(6, 3)
    assert fisher_one_sided(1, 1, 0, 1) == 0.5
    assert fisher_one_sided(3, 3, 3, 3) == 1.0
    assert abs(fisher_one_sided(10, 10, 0, 10) - 1 / 184756) < 1e-12


def test_wilson_interval_brackets_the_rate():
    lo, hi = Rate(3, 3).wilson()
    assert 0.4 < lo < 0.5 and hi == 1.0
    lo, hi = Rate(0, 3).wilson()
    assert lo == 0.0 and 0.5 < hi < 0.6


def test_patch_effects_pair_builds_differing_by_one_patch():
    stacks = {"A": ["c"], "B": ["c", "fix"], "C": ["c", "mtp"], "D": ["c", "mtp", "fix"]}
    crash = [{"verdict": "CRASH"}] * 3
    live = [{"verdict": "SURVIVED"}] * 3
    runs = {"A": crash, "B": live, "C": crash, "D": live + [{"verdict": "VACUOUS"}]}
    effects = {(e.without, e.with_): e for e in patch_effects(stacks, runs)}
    assert set(effects) == {("A", "B"), ("A", "C"), ("B", "D"), ("C", "D")}
    assert effects[("C", "D")].patch == "fix" and effects[("C", "D")].p_value == 0.05
    assert effects[("B", "D")].with_rate.trials == 3  # VACUOUS proves nothing: not counted
    assert effects[("A", "C")].p_value == 1.0


def test_corrupt_and_unreached_runs_did_not_crash():
    """A fix that turns 3/3 crashes into 3/3 CORRUPT runs lowers the crash rate (p = 0.05); the
    corruption is reported as its own verdict, not folded into the crash rate."""
    from kvrepro.stats import rate

    assert rate([{"verdict": "CORRUPT"}, {"verdict": "UNREACHED"}, {"verdict": "STALL"}]) == Rate(0, 2)
    stacks = {"A": ["c"], "B": ["c", "fix"]}
    effects = patch_effects(stacks, {"A": [{"verdict": "CRASH"}] * 3, "B": [{"verdict": "CORRUPT"}] * 3})
    assert [(e.without, e.with_, e.p_value) for e in effects] == [("A", "B", 0.05)]
