"""Where a stall waits (issue 51): the probe reads vLLM's scheduler when nothing has been scheduled
for a while and keys the stall by it, so two different stalls of one release are two failures.

The block pool is vLLM's real ``BlockPool`` (build A's tree) and the refused allocation goes through
the probe's wrapper of the real ``KVCacheManager.allocate_slots`` signature; the scheduler around them
is a stand-in holding only the attributes the probe reads (a real scheduler needs a full engine
config: the campaigns in docs/explore.md run the real engine). The lines the probe writes are read
back by the classifier and keyed by explore's judge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_beside_the_probe
from kvrepro.classify.exposure import read_exposure

ROOT = Path(__file__).resolve().parents[1]

STALLS = """
import json, types
from collections import defaultdict, deque
import kvrepro_probe as p
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import RequestStatus

NS = types.SimpleNamespace


class Request:  # hashable, as vLLM's Request is (the scheduler keeps them in sets)
    def __init__(self, request_id, status):
        self.request_id, self.status = request_id, status
        self.num_computed_tokens, self.num_tokens = 0, 881


class FCFSRequestQueue(deque):  # the name is what the probe goes by (vLLM's is a deque too)
    pass


def scheduler():
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    manager = NS(block_pool=pool, req_to_blocks=defaultdict(list), kv_cache_group_id=0)
    return NS(kv_cache_manager=NS(block_pool=pool, coordinator=NS(single_type_managers=(manager,))),
              requests={}, running=[], waiting=FCFSRequestQueue(), skipped_waiting=FCFSRequestQueue(),
              _inflight_prefills=set(), finished_recving_kv_req_ids=set(),
              has_unfinished_requests=lambda: True), pool, manager

out = {}
# recompute-failed-load-stall's shape: the failed request reserves for itself, block-less, and is refused
s, pool, manager = scheduler()
failed = Request("r1", RequestStatus.WAITING)
s.requests["r1"] = failed
s.skipped_waiting.append(failed)
s._inflight_prefills.add(failed)
s.requests["r2"] = Request("r2", RequestStatus.WAITING)
s.waiting.append(s.requests["r2"])
out["self-reserved"] = p.stall_state(s, [(failed, 881, 700, 60, 7)])

# a leak's shape: blocks referenced by no live request, a plain waiting request refused
s, pool, manager = scheduler()
pool.get_new_blocks(5)  # referenced, in nobody's table
r = Request("r3", RequestStatus.WAITING)
s.requests["r3"] = r
s.waiting.append(r)
out["leak"] = p.stall_state(s, [(r, 64, 0, 0, 2)])

# parked loads, done and never promoted, behind a refused fresh request
s, pool, manager = scheduler()
fresh = Request("r4", RequestStatus.WAITING)
parked = Request("r5", RequestStatus.WAITING_FOR_REMOTE_KVS)
s.requests.update(r4=fresh, r5=parked)
s.waiting.append(fresh)
s.skipped_waiting.append(parked)
manager.req_to_blocks["r5"] = pool.get_new_blocks(3)
s.finished_recving_kv_req_ids.add("r5")
out["parked"] = p.stall_state(s, [(fresh, 64, 0, 0, 4)])

# nothing tried at all: a load never completes
s, pool, manager = scheduler()
loading = Request("r6", RequestStatus.WAITING_FOR_REMOTE_KVS)
s.requests["r6"] = loading
s.skipped_waiting.append(loading)
manager.req_to_blocks["r6"] = pool.get_new_blocks(2)
out["in flight"] = p.stall_state(s, [])

# the watcher: STALL_FIRST_STEPS idle steps write one line; progress resets it
s, pool, manager = scheduler()
s.requests["r7"] = Request("r7", RequestStatus.WAITING)
s.waiting.append(s.requests["r7"])
idle = NS(total_num_scheduled_tokens=0)
for _ in range(p.STALL_FIRST_STEPS - 1):
    p._watch_stall(s, idle)
out["before"] = p._stall["last"]
p._refused.append((s.requests["r7"], 16, 0, 0, 0))
p._watch_stall(s, idle)
out["after"] = p._stall["last"]
p._watch_stall(s, NS(total_num_scheduled_tokens=5))
out["reset"] = p._stall["idle"]
print("RESULTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def tree(overlays, runtime_python, runtime_scripts):
    return (str(runtime_python), runtime_scripts), overlays["A"]


pytestmark = [pytest.mark.vllm, pytest.mark.shares_zygotes]


def test_each_stall_is_keyed_by_where_vllms_scheduler_waits(tree, tmp_path):
    proc = run_beside_the_probe(tree, tmp_path, STALLS)
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))[8:])
    assert got["self-reserved"][0] == "refused:WAITING+self-reserved+async-load/reserved-by-self"
    assert "60 blocks reserved by in-flight prefills (r1), 7 free" in got["self-reserved"][1]
    # the queue is in the words, not the key (which queue holds a request is the release's bookkeeping)
    assert "(WAITING+self-reserved in skipped_waiting, 0 of 881 tokens computed)" in got["self-reserved"][1]
    assert got["leak"][0] == "refused:WAITING|blocks-held-by-no-request"
    assert "5 block(s) referenced with no live request" in got["leak"][1]
    assert got["parked"][0] == ("refused:WAITING|waiting:WAITING_FOR_REMOTE_KVS"
                                "/load-done+holds-blocks")
    assert got["in flight"][0] == ("nothing-allocated|waiting:WAITING_FOR_REMOTE_KVS"
                                   "/load-in-flight+holds-blocks")
    # four different stalls, four keys; the watcher writes its line at the threshold, not before
    assert len({got[k][0] for k in ("self-reserved", "leak", "parked", "in flight")}) == 4
    assert got["before"] is None and got["after"] == "refused:WAITING"
    assert got["reset"] == 0
    exposure = read_exposure(proc.stderr)
    assert exposure.stall_where == "refused:WAITING"
    assert exposure.stall_state.startswith("allocation refused for request r7")


def test_explore_keys_a_stall_by_where_it_waits():
    from kvrepro.explore.judge import STALL, run_failures
    from kvrepro.records import Outcome, RunResult, Verdict

    fields = dict(build="b", rep=0, verdict=Verdict.STALL, outcome=Outcome.NONE, title="", trigger_count=0,
                  external_hit_calls=0, requests=8, seconds=1.0)
    one = RunResult(stall_where="refused:WAITING|blocks-held-by-no-request", **fields)
    two = RunResult(stall_where="refused:WAITING+self-reserved/reserved-by-self", **fields)
    unknown = RunResult(**fields)
    keys = [[(f.kind, f.key, f.signature) for f in run_failures(r)] for r in (one, two, unknown)]
    assert keys == [[(STALL, "stall:refused:WAITING|blocks-held-by-no-request", "stall")],
                    [(STALL, "stall:refused:WAITING+self-reserved/reserved-by-self", "stall")],
                    [(STALL, "stall", "stall")]]
