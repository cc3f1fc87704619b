"""Planted bugs (benchmarks/planted/, issue 28 item 4) and the generic-load vocabulary the benchmark
measures against: every planted patch has a valid header, applies to its release's own file from
the wheel with the patch machinery every build uses (no fuzz), makes its header's claims true and
false before; the benchmark's matrix for it is one the campaign accepts. No engine runs here."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from kvrepro.explore.generator import LOAD, LOAD_KNOBS, generate
from kvrepro.explore.vocabulary import PROFILE_PATH, knob

_PATH = ROOT / "benchmarks" / "explore_planted.py"
_spec = importlib.util.spec_from_file_location("explore_planted", _PATH)
planted = importlib.util.module_from_spec(_spec)
sys.modules["explore_planted"] = planted  # dataclasses look their module up while the class is made
_spec.loader.exec_module(planted)

BUGS = planted.load_planted()


def test_the_table_names_reverts_and_mutations_of_each_component():
    assert len(BUGS) >= 4
    assert {b.kind for b in BUGS} == {"revert", "mutation"}
    assert {b.component for b in BUGS if b.kind == "mutation"} == {"scheduler", "kv-cache-manager", "connector"}
    for b in BUGS:
        assert (planted.PLANTED / b.patch).is_file() and b.expect, b
        assert all(e.split(":", 1)[0] in ("crash", "corruption", "stall", "invariant") for e in b.expect), b
        assert b.kind != "revert" or b.upstream.startswith("https://github.com/vllm-project/vllm/pull/")


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_each_planted_patch_applies_to_its_release_and_does_what_its_header_says(bug, tmp_path):
    from kvrepro.builds import pristine_tree
    from kvrepro.builds.patching import apply_patch_stack, check_expectations, read_header, touched_files
    from kvrepro.records import PatchRef

    path = planted.PLANTED / bug.patch
    header = read_header(path)
    assert header.base == f"vllm {bug.base}" and header.title.startswith("PLANTED: ") and header.expects
    _, tree, _ = pristine_tree(bug.base)
    for rel in touched_files(path):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree / rel, tmp_path / rel)
    assert check_expectations(tmp_path, header), "the release as shipped must not already hold the claims"
    ref = PatchRef(name=bug.name, path=path, upstream=header.upstream,
                   sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    assert apply_patch_stack(tmp_path, [ref]) is None
    assert check_expectations(tmp_path, header) == []


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_the_benchmarks_matrix_for_a_planted_bug_is_one_the_campaign_runs(bug, tmp_path):
    from kvrepro.explore.campaign import base_data, check_request, run_matrix_for
    from kvrepro.explore.generator import RunSpec
    from kvrepro.explore.state import CampaignRequest

    path = planted.planted_matrix(bug, tmp_path)
    request = CampaignRequest(base=bug.base, patches=(bug.name,), budget_runs=1, matrix=str(path))
    check_request(request)
    loaded = run_matrix_for(RunSpec(index=0), base_data(path), request, path)
    (plan,) = loaded.plans()
    assert plan.base == bug.base and [p.name for p in plan.patches] == [bug.name]


def test_the_generic_load_changes_only_the_load_and_keeps_the_profile():
    """vocabulary `load`: what the benchmark's third column explores (no engine knob, no other profile)."""
    seen = set()
    for index in range(1, 80):
        spec = generate(3, index, "partial-prefix", vocabulary=LOAD)
        paths = {p for p, _ in spec.changes}
        assert paths and all(p.startswith("load.") for p in paths), spec
        assert PROFILE_PATH not in paths
        assert all(p in LOAD_KNOBS or knob(p).profile == "partial-prefix" for p in paths), spec
        seen |= paths
    assert set(LOAD_KNOBS) <= seen
    assert generate(3, 5, "partial-prefix", vocabulary=LOAD) != generate(3, 5, "partial-prefix")
    with pytest.raises(ValueError, match="vocabulary"):
        generate(3, 5, "partial-prefix", vocabulary="nope")


def test_the_benchmark_table_counts_a_miss_as_budget_plus_one():
    o = planted.Outcome
    outcomes = [o("a", "guided", True, 1, 0, 8, 10.0, "crash:x", "crash:x", "c1"),
                o("a", "unguided", True, 3, 2, 90, 30.0, "crash:x", "crash:x", "c2"),
                o("b", "guided", True, 2, 1, 60, 20.0, "corruption:y", "corruption:y", "c3"),
                o("b", "unguided", False, 6, None, 300, 90.0, None, None, "c4")]
    assert planted.runs_to_find(outcomes[3], 6) == 7.0
    lines = planted.table(outcomes, 6)
    assert "guided: found 2/2" in lines and "unguided: found 1/2" in lines
    ratio = next(x for x in lines if x.startswith("unguided / guided"))
    assert "3.00, 3.50; median 3.25" in ratio
    assert any(x.startswith("b ") and " no " in x and ">5" in x for x in lines)
