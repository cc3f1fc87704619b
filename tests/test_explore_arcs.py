"""Explore's feedback from the code under test: the engine's arc recorder (kvrepro/engine/arcs.py), the
campaign's target lines from its patches, what new arcs are worth, and the guided generator's
mutation of the run that came closest. No engine here: the recorder traces real code compiled under a
vLLM path (test_explore.py's campaign checks that a real engine run reports arcs)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from conftest import ROOT
from kvrepro.engine.arcs import ArcRecorder, parse_line, traced_name
from kvrepro.explore.campaign import base_data, parent_for, run_matrix_for
from kvrepro.explore.coverage import TARGET_POINTS, in_target, patch_targets, points, run_arcs
from kvrepro.explore.generator import RunSpec, apply, generate
from kvrepro.explore.state import CampaignRequest, CampaignState, JudgedRecord, RunRecord
from kvrepro.spec.matrix import DEFAULT_MATRIX

PLANTED = ROOT / "benchmarks" / "planted"

SOURCE = """\
def decide(x):
    if x > 0:
        y = 1
    else:
        y = 2
    return y
"""


def _traced(fake_path: str, calls) -> tuple[ArcRecorder, io.StringIO]:
    out = io.StringIO()
    recorder = ArcRecorder(stream=out)
    namespace: dict = {}
    exec(compile(SOURCE, fake_path, "exec"), namespace)
    previous = sys.gettrace()
    sys.settrace(recorder._global)  # what install() does, without the reporter thread and atexit
    try:
        for x in calls:
            namespace["decide"](x)
    finally:
        sys.settrace(previous)
    return recorder, out


def test_the_recorder_sees_each_way_a_branch_went_in_the_code_under_test_only():
    path = "/overlay/abc/vllm/v1/core/kv_cache_manager.py"
    recorder, out = _traced(path, [1])
    name = "v1/core/kv_cache_manager.py"
    assert (name, 2, 3) in recorder.arcs() and (name, 2, 5) not in recorder.arcs()
    assert (name, -1, 2) in recorder.arcs() and (name, 6, -1) in recorder.arcs()  # entry and exit
    recorder2, _ = _traced(path, [1, -1])
    assert {(name, 2, 3), (name, 2, 5)} <= recorder2.arcs()
    recorder.flush()
    line = "(EngineCore pid=7) " + out.getvalue().strip()
    assert set(parse_line(line)) == recorder.arcs()
    recorder.flush()  # nothing new: nothing written
    assert out.getvalue().count("kvrepro-arcs:") == 1
    # the same code under another file name is not code under test
    other, _ = _traced("/overlay/abc/vllm/entrypoints/openai/api_server.py", [1, -1])
    assert other.arcs() == set()


def test_the_traced_files_are_the_scheduler_kv_manager_and_connector():
    assert traced_name("/x/vllm/v1/core/sched/scheduler.py") == "v1/core/sched/scheduler.py"
    assert traced_name("/x/vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py") == \
        "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
    assert traced_name("/x/vllm/v1/core/sched/output.py") is None
    assert traced_name("/x/kvrepro/engine/shadow.py") is None
    assert parse_line("kvrepro-arcs: v1/core/sched/scheduler.py 1>2 3>x") == [("v1/core/sched/scheduler.py", 1, 2)]
    assert parse_line("unrelated 1>2") == []


def test_run_arcs_reads_every_engine_log_of_the_run(tmp_path):
    (tmp_path / "X" / "0").mkdir(parents=True)
    (tmp_path / "X" / "0" / "engine.log").write_text(
        "INFO start\n(EngineCore pid=1) kvrepro-arcs: v1/core/kv_cache_manager.py -10>11 11>12\n"
        "(EngineCore pid=1) kvrepro-arcs: v1/core/sched/scheduler.py 5>6\n")
    assert run_arcs(tmp_path) == {"arc:v1/core/kv_cache_manager.py:-10>11", "arc:v1/core/kv_cache_manager.py:11>12",
                                  "arc:v1/core/sched/scheduler.py:5>6"}
    assert run_arcs(None) == set() and run_arcs(tmp_path / "missing") == set()


def test_the_target_is_the_lines_a_planted_patch_changes():
    targets = patch_targets([(PLANTED / "mutate-scheduler-reconcile-on-0.30.0.patch").read_text()])
    assert list(targets) == ["v1/core/sched/scheduler.py"]
    # the changed line is 972 in both numberings (hunk @@ -969,7 +969,7 @@, three lines of context)
    assert in_target(targets, "arc:v1/core/sched/scheduler.py:972>975")
    assert in_target(targets, "arc:v1/core/sched/scheduler.py:-900>970")
    assert not in_target(targets, "arc:v1/core/sched/scheduler.py:100>101")
    assert not in_target(targets, "arc:v1/core/kv_cache_manager.py:972>975")
    assert not in_target(targets, "kv_stored.mamba")
    revert = patch_targets([(PLANTED / "revert-48425-on-0.27.0.patch").read_text()])
    assert in_target(revert, "arc:v1/core/kv_cache_manager.py:333>335")  # removed lines 333-342 by old numbers
    assert patch_targets([]) == {}


def test_new_arcs_are_worth_little_unless_they_are_in_the_target():
    targets = {"v1/core/sched/scheduler.py": [(969, 975)]}
    arcs = [f"arc:v1/core/kv_cache_manager.py:{i}>{i + 1}" for i in range(300)]
    assert points(arcs, targets) < points([f"counter{i}" for i in range(10)], targets)
    aimed = points(arcs + ["arc:v1/core/sched/scheduler.py:972>973"], targets)
    assert aimed - points(arcs, {}) > TARGET_POINTS - 1
    assert points([], targets) == 0


def test_a_guided_campaign_mutates_the_run_that_came_closest():
    spec = RunSpec(index=1, changes=(("engine.sim.num_gpu_blocks", 64), ("load.concurrency", 2)), load_seed=1,
                   sim_seed=2)
    child = generate(3, 5, "partial-prefix", None, parent=spec)
    assert child == generate(3, 5, "partial-prefix", None, parent=spec)  # a pure function
    assert child.load_seed != spec.load_seed
    kept = set(spec.changes) & set(child.changes)
    assert kept != set(child.changes) or len(child.changes) > len(spec.changes)  # something changed
    for i in range(5, 60):  # never the parent again with other seeds
        assert generate(3, i, "partial-prefix", {"load.concurrency=2": 99.0}, parent=spec).changes != spec.changes
    assert len(kept) >= len(spec.changes) - 2 and len(child.changes) <= len(spec.changes) + 2
    # which parent: none before a run with changes came back, none unguided; the most target arcs
    request = CampaignRequest(base="0.30.0", seed=1)
    state = CampaignState(campaign_id="explore-x", request=request,
                          runs=[RunRecord(spec=RunSpec(index=0), run_id="r0", verdict="SURVIVED", seconds=1.0)])
    assert all(parent_for(state, i) is None for i in range(1, 20))
    near = RunRecord(spec=spec, run_id="r1", verdict="SURVIVED", seconds=1.0, target_arcs=7, points=1.0)
    far = RunRecord(spec=RunSpec(index=2, changes=(("load.max_tokens", 4),)), run_id="r2", verdict="SURVIVED",
                    seconds=1.0, target_arcs=0, points=50.0)
    state.runs += [near, far]
    parents = [parent_for(state, i) for i in range(3, 23)]
    assert set(parents) == {None, spec}  # every other run, seeded
    # a run that failed is no parent, however close it came: its children fail the same way
    stalled = RunRecord(spec=RunSpec(index=3, changes=(("load.concurrency", 4),)), run_id="r3", verdict="STALL",
                        seconds=30.0, target_arcs=50, points=9.0,
                        failures=(JudgedRecord(key="stall", kind="stall", title="STALL", status="known",
                                               entry="recompute-failed-load-stall"),))
    state.runs.append(stalled)
    assert {parent_for(state, i) for i in range(4, 24)} == {None, spec}
    assert 4 <= parents.count(spec) <= 16
    unguided = CampaignState(campaign_id="explore-y", request=CampaignRequest(base="0.30.0", guided=False),
                             runs=state.runs)
    assert all(parent_for(unguided, i) is None for i in range(3, 23))
    back = RunRecord.from_json(json.loads(json.dumps(near.to_json())))
    assert back == near


def test_the_prefix_match_unit_knob_makes_a_serve_flag_and_leaves_no_empty_geometry():
    data = base_data(DEFAULT_MATRIX)
    request = CampaignRequest(base="0.28.0", budget_runs=1)
    spec = RunSpec(index=1, changes=(("engine.geometry.hash_block_size", 8),))
    loaded = run_matrix_for(spec, data, request, DEFAULT_MATRIX)
    args = loaded.matrix.engine.serve_args("/m", include_sim=False)
    assert args[args.index("--prefix-match-unit") + 1] == "8"
    both = RunSpec(index=1, changes=(("engine.geometry", {"offload_chunk_tokens": 64}),
                                     ("engine.geometry.hash_block_size", 8)))
    assert apply(both, data)["engine"]["geometry"] == {"offload_chunk_tokens": 64, "hash_block_size": 8}
    none = apply(RunSpec(index=1, changes=(("engine.geometry.hash_block_size", None),)), data)
    assert "geometry" not in none["engine"]


def test_a_quiet_hot_function_is_sampled_unless_it_holds_a_patched_line():
    """The cost control: after QUIET_CALLS calls that add no arc a function is traced every
    SAMPLE_EVERY-th call, so a branch taken once in between is missed; the patched lines' function
    (``always``) is traced on every call, and the branch is seen."""
    from kvrepro.engine.arcs import QUIET_CALLS, SAMPLE_EVERY

    path = "/overlay/abc/vllm/v1/core/sched/scheduler.py"
    name = "v1/core/sched/scheduler.py"
    calls = [1] * (QUIET_CALLS + 3) + [-1]  # the -1 call is the 3rd after going quiet: not sampled
    assert 3 % SAMPLE_EVERY
    sampled, _ = _traced(path, calls)
    assert (name, 2, 3) in sampled.arcs() and (name, 2, 5) not in sampled.arcs()
    always = ArcRecorder(stream=io.StringIO(), always={name: [(4, 5)]})
    namespace: dict = {}
    exec(compile(SOURCE, path, "exec"), namespace)
    previous = sys.gettrace()
    sys.settrace(always._global)
    try:
        for x in calls:
            namespace["decide"](x)
    finally:
        sys.settrace(previous)
    assert (name, 2, 5) in always.arcs()


def test_instrumented_branches_report_both_ways_of_an_if_and_change_nothing_else(tmp_path):
    """kvrepro/engine/branches.py on a real module file under a vllm/ path: the functions already
    referenced run the instrumented code, give the same answers, and the probes name each branch."""
    import importlib.util

    from kvrepro.engine.branches import BranchRecorder

    folder = tmp_path / "vllm" / "v1" / "core"
    folder.mkdir(parents=True)
    (folder / "kv_cache_manager.py").write_text(SOURCE + """

