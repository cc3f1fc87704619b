"""The engine's invariants at quiescent points (issue 48; kvrepro/probe/kvrepro_probe.py's
``INVARIANT_CHECKS``, kvrepro/classify/invariants.py): each check reads vLLM's own structures and
names what is not at rest.

The block pool is vLLM's real ``BlockPool`` (build A's tree), taken and freed through its own
methods in a python process of its own (the probe installs an import hook for the life of a
process); the scheduler, KV-cache manager and connector around it are stand-ins holding only the
attributes the checks read (a real scheduler needs a full engine config: the planted-bug benchmark
runs the real engine, docs/explore.md). The log lines the probe writes are read back by the
classifier's reader, and the explore judge turns them into failures named by the invariant."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from conftest import run_beside_the_probe
from kvrepro.classify.exposure import read_exposure
from kvrepro.classify.invariants import INVARIANTS

pytestmark = [pytest.mark.vllm, pytest.mark.shares_zygotes]

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "kvrepro" / "probe" / "kvrepro_probe.py"

CHECKS = """
import json, types
from collections import defaultdict
import kvrepro_probe as p
from vllm.v1.core.block_pool import BlockPool

NS = types.SimpleNamespace


class Request:  # hashable, as vLLM's Request is (the scheduler keeps them in sets)
    def __init__(self, request_id):
        self.request_id = request_id

pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
manager = NS(block_pool=pool, req_to_blocks=defaultdict(list), num_cached_block={}, kv_cache_group_id=0)
cs = NS(_req_status={}, _jobs={}, manager=NS(_policy=NS(chunks={})))
sched = NS(kv_cache_manager=NS(block_pool=pool, coordinator=NS(single_type_managers=(manager,))),
           connector=NS(connector_scheduler=cs), requests={}, running=[], _inflight_prefills=set())
p._seen_requests.update({"r1", "r2"})  # what the wrapped Scheduler.add_request records
p._invariants["installed"] = True  # as wrapping Scheduler does: the invariants' counts line is written
steps = {}

def check(name):
    steps[name] = sorted({n for n, _ in p.check_invariants(sched)})

check("at rest")
blocks = pool.get_new_blocks(2)
manager.req_to_blocks["r1"] = blocks
check("held by a live request's table")   # the request left, its table did not: stranded and leaked
del manager.req_to_blocks["r1"]
manager.req_to_blocks["r2"]               # a defaultdict read leaves an empty entry: not a reference
check("leaked")
pool.free_blocks(blocks)
check("freed")
pool.free_blocks(blocks[:1])
check("freed twice")
blocks[0].ref_cnt = 0
sched._inflight_prefills.add(Request("r1"))
check("reservation left")
sched._inflight_prefills.clear()
cs._jobs[7] = NS(req_id="r2", is_store=True)
cs.manager._policy.chunks["k"] = NS(ref_cnt=1, is_ready=True)
check("offload left")
cs._jobs.clear()
cs.manager._policy.chunks.clear()
# after each step: busy since the last check and at rest -> checked once; stepping with nothing to run
# (a finished request vLLM never lets go of) -> never-at-rest after NEVER_AT_REST_STEPS steps, once
sched.has_requests = lambda: False
sched.has_unfinished_requests = lambda: False
p._invariants["busy"] = True
before = p._invariants["checks"]
p.after_step(sched)
p.after_step(sched)
steps["after a step at rest"] = p._invariants["checks"] - before
sched.has_requests = lambda: True
sched.requests = {"r2": NS(status=NS(name="FINISHED_STOPPED"))}
for _ in range(p.NEVER_AT_REST_STEPS + 5):
    p.after_step(sched)
