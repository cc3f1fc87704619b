"""kvrepro explore: the generator, titles and deduplication, the request invariant, the state's round
trip (no engine), and one small campaign on vLLM 0.26.0 that must count the target crash against the
catalogue, not as new. The engine is the GPU-free one (the real vLLM scheduler, KV-cache manager and
connector; the model executor faked: no GPU here)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import ROOT
from kvrepro.classify.corruption import attribute
from kvrepro.errors import BadInputError
from kvrepro.explore.campaign import (base_data, campaign_corpus, guided_weights, next_spec, parent_for, parse_budget,
                                     run_matrix_for)
from kvrepro.explore.coverage import credit, features
from kvrepro.explore.generator import RunSpec, apply, generate, replay
from kvrepro.explore.judge import (KNOWN, NEW, REGRESSION, Failure, invariant_failures, judge_failure,
                                   run_failures)
from kvrepro.explore.state import (CampaignRequest, CampaignState, FindingRecord, JudgedRecord, RunRecord)
from kvrepro.explore.vocabulary import KNOBS
from kvrepro.records import LoadSummary, Outcome, RunResult, Signature, Verdict
from kvrepro.spec.matrix import DEFAULT_MATRIX
from kvrepro.suite.run import load as load_catalogue

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

TARGET = Signature("AssertionError", "update_state_after_alloc",
                   "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", 530,
                   "num_locally_computed_tokens <= num_locally_computed_gpu_blocks * tokens_per_block")


def _run(verdict: Verdict = Verdict.SURVIVED, **fields) -> RunResult:
    base = dict(build="explore", rep=0, verdict=verdict, outcome=Outcome.NONE, title="", trigger_count=0,
                external_hit_calls=0, requests=10, seconds=1.0)
    base.update(fields)
    return RunResult(**base)


# --- generator ------------------------------------------------------------------------------------

def test_the_generator_is_a_function_of_seed_and_index_and_run_0_is_the_base():
    first = [generate(5, i, "partial-prefix") for i in range(30)]
    again = [generate(5, i, "partial-prefix") for i in range(30)]
    other = [generate(6, i, "partial-prefix") for i in range(30)]
    assert first == again
    assert first != other
    assert first[0] == RunSpec(index=0) and first[0].describe() == "base matrix as is"
    assert all(s.changes and s.load_seed is not None for s in first[1:])
    assert len({json.dumps(s.to_json()) for s in first}) == 30


def test_every_generated_run_is_a_valid_matrix_and_each_knob_is_used():
    """The spec's own validation (file:line errors) accepts every composition; the campaign would
    record an invalid one as INVALID, which would waste budget."""
    data = base_data(DEFAULT_MATRIX)
    request = CampaignRequest(base="0.30.0", budget_runs=1)  # engine.connector capable: 0.28.0+
    used = set()
    for seed in range(2):
        for index in range(60):
            spec = generate(seed, index, "partial-prefix")
            loaded = run_matrix_for(spec, data, request, DEFAULT_MATRIX)
            assert loaded.matrix.runs.repetitions == 1 and list(loaded.matrix.builds) == ["explore"]
            used.update(path for path, _ in spec.changes)
    assert used == {k.path for k in KNOBS}


def test_another_profile_drops_the_base_profiles_own_settings():
    data = base_data(DEFAULT_MATRIX)
    assert data["load"]["profile"] == "partial-prefix" and "family_share" in data["load"]
    out = apply(RunSpec(index=1, changes=(("load.profile", "multi-turn"), ("load.pressure", 4.0)), load_seed=9), data)
    assert out["load"]["profile"] == "multi-turn" and out["load"]["pressure"] == 4.0 and out["load"]["seed"] == 9
    assert "family_share" not in out["load"] and out["load"]["max_tokens"] == data["load"]["max_tokens"]
    assert data["load"]["profile"] == "partial-prefix"  # the base is not changed


def test_a_mutation_that_changes_the_profile_keeps_no_setting_of_the_old_one():
    """Every mutation of a corpus entry's run (its profile's own settings among its changes) is a valid
    matrix: a knob of the old profile picked after the profile changed is not set (it was: INVALID
    runs, `load.schedule` on shared_prefix)."""
    from kvrepro.explore.generator import _mutate
    import random

    data = base_data(DEFAULT_MATRIX)
    request = CampaignRequest(base="0.30.0", budget_runs=1)
    parent = RunSpec(index=3, changes=(("load.schedule", "random"), ("engine.sim.num_gpu_blocks", 80)),
                     seed_entry="cross-group-eviction-assert")
    changed = 0
    for seed in range(400):
        spec = _mutate(random.Random(seed), 4, parent, "partial-prefix", {"load.profile=shared_prefix": 50.0}, "all")
        profile = dict(spec.changes).get("load.profile", "partial-prefix")
        changed += profile != "partial-prefix"
        run_matrix_for(spec, data, request, DEFAULT_MATRIX)  # raises on a setting the profile does not have
    assert changed > 20  # the case was exercised


def test_weights_steer_the_choice():
    weights = {"engine.sim.load_steps=4": 40.0}
    guided = Counter(dict(generate(1, i, "partial-prefix", weights).changes).get("engine.sim.load_steps")
                     for i in range(1, 201))
    uniform = Counter(dict(generate(1, i, "partial-prefix").changes).get("engine.sim.load_steps")
                      for i in range(1, 201))
    assert guided[4] > 3 * uniform[4], (guided, uniform)


def test_budget_parsing():
    assert parse_budget("20") == (20, None)
    assert parse_budget("90s") == (None, 90.0) and parse_budget("30m") == (None, 1800.0)
    assert parse_budget("10d") == (None, 864_000.0)  # d is a unit (issue 44: 99999999h was taken, 10d refused)
    for bad in ("0", "x", "99999999h", "-3", "1000001"):
        with pytest.raises(BadInputError, match="--budget"):
            parse_budget(bad)


# --- titles, deduplication, invariant ---------------------------------------------------------------

def test_titles_and_the_catalogue():
    catalogue = load_catalogue()
    crash = run_failures(_run(Verdict.CRASH, outcome=Outcome.TARGET, signature=TARGET))
    assert [f.key for f in crash] == ["crash:offload_update_state_after_alloc"]
    judged = judge_failure(crash[0], catalogue, "0.26.0", ())
    assert (judged.status, judged.entry, judged.expected) == (KNOWN, "offload-boundary-assert", "present")
    # the catalogue says 0.26.0 + the boundary fix no longer crashes there: seen again, it is a regression
    assert judge_failure(crash[0], catalogue, "0.26.0", ("pr-52807",)).status == REGRESSION
    odd = Signature("KeyError", "get_num_new_matched_tokens", "vllm/v1/core/sched/scheduler.py", 1, "x[y]")
    unknown = run_failures(_run(Verdict.CRASH, outcome=Outcome.OTHER_CRASH, signature=odd))
    assert unknown[0].key == "crash:KeyError:get_num_new_matched_tokens:scheduler.py"
    assert judge_failure(unknown[0], catalogue, "0.26.0", ()).status == NEW

    # measured on build E (docs/explore.md): a Mamba state loaded from a chunk never stored, and a
    # later request served it again. It was NEW; read against vLLM's source it is the catalogue's
    # mamba-chunk-store-gap (#51358), so its classes are that signature's and count against the entry
    found_on_e = {"mamba+offload/missing/hit": 4, "mamba+offload/missing/inherited": 2}
    assert attribute(found_on_e, ("mamba", "full_attention")) == {"mamba-chunk-store-gap": 6}
    e_stack = ("pr-49146", "pr-52771", "pr-52807", "pr-48425", "pr-50344")
    gap = run_failures(_run(Verdict.CORRUPT, kv_defects={"mamba-chunk-store-gap": 6}, kv_violations_by=found_on_e))
    assert [f.key for f in gap] == ["corruption:mamba-chunk-store-gap"]
    judged = judge_failure(gap[0], catalogue, "0.26.0", e_stack)
    assert (judged.status, judged.entry, judged.expected) == (KNOWN, "mamba-chunk-store-gap", "present")
    assert judge_failure(gap[0], catalogue, "0.28.0", ()).expected == "present"
    assert judge_failure(gap[0], catalogue, "0.29.0", ()).status == REGRESSION  # 0.29.0 stores boundary states

    # a class no signature knows, next to a known defect's: named by its classes, hit and inherited folded
    # (mamba/wrong-state/hit, once this example, is mamba-null-state's prefix-match-unit face now)
    corrupt = run_failures(_run(Verdict.CORRUPT, kv_defects={"fa-hole-below-boundary": 3, "unknown": 6},
                                kv_violations_by={"mamba+offload/foreign/hit": 4, "mamba+offload/foreign/inherited": 2,
                                                  "full_attention+offload/missing/hit": 3}))
    assert {f.key for f in corrupt} == {"corruption:fa-hole-below-boundary",
                                        "corruption:unknown:mamba+offload/foreign"}
    assert "(hit x4, inherited x2)" in next(f.title for f in corrupt if not f.signature)
    known = next(f for f in corrupt if f.signature)
    assert judge_failure(known, catalogue, "0.26.0", ("pr-52807",)).entry == "fa-hole-below-boundary"
    assert judge_failure(next(f for f in corrupt if not f.signature), catalogue, "0.26.0", ()).status == NEW

    stall = run_failures(_run(Verdict.STALL, deferred_lookups=7, load=LoadSummary(5, 5, 0, 30.0, "stall")))
    assert stall[0].key == "stall" and "deferred_lookups 7" in stall[0].title
    stalled = _run(Verdict.STALL, loads_behind_deferred=2)
    assert judge_failure(stall[0], catalogue, "0.28.0", (), stalled).entry == "skipped-waiting-deadlock"
    assert judge_failure(stall[0], catalogue, "0.31.0", (), stalled).status == REGRESSION
    # three stall entries are present on 0.30.0 and this run reached the paths of two: a replay of
    # recompute-failed-load-stall's load (explore-20261202-155324-862d run 8) is that entry's stall
    faulted = _run(Verdict.STALL, offload_load_jobs=40, injected_load_faults=12)
    seeded = judge_failure(stall[0], catalogue, "0.30.0", (), faulted, ("recompute-failed-load-stall",))
    assert (seeded.status, seeded.entry) == (KNOWN, "recompute-failed-load-stall")
    assert judge_failure(stall[0], catalogue, "0.30.0", (), faulted, ("mtp-async-load-deadlock",)).entry == \
        "mtp-async-load-deadlock"
    # a seed entry that does not claim this build does not win over one that does
    assert judge_failure(stall[0], catalogue, "0.33.0", (), faulted, ("mtp-async-load-deadlock",)).entry == \
        "recompute-failed-load-stall"

    # #52807's own alignment assert on E's stack, with a prefix-match unit finer than the block
    # (explore-20261202-155325-3cda run 2): the catalogue's boundary-fix-unaligned-hit; 0.30.0 has #49502
    alignment = Signature("AssertionError", "update_state_after_alloc",
                          "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", 1,
                          "num_locally_computed_tokens % tokens_per_block == 0")
    aligned = run_failures(_run(Verdict.CRASH, outcome=Outcome.OTHER_CRASH, signature=alignment))
    assert [f.key for f in aligned] == ["crash:offload_boundary_alignment"]
    on_e = judge_failure(aligned[0], catalogue, "0.26.0", e_stack)
    assert (on_e.status, on_e.entry, on_e.expected) == (KNOWN, "boundary-fix-unaligned-hit", "present")
    assert judge_failure(aligned[0], catalogue, "0.30.0", ()).status == REGRESSION
    assert run_failures(_run()) == []


def _lines(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_request_invariant(tmp_path):
    _lines(tmp_path / "trace.jsonl", [{"format": "kvrepro-trace"}] + [{"index": i, "tokens": [1]} for i in range(5)])
    _lines(tmp_path / "load.jsonl", [
        {"index": 0, "ok": True, "completion_tokens": 8, "error": None},
        {"index": 1, "ok": False, "error": "HTTP 500: engine dead"},
        {"index": 2, "ok": False, "error": ""},
        {"index": 3, "ok": True, "completion_tokens": 0, "error": None},
        {"index": 0, "ok": True, "completion_tokens": 8, "error": None},
    ])
    keys = {f.key: f.title for f in invariant_failures(tmp_path, "budget")}
    assert set(keys) == {"invariant:answered-twice", "invariant:error-without-reason",
                         "invariant:ok-without-completion", "invariant:never-ended"}
    assert "request 5" in keys["invariant:never-ended"] and "request 3" in keys["invariant:error-without-reason"]
    # a run the load ended early abandons requests in flight: that is not the engine's failure
    assert "invariant:never-ended" not in {f.key for f in invariant_failures(tmp_path, "engine_dead")}
    _lines(tmp_path / "load.jsonl", [{"index": i, "ok": True, "completion_tokens": 8} for i in range(5)])
    assert invariant_failures(tmp_path, "budget") == []


def test_coverage_features_and_credit():
    run = _run(trigger_count=5, kv_stored={"mamba": 2}, kv_violations_by={"c": 1})
    found = features(run, ["crash:x"])
    assert {"verdict:SURVIVED", "trigger_count:2^3", "kv_stored.mamba", "violation:c", "failure:crash:x",
            "requests:2^4"} <= found
    assert "external_hit_calls:2^0" not in found  # zero is not reached
    assert credit({"a=1": 2.0}, ["a=1", "b=2"], 3) == {"a=1": 5.0, "b=2": 4.0}
    assert credit({"a=1": 2.0}, ["a=1"], 0) == {"a=1": 2.0}


def test_the_state_survives_a_round_trip():
    spec = generate(3, 4, "partial-prefix")
    judged = JudgedRecord("crash", "crash:k", "CRASH k", "new", None, None, None)
    state = CampaignState(
        campaign_id="explore-x", request=CampaignRequest(base="0.26.0", patches=("pr-52807",), budget_seconds=60.0,
                                                         seed=3, guided=False),
        status="interrupted", started=1.5, elapsed_s=12.25,
        runs=[RunRecord(spec=spec, run_id="r1", verdict="CRASH(other)", seconds=3.0, failures=(judged,),
                        new_features=("verdict:CRASH",)),
              RunRecord(spec=RunSpec(index=5), run_id=None, verdict="INVALID", seconds=0.0, error="bad")],
        coverage=["verdict:CRASH"], weights={"load.concurrency=2": 3.0},
        findings={"crash:k": FindingRecord("crash:k", "crash", "CRASH k", "new", None, 4, 2, "findings/001-crash-k")})
    back = CampaignState.from_json(json.loads(json.dumps(state.to_json())))
    assert back == state
    assert [f.key for f in back.new_findings] == ["crash:k"]
    assert back.runs[0].failures[0].failure() == Failure("crash", "crash:k", "CRASH k")
    assert back.budget_left()  # 12 of 60 s spent


def test_a_new_failure_becomes_a_finding_folder_and_a_known_one_does_not(tmp_path):
    """record_run on recorded verdicts (no engine): the unknown crash gets findings/001-.../ with its
    run's trace and a draft entry; the second run with it only counts; the target crash is known."""
    import yaml

    from kvrepro.explore.campaign import record_run

    catalogue = load_catalogue()
    state = CampaignState(campaign_id="explore-t", request=CampaignRequest(base="0.26.0", budget_runs=3))
    data = base_data(DEFAULT_MATRIX)
    odd = Signature("KeyError", "get_num_new_matched_tokens", "vllm/v1/core/sched/scheduler.py", 1, "x[y]")
    for index, (sig, outcome) in enumerate([(TARGET, Outcome.TARGET), (odd, Outcome.OTHER_CRASH),
                                            (odd, Outcome.OTHER_CRASH)]):
        spec = generate(0, index, "partial-prefix")
        run_dir = tmp_path / f"run{index}"
        run_dir.mkdir()
        _lines(run_dir / "trace.jsonl", [{"format": "kvrepro-trace"}, {"index": 0, "tokens": [1, 2]}])
        _lines(run_dir / "load.jsonl", [{"index": 0, "ok": False, "error": "HTTP 500: EngineCore died"}])
        run = _run(Verdict.CRASH, outcome=outcome, signature=sig, run_dir=str(run_dir),
                   load=LoadSummary(1, 0, 1, 1.0, "engine_dead", 0))
        loaded = run_matrix_for(spec, data, state.request, DEFAULT_MATRIX)
        state.runs.append(record_run(state, tmp_path, catalogue, spec, loaded, run, f"r{index}"))
    assert [f.status for f in state.runs[0].failures] == ["known"]
    finding = state.findings["crash:KeyError:get_num_new_matched_tokens:scheduler.py"]
    assert (finding.status, finding.first_run, finding.runs) == ("new", 1, 2)
    folder = tmp_path / finding.folder
    assert folder.name == "001-crash-keyerror-get-num-new-matched-tokens-scheduler-py"
    assert (folder / "trace.jsonl").read_text() == (tmp_path / "run1" / "trace.jsonl").read_text()
    draft = yaml.safe_load((folder / "draft-entry.yaml").read_text())
    assert draft["kind"] == "crash" and draft["present_in"] == ["0.26.0"] and "engine" in draft["matrix"]
    assert json.loads((folder / "finding.json").read_text())["spec"] == state.runs[1].spec.to_json()
    assert len(list((tmp_path / "findings").iterdir())) == 1
    from kvrepro.matrix import load_matrix

    rerun = load_matrix(folder / "matrix.yaml")  # runs as is: its patches were copied next to it
    assert list(rerun.matrix.builds) == ["explore"] and rerun.matrix.runs.repetitions == 1
    assert [f.key for f in state.new_findings] == [finding.key]
    # guided: the first run reached everything first; the third reached nothing new
    assert state.runs[0].new_features and not state.runs[2].new_features


