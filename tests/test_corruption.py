"""Corruption signatures (kvrepro/classify/corruption.py) and what they change downstream: the
verdict's title, `expect: CORRUPT(<defect>)`, the per-defect statistics and the report's words.

No engine runs here: the records are made the way the runner writes them. Each signature's test
log under tests/data/logs/ is a real GPU-free engine log; it must attribute to that signature.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrepro.report import render as report, stats
from kvrepro.report import document
from kvrepro.results import store as results
from kvrepro.classify import read_exposure
from kvrepro.classify.corruption import (UNKNOWN, ViolationClass, attribute, by_name, defects_of,
                                         known_corruptions, match_class)
from kvrepro.records import Outcome, RunResult, Signature, Verdict
from kvrepro.report.expectations import meets
from kvrepro.classify.verdict import corruption_title

from test_report import make_run

LOGS = Path(__file__).resolve().parent / "data" / "logs"
HOLE = "fa-hole-below-boundary"
NULL_STATE = "mamba-null-state"


def test_a_class_key_parses_and_prints_back_and_older_keys_still_read():
    cls = ViolationClass.parse("full_attention+offload/missing/hit")
    assert cls == ViolationClass("full_attention", True, "missing", "hit") and cls.key == "full_attention+offload/missing/hit"
    old = ViolationClass.parse("mamba")
    assert old == ViolationClass("mamba", False, "", "") and old.key == "mamba"


def test_each_class_goes_to_its_defect_and_an_unknown_one_stays_unknown():
    assert match_class("full_attention+offload/missing/hit").name == HOLE
    assert match_class("full_attention+offload/stale/hit").name == HOLE
    assert match_class("full_attention+offload/stale/inherited").name == HOLE  # the hole, served again
    # a hole left by a request without an offload hit, served again: the other defect's
    assert match_class("full_attention/foreign/inherited").name == "fa-hole-below-mamba-hit"
    assert match_class("mamba/null-block/hit").name == NULL_STATE
    # its prefix-match-unit face: the resume block is a fresh, unzeroed Mamba block (explore 0.26.0 findings
    # 002-007, docs/defect-family.md 3.6); with an offload hit it stays mamba-chunk-store-gap's
    for read in ("missing", "foreign", "wrong-state"):
        assert match_class(f"mamba/{read}/hit").name == NULL_STATE
        assert getattr(match_class(f"mamba+offload/{read}/hit"), "name", None) != NULL_STATE
    # the same reads by a running request (seen only under concurrency, unexplained): no known defect
    assert match_class("mamba/foreign/computed") is None and match_class("mamba/wrong-state/computed") is None
    assert match_class("full_attention+offload/foreign/hit").name == HOLE  # another group's data
    assert match_class("full_attention/foreign/hit").name == "fa-hole-below-mamba-hit"  # no offload hit
    # what neither hole produces: a load that put this request's own KV in the wrong place
    assert match_class("full_attention+offload/misplaced/hit") is None
    assert match_class("full_attention/stale/computed") is None
    assert match_class("full_attention+offload") is None  # an older engine's key: no read/region
    got = attribute({"full_attention+offload/missing/hit": 3, "full_attention+offload/stale/inherited": 2,
                     "mamba/null-block/hit": 1, "full_attention+offload/misplaced/hit": 4})
    assert got == {HOLE: 5, UNKNOWN: 4, NULL_STATE: 1}
    assert attribute({"full_attention/foreign/hit": 2}) == {"fa-hole-below-mamba-hit": 2}
    # without a Mamba group per-group hits cannot diverge: a hole there is some other, unknown defect
    # (e.g. tests/test_shadow_kv.py's skipped-load fixture on an attention-only model)
    assert attribute({"full_attention+offload/missing/hit": 1}, groups=("full_attention",)) == {UNKNOWN: 1}
    assert attribute({"full_attention+offload/missing/hit": 1}, groups=("mamba", "full_attention")) == {HOLE: 1}


def test_a_violation_names_the_request_the_load_sent_so_its_defect_has_a_first_request():
    """kvrepro's load sends X-Request-Id kvrepro-<index>; vLLM makes it cmpl-kvrepro-<index>-0-<hex>,
    which the shadow KV's violation line repeats: request numbers count from 1, per class and per defect."""
    from kvrepro.classify.corruption import first_request

    log = "\n".join([
        "(EngineCore pid=1) kvrepro-shadow: installed groups=0:mamba/16,1:full_attention/16",
        "(EngineCore pid=1) kvrepro-shadow: violation step=9 class=full_attention/foreign/hit request "
        "cmpl-kvrepro-6-0-969e6c0c group 1 (full_attention) block index 45 (GPU block 52): stale KV",
        "(EngineCore pid=1) kvrepro-shadow: violation step=12 class=mamba/null-block/hit request "
        "cmpl-kvrepro-9-0-1a2b3c4d group 0 (mamba) block index 3: null block",
        "(EngineCore pid=1) kvrepro-shadow: violation step=14 class=full_attention/foreign/hit request "
        "cmpl-kvrepro-3-0-5e6f7a8b group 1 (full_attention) block index 2 (GPU block 7): stale KV",
        "(EngineCore pid=1) kvrepro-shadow: violation step=15 class=mamba/null-block/hit request "
        "cmpl-0a1b2c-0-5e6f7a8b group 0 (mamba) block index 2: a request some other client named",
        "(EngineCore pid=1) kvrepro-shadow: counts checks=20 violations=4 by=full_attention/foreign/hit:2,"
        "mamba/null-block/hit:2", ""])
    x = read_exposure(log)
    assert x.kv_first_request_by_class == {"full_attention/foreign/hit": 4, "mamba/null-block/hit": 10}
    assert first_request("fa-hole-below-mamba-hit", x.kv_first_request_by_class, x.kv_groups) == 4
    assert first_request(NULL_STATE, x.kv_first_request_by_class, x.kv_groups) == 10
    assert first_request(HOLE, x.kv_first_request_by_class, x.kv_groups) is None


