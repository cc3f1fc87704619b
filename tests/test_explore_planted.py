"""Planted bugs (benchmarks/planted/, issue 28 item 4) and the generic-load vocabulary the benchmark
measures against: every planted patch has a valid header, applies to its release's own file from
the wheel with the patch machinery every build uses (no fuzz), makes its header's claims true and
false before; the benchmark's matrix for it is one the campaign accepts. No engine runs here."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from kvrepro.explore.campaign import base_data
from kvrepro.explore.generator import LOAD, LOAD_KNOBS, RunSpec, apply, generate
from kvrepro.explore.vocabulary import PROFILE_PATH, knob
from kvrepro.spec.matrix import DEFAULT_MATRIX

_PATH = ROOT / "benchmarks" / "explore_planted.py"
_spec = importlib.util.spec_from_file_location("explore_planted", _PATH)
planted = importlib.util.module_from_spec(_spec)
sys.modules["explore_planted"] = planted  # dataclasses look their module up while the class is made
_spec.loader.exec_module(planted)

BUGS = planted.load_planted()


def test_the_table_names_reverts_and_mutations_of_each_component():
    assert len(BUGS) >= 4
    assert {b.kind for b in BUGS} == {"revert", "mutation", "clean"}
    assert {b.component for b in BUGS if b.kind == "mutation"} == {"scheduler", "kv-cache-manager", "connector"}
    for b in BUGS:
        # a control (kind clean, issue 51) expects nothing; every planted bug names what finds it
        assert (planted.PLANTED / b.patch).is_file() and bool(b.expect) == (b.kind != "clean"), b
        assert all(e.split(":", 1)[0] in ("crash", "corruption", "stall", "invariant") for e in b.expect), b
        assert b.kind != "revert" or b.upstream.startswith("https://github.com/vllm-project/vllm/pull/")


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_each_planted_patch_applies_to_its_release_and_does_what_its_header_says(bug, tmp_path):
    from kvrepro.builds import pristine_tree
    from kvrepro.builds.patching import apply_patch_stack, check_expectations, read_header, touched_files
    from kvrepro.spec.records import PatchRef

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
    # a `reach:` probe is an `if` of the patched file above the changed line (not taken: the code
    # after it, the planted line among it, ran), or the entry of the function the change is in
    # (`-<def line>><first statement>`, kvrepro/engine/branches.py)
    changed = [int(m) for m in re.findall(r"^@@ -(\d+)", path.read_text(), re.M)]
    for probe in bug.reach:
        name, _, arc = probe.rpartition(":")
        (rel,) = [r for r in touched_files(path) if str(r).endswith(name)]
        line = int(arc.split(">")[0])
        text = (tmp_path / rel).read_text().splitlines()[abs(line) - 1].strip()
        assert text.startswith("def " if line < 0 else "if "), probe
        assert any(0 < start - abs(line) < 30 for start in changed), probe


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
    # seconds: a miss counts the run time it spent; the reruns on the release are not in `seconds`
    secs = next(x for x in lines if x.startswith("unguided / guided seconds-to-find"))
    assert secs.endswith("3.00, 4.50; median 3.75"), secs
    assert any(x.startswith("b ") and " no " in x and ">5" in x for x in lines)


def test_a_guided_campaign_starts_from_the_catalogue_and_unguided_does_not():
    """The seed corpus: each catalogue entry's engine and load fragment once (entries with one
    fragment are one seed, named after both), replayed by runs 1..N with the entry's pinned seeds,
    and a mutation of a replay keeps the entry's name; unguided and generic campaigns get none."""
    from kvrepro.explore.campaign import campaign_corpus, next_spec
    from kvrepro.explore.generator import replay, seed_corpus
    from kvrepro.explore.state import CampaignRequest, CampaignState, RunRecord
    from kvrepro.suite.run import load as load_catalogue

    fragments = [("a", {"engine": {"block_size": 32, "geometry": {"hash_block_size": 16}}, "load": {"seed": 7},
                        "runs": {"requests": 400}}),
                 ("b", {"runs": {"requests": 200}}),  # the base matrix: no seed
                 ("c", {"engine": {"geometry": {"hash_block_size": 16}, "block_size": 32}, "load": {"seed": 7}}),
                 ("d", {"engine": {"connector": "capable"}, "load": {"schedule": "random"}})]
    corpus = seed_corpus(fragments)
    assert [s.seed_entry for s in corpus] == ["a+c", "d"]
    assert dict(corpus[0].changes) == {"engine.block_size": 32, "engine.geometry.hash_block_size": 16}
    assert corpus[0].load_seed == 7 and corpus[0].sim_seed is None
    again = replay(1, 3, corpus[0])
    assert again.index == 3 and again.changes == corpus[0].changes and again.load_seed == 7
    assert again.sim_seed is not None and again == replay(1, 3, corpus[0])
    data = base_data(DEFAULT_MATRIX)
    out = apply(again, data)
    assert out["engine"]["block_size"] == 32 and out["engine"]["geometry"] == {"hash_block_size": 16}
    assert out["load"]["seed"] == 7 and out["engine"]["model"] == data["engine"]["model"]
    child = generate(1, 9, "partial-prefix", None, parent=again)
    assert child.seed_entry == "a+c" and child.changes != again.changes and "from a+c: " in child.describe()
    assert RunSpec.from_json(json.loads(json.dumps(child.to_json()))) == child

    catalogue = load_catalogue()
    guided = CampaignRequest(base="0.30.0", seed=1)
    real = campaign_corpus(guided, catalogue)
    names = {n for s in real for n in s.seed_entry.split("+")}
    assert {"truncate-lagging-mamba", "capable-connector-mamba-state", "mamba-chunk-store-gap"} <= names
    assert real == campaign_corpus(guided, catalogue)  # the campaign seed's order, every time
    state = CampaignState(campaign_id="explore-x", request=guided,
                          runs=[RunRecord(spec=RunSpec(index=0), run_id="r0", verdict="SURVIVED", seconds=1.0)])
    assert next_spec(state, 0, "partial-prefix", real) == RunSpec(index=0)
    assert [next_spec(state, i, "partial-prefix", real).seed_entry for i in range(1, len(real) + 1)] == [
        s.seed_entry for s in real]
    assert next_spec(state, len(real) + 1, "partial-prefix", real).index == len(real) + 1
    for request in (CampaignRequest(base="0.30.0", seed=1, guided=False),
                    CampaignRequest(base="0.30.0", seed=1, vocabulary="load"),
                    CampaignRequest(base="0.30.0", seed=1, corpus=False)):
        assert campaign_corpus(request, catalogue) == ()