steps["stepping with nothing to run"] = p._broken.get("never-at-rest", 0)
p.report_invariants(force=True)
print("RESULTS " + json.dumps(steps))
"""


@pytest.fixture(scope="module")
def tree(overlays, runtime_python, runtime_scripts):
    return (str(runtime_python), runtime_scripts), overlays["A"]


def test_each_check_names_what_is_not_at_rest_on_vllms_block_pool(tree, tmp_path):
    proc = run_beside_the_probe(tree, tmp_path, CHECKS)
    steps = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))[8:])
    assert steps == {
        "at rest": [],
        "held by a live request's table": ["block-leak", "request-stranded"],
        "leaked": ["block-leak"],
        "freed": [],
        "freed twice": ["block-double-free"],
        "reservation left": ["request-stranded"],
        "offload left": ["offload-pinned", "offload-stranded"],
        "after a step at rest": 1,
        "stepping with nothing to run": 1,
    }
    assert "never-at-rest check=9 vLLM's has_requests() stayed true for 1000 steps" in proc.stderr
    assert "1 request(s) still in Scheduler.requests r2 (FINISHED_STOPPED)" in proc.stderr
    # what the probe logged reads back as the run's record, and as explore's failures
    exposure = read_exposure(proc.stderr)
    assert exposure.invariant_checks == 9
    assert exposure.invariants_broken == {"block-leak": 2, "request-stranded": 2, "block-double-free": 1,
                                          "offload-pinned": 1, "offload-stranded": 1, "never-at-rest": 1}
    assert exposure.first_broken.startswith("block-leak: 2 of 7 blocks still referenced")


def test_the_probes_checks_and_the_classifiers_table_name_the_same_invariants():
    """A new invariant is a check in the probe and a row in classify/invariants.py: the names agree."""
    tree = ast.parse(PROBE.read_text())
    named = {node.elts[0].value for node in ast.walk(tree)
             if isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[0], ast.Constant)
             and isinstance(node.elts[0].value, str) and node.elts[0].value in INVARIANTS}
    assert named == set(INVARIANTS), set(INVARIANTS) - named


def test_explore_judges_each_broken_invariant_by_its_name():
    from kvrepro.explore.judge import INVARIANT, engine_invariant_failures
    from kvrepro.records import Outcome, RunResult, Verdict

    run = RunResult(build="b", rep=0, verdict=Verdict.STALL, outcome=Outcome.NONE, title="", trigger_count=0,
                    external_hit_calls=0, requests=8, seconds=1.0, invariant_checks=5,
                    invariants_broken={"block-leak": 1, "request-stranded": 1},
                    first_broken="block-leak: 54 of 95 blocks still referenced with no request in the engine")
    failures = engine_invariant_failures(run)
    assert [(f.kind, f.key, f.signature) for f in failures] == [
        (INVARIANT, "invariant:block-leak", "block-leak"), (INVARIANT, "invariant:request-stranded", "request-stranded")]
    assert failures[0].title.startswith("INVARIANT block-leak at 1 of 5 quiescent point(s): 54 of 95 blocks")


def test_a_wrong_cached_block_the_shadow_kv_caught_being_read_is_that_corruption_not_a_second_failure():
    from kvrepro.explore.judge import engine_invariant_failures
    from kvrepro.records import Outcome, RunResult, Verdict

    fields = dict(build="b", rep=0, outcome=Outcome.NONE, title="", trigger_count=0, external_hit_calls=0,
                  requests=8, seconds=1.0, invariant_checks=8, invariants_broken={"prefix-cache-content": 3})
    read = RunResult(verdict=Verdict.CORRUPT, kv_violations=2, **fields)
    unread = RunResult(verdict=Verdict.UNREACHED, **fields)
    assert engine_invariant_failures(read) == []
    assert [f.key for f in engine_invariant_failures(unread)] == ["invariant:prefix-cache-content"]


def test_the_prefix_cache_is_read_in_each_releases_layout():
    """vLLM's prefix-cache map, as each release lays it out: up to 0.33.0 ``_cache`` maps a key to its
    block (or a dict of blocks a key several carry); 0.34.0 maps a key to one block id and keeps a
    key's other ids in ``_dup_ids`` (block_pool.py 0.34.0:56-64). The check reads every cached block
    in both (on 0.34.0 it raised AttributeError on the ids: each rest point was a probe error). The
    map and blocks are stand-ins with vLLM's attribute names: a real BlockPool per release needs that
    release's environment (the test above runs 0.26.0's)."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("kvrepro_probe_layout", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    blocks = [types.SimpleNamespace(block_id=i, block_hash=f"h{i}") for i in range(4)]
    pool = types.SimpleNamespace(blocks=blocks)
    old = types.SimpleNamespace(_cache={"h1": blocks[1], "h2": {2: blocks[2], 3: blocks[3]}})
    new = types.SimpleNamespace(_cache={"h1": 1, "h2": 2}, _dup_ids={"h2": {2: None, 3: None}})
    for layout in (old, new):
        got = sorted((key, block.block_id) for key, block in probe._cached_entries(pool, layout, layout._cache))
        assert got == [("h1", 1), ("h2", 2), ("h2", 3)], got