class Manager:
    def loop(self, items):
        total = 0
        for item in items:
            if item < 0:
                break
            total += item
        return total
""")
    spec = importlib.util.spec_from_file_location("fake_kv_cache_manager", folder / "kv_cache_manager.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    decide, manager = module.decide, module.Manager()  # held before instrumenting, as the engine holds them
    out = io.StringIO()
    recorder = BranchRecorder(stream=out)
    recorder.install(modules={"fake": module})
    assert "instrumented modules=1 functions=2 kept=0" in out.getvalue()
    assert decide(1) == 1 and manager.loop([1, 2]) == 3
    recorder.flush()
    name = "v1/core/kv_cache_manager.py"
    got = {arc for line in out.getvalue().splitlines() for arc in parse_line(line)}
    # decide: entry, the if taken; loop (def at line 10): entry, the for's body, its end without a
    # break, the if at 13 not taken
    assert {(name, -1, 2), (name, 2, 3), (name, -10, 11), (name, 12, 13), (name, 12, -12), (name, 13, -13)} <= got
    assert (name, 2, 5) not in got  # the else of decide: not taken yet
    assert decide(-1) == 2 and manager.loop([1, -1, 5]) == 1
    recorder.flush()
    got = {arc for line in out.getvalue().splitlines() for arc in parse_line(line)}
    assert {(name, 2, 5), (name, 13, 14)} <= got


def test_guided_weights_favour_what_no_run_has_tried():
    from kvrepro.explore.campaign import guided_weights
    from kvrepro.explore.coverage import steering

    weights = {"engine.sim.load_steps=4": 9.0, "engine.connector=\"offloading\"": 3.0}
    out = steering(weights, ["engine.sim.load_steps=4", "engine.connector=\"offloading\""])
    assert out["engine.connector=\"capable\""] == 9.0 and out["engine.sim.load_steps=1"] == 9.0
    assert out["engine.connector=\"offloading\""] == 3.0  # tried: what it earned
    assert steering({}, []) ["load.concurrency=2"] == 1.0  # nothing earned yet: all alike
    tried = RunRecord(spec=RunSpec(index=1, changes=(("engine.connector", "capable"),)), run_id="r1",
                      verdict="SURVIVED", seconds=1.0)
    state = CampaignState(campaign_id="explore-x", request=CampaignRequest(base="0.30.0"), runs=[tried],
                          weights={"load.concurrency=2": 5.0})
    got = guided_weights(state)
    assert got.get("engine.connector=\"capable\"", 1.0) == 1.0 and got["engine.connector=\"offloading\""] == 5.0
    state.request = CampaignRequest(base="0.30.0", guided=False)
    assert guided_weights(state) is None