def test_a_cut_off_counts_line_takes_the_first_violations_class():
    assert defects_of(2, {}, "mamba/null-block/hit") == {NULL_STATE: 2}
    assert defects_of(1, {}, None) == {UNKNOWN: 1}
    assert defects_of(0, {"x": 1}, None) == {}


def test_every_signature_has_words_upstream_links_a_fix_and_a_test_log():
    names = [c.name for c in known_corruptions()]
    assert HOLE in names and NULL_STATE in names
    for c in known_corruptions():
        assert c.title and c.why and c.classes
        assert all(u.startswith("https://github.com/") for u in c.upstream)
        # a fix is named with the upstream change that made it; a defect still open upstream (found
        # here: cow-chained-copy) names neither, and its title must not borrow a fixed one's number
        assert not c.fixed_by or c.upstream, f"{c.name}: fixed_by without the upstream change"
        if not c.fixed_by:
            assert "#" not in c.title, f"{c.name}: an open defect's title names an issue number"

        assert c.test_log and (LOGS / c.test_log).is_file(), f"{c.name}: add tests/data/logs/{c.test_log}"


@pytest.mark.parametrize("signature", known_corruptions(), ids=lambda c: c.name)
def test_each_test_log_attributes_to_its_own_signature(signature):
    exposure = read_exposure((LOGS / signature.test_log).read_text())
    assert set(exposure.kv_groups) == {"mamba", "full_attention"}  # from the installed line
    defects = defects_of(exposure.kv_violations, exposure.kv_violations_by, exposure.kv_first_violation_class,
                         exposure.kv_groups)
    assert exposure.kv_violations > 0 and signature.name in defects
    assert exposure.kv_first_violation_class and exposure.kv_first_violation.startswith("step=")


def test_the_title_names_the_defects_in_a_stable_order_and_quotes_an_unknown_violation():
    two = corruption_title({NULL_STATE: 9, HOLE: 1})
    assert two == corruption_title({HOLE: 5, NULL_STATE: 2})  # repetitions group under one title
    assert f"[{HOLE}]" in two and f"[{NULL_STATE}]" in two and two.index(HOLE) < two.index(NULL_STATE)
    assert by_name(HOLE).title in two
    assert corruption_title({UNKNOWN: 3}, "step=4 request r1 ...") == "silent KV corruption: step=4 request r1 ..."


def test_expect_can_name_the_defect():
    assert meets("CORRUPT", "CORRUPT", {HOLE: 1})
    assert meets(f"CORRUPT({HOLE})", "CORRUPT", {HOLE: 1, NULL_STATE: 2})
    assert not meets(f"CORRUPT({HOLE})", "CORRUPT", {NULL_STATE: 2})
    assert not meets(f"CORRUPT({HOLE}, {NULL_STATE})", "CORRUPT", {HOLE: 1})
    assert meets(f"CORRUPT({HOLE})|SURVIVED", "SURVIVED", {})
    assert not meets(f"CORRUPT({HOLE})", "SURVIVED", {})


def _result(build: str, rep: int, verdict: Verdict, defects: dict[str, int] | None = None,
            target: bool = False) -> RunResult:
    return RunResult(build=build, rep=rep, verdict=verdict, outcome=Outcome.TARGET if target else Outcome.NONE,
                     title="t", trigger_count=5, external_hit_calls=5, requests=600, seconds=1.0,
                     kv_check="corrupt" if defects else "ok", kv_violations=sum((defects or {}).values()),
                     kv_defects=dict(defects or {}),
                     signature=Signature("AssertionError", "update_state_after_alloc", "f.py", 1, "x") if target else None)