# --- one real campaign --------------------------------------------------------------------------------

def kvrepro(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.parametrize("args, says", [
    (["--base", "0.99.0", "--budget", "1"], "--base 0.99.0: no GPU-free engine adapter"),
    (["--base", "0.26.0", "--patch", "nope", "--budget", "1"], "--patch nope: not declared under patches"),
    (["--base", "0.26.0", "--budget", "1x"], "--budget '1x'"),
    (["--base", "0.26.0"], "needs --base RELEASE and --budget"),
    (["--resume", "explore-nothere"], "--resume explore-nothere: no explore.json"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, says):
    root = tmp_path / "results"
    proc = kvrepro("explore", *args, "--results", str(root))
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert not root.exists()


def test_a_resumed_campaign_is_judged_against_the_catalogue_it_was_started_with(tmp_path):
    """The catalogue folder is pinned in explore.json (was: a resume without --catalogue judged its
    runs against the default one, so a crash NEW in the first session became KNOWN in the second).
    An explicit --catalogue still wins, with a note; a pinned folder that is gone is one line, exit 2,
    before any engine starts, and explore.json is left as it was."""
    from kvrepro.explore import new_campaign
    from kvrepro.explore.commands import resumed_catalogue

    own = tmp_path / "my-defects"
    own.mkdir()
    (own / "one.yaml").write_text((ROOT / "defects" / "offload-boundary-assert.yaml").read_text())
    root = tmp_path / "results"
    state, folder = new_campaign(root, CampaignRequest(base="0.26.0", budget_runs=1, catalogue=str(own.resolve())))
    assert CampaignState.from_json(json.loads((folder / "explore.json").read_text())).request.catalogue == str(
        own.resolve())

    assert resumed_catalogue(state.campaign_id, str(own.resolve()), None) == (own.resolve(), None)
    other, note = resumed_catalogue(state.campaign_id, str(own.resolve()), ROOT / "defects")
    assert other == (ROOT / "defects").resolve() and str(own.resolve()) in note and str(other) in note
    assert resumed_catalogue(state.campaign_id, "", None) == (None, None)  # recorded before it was pinned

    (own / "one.yaml").unlink()
    own.rmdir()
    before = (folder / "explore.json").read_text()
    proc = kvrepro("explore", "--resume", state.campaign_id, "--results", str(root))
    assert proc.returncode == 2, proc.stderr
    said = " ".join(proc.stderr.split())
    assert f"{own.resolve()}, is gone; pass --catalogue FOLDER" in said and "Traceback" not in proc.stderr, said
    assert (folder / "explore.json").read_text() == before


def test_a_two_run_campaign_on_0_26_0_counts_the_target_crash_against_the_catalogue(tmp_path, runtime_python):
    """Run 0 is the base matrix, which crashes 0.26.0 on the target within a few requests: it must be
    KNOWN (offload-boundary-assert), never a finding; --ci then exits 0. A resume with a larger
    budget continues the same campaign (run 2 is the one the generator makes for index 2)."""
    root = tmp_path / "results"
    proc = kvrepro("explore", "--base", "0.26.0", "--budget", "2", "--requests", "30", "--seed", "1",
                   "--results", str(root), "--json", "--ci", "--no-minimize")  # minimizing: test_explore_findings.py
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    state = CampaignState.from_json(result["state"])
    assert len(state.runs) == 2 and state.status == "complete"
    assert state.request.catalogue == str((ROOT / "defects").resolve())  # the default here, pinned
    # run 1 replays a corpus entry at concurrency 2, whose interleaving varies: a new finding there
    # (seen once in CI) is --ci's exit 1, and the target crash of run 0 must still never be one
    assert proc.returncode == (1 if state.new_findings else 0), state.new_findings
    assert "crash:offload_update_state_after_alloc" not in [f.key for f in state.new_findings]
    first = state.runs[0]
    assert first.verdict == "CRASH(target)", first
    assert ("crash:offload_update_state_after_alloc", "known", "offload-boundary-assert") in [
        (f.key, f.status, f.entry) for f in first.failures]
    # the shadow KV's corruption on the way there is catalogued for 0.26.0 too
    assert all(f.status == "known" for f in first.failures), first.failures
    assert state.findings["crash:offload_update_state_after_alloc"].folder is None
    assert not list((root / state.campaign_id).glob("findings/*/draft-entry.yaml")) or state.new_findings
    assert state.coverage and first.new_features
    # the engine reported the arcs of the code under test it ran (kvrepro/engine/arcs.py): the
    # scheduler's and the connector's among them (how many depends on how much of the last batch
    # the crash let through: 98 once in CI, usually more)
    assert first.arcs > 50, first
    assert any(c.startswith("arc:v1/core/sched/scheduler.py:") for c in state.coverage)
    assert any(c.startswith("arc:distributed/kv_transfer/kv_connector/v1/offloading/") for c in state.coverage)
    assert (root / state.campaign_id / "runs" / first.run_id).is_dir()

    proc = kvrepro("explore", "--resume", state.campaign_id, "--budget", "3", "--results", str(root), "--json", "--ci")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    resumed = CampaignState.from_json(json.loads(proc.stdout)["state"])
    assert resumed.campaign_id == state.campaign_id and len(resumed.runs) == 3
    assert resumed.runs[:2] == state.runs
    # runs 1.. of a guided campaign replay the seed corpus (the catalogue's fragments) first
    corpus = campaign_corpus(state.request, load_catalogue())
    assert resumed.runs[2].spec == next_spec(state, 2, "partial-prefix", corpus) == replay(1, 2, corpus[1])
    assert state.runs[1].spec.seed_entry == corpus[0].seed_entry
    assert proc.returncode == (1 if resumed.new_findings else 0)