def test_per_defect_rates_count_what_each_question_can_see():
    crashed = [_result("A", i, Verdict.CRASH, target=True) for i in range(3)]
    corrupt = [_result("B", i, Verdict.CORRUPT, {HOLE: 4}) for i in range(3)]
    clean = [_result("E", i, Verdict.UNREACHED) for i in range(3)]
    hole = stats.corruption_kind(HOLE, "hole")
    assert stats.rate(crashed, stats.TARGET_CRASH) == stats.Rate(3, 3)
    assert stats.rate(corrupt, stats.TARGET_CRASH) == stats.Rate(0, 3)  # served the budget: no assertion
    assert stats.rate(crashed, hole) == stats.Rate(0, 0)  # each crashed first: censored, not "0 of 3"
    assert stats.rate(corrupt, hole) == stats.Rate(3, 3)
    assert stats.rate(clean, hole) == stats.Rate(0, 3)  # UNREACHED under the shadow KV: evidence of no hole
    assert stats.rate(clean, stats.ANY_FAILURE) == stats.Rate(0, 0)  # as before: UNREACHED proves no fix
    other = _result("A", 0, Verdict.CRASH)
    assert stats.TARGET_CRASH.outcome(other) is None  # another crash ended the run first


def test_patch_effects_per_kind_see_the_assertion_go_and_the_corruption_come():
    builds = {"A": [], "B": ["pr-52807"]}
    runs = {"A": [_result("A", i, Verdict.CRASH, target=True) for i in range(3)],
            "B": [_result("B", i, Verdict.CORRUPT, {HOLE: 2}) for i in range(3)]}
    (any_failure,) = stats.patch_effects(builds, runs)
    assert any_failure.p_value == 1.0 and not any_failure.lowered  # 3/3 -> 3/3: the old, blind answer
    (target,) = stats.patch_effects(builds, runs, kind=stats.TARGET_CRASH)
    assert target.p_value == pytest.approx(0.05) and target.lowered and not target.raised
    (hole,) = stats.patch_effects(builds, runs, kind=stats.corruption_kind(HOLE, "hole"))
    assert not hole.measured  # A crashed before any corruption could show


def _write_defects(run: results.MatrixRun, build: str, classes: dict[str, int]) -> None:
    for rep_dir in sorted((run.path / build).iterdir()):
        if not rep_dir.is_dir():
            continue
        import json

        path = rep_dir / "verdict.json"
        data = json.loads(path.read_text())
        data.update(verdict="CORRUPT", kv_check="corrupt", kv_violations=sum(classes.values()),
                    kv_violations_by=classes, title="recorded before the defect had a name")
        path.write_text(json.dumps(data))


def test_the_report_says_in_words_what_each_patch_proved(tmp_path):
    c, s = Verdict.CRASH, Verdict.SURVIVED
    run = make_run(tmp_path, {"A": [c, c, c], "B": [s, s, s], "C": [c, c, c], "D": [s, s, s]},
                   {"A": "CRASH(target)", "B": f"CORRUPT({HOLE})", "C": "CRASH(target)", "D": "CORRUPT"})
    for build in "BD":
        _write_defects(run, build, {"full_attention+offload/foreign/hit": 7})
    run = results.load_run(tmp_path, run.run_id)
    # read back, the recorded classes are attributed by today's table, and the title names the defect
    assert run.build("B").runs[0].kv_defects == {HOLE: 7}
    assert run.build("B").runs[0].title == corruption_title({HOLE: 7})
    claims = report.proved(run)
    boundary = next(c for c in claims if c.startswith("`pr-52807`"))
    assert "removes the target crash" in boundary and "A 3/3 → B 0/3, p = 0.05" in boundary
    assert f"still reads wrong KV: {HOLE} in B 3/3, D 3/3" in boundary
    mtp = next(c for c in claims if c.startswith("`pr-52771`"))
    assert "does not remove the target crash" in mtp
    assert report.mismatches(run) == []  # B's expect names the defect it showed
    markdown = (document.write_report(run)[0]).read_text()
    assert markdown.index("What this matrix proved") < markdown.index("| base | build |")
    assert "| `pr-52807` | target | A → B | 3/3 | 0/3 | 0.05 | 1 |" in markdown
    data = report.matrix_json(run)
    assert data["builds"]["B"]["failure_rates"][HOLE]["failed"] == 3
    assert any(e["kind"] == "target" and e["p_value"] == 0.05 for e in data["patch_effects"])


def test_a_build_two_patches_above_its_closest_build_gets_a_stack_effect():
    """E = D + two backports: no build is one patch below it, so the report compares it with D."""
    builds = {"A": [], "D": ["p1", "p2"], "E": ["p1", "p2", "b1", "b2"], "F": ["p1"]}
    runs = {"D": [_result("D", i, Verdict.CORRUPT, {HOLE: 3}) for i in range(3)],
            "E": [_result("E", i, Verdict.UNREACHED) for i in range(3)]}
    hole = stats.corruption_kind(HOLE, HOLE)
    (effect,) = stats.stack_effects(builds, runs, kind=hole)
    assert (effect.patch, effect.without, effect.with_) == ("b1 + b2", "D", "E")
    assert effect.lowered and effect.p_value == pytest.approx(0.05)
    # builds one patch apart are patch_effects' business, not this one's
    assert [e.with_ for e in stats.stack_effects({"A": [], "F": ["p1"]}, runs)] == []
