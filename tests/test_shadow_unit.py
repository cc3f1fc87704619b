"""The shadow KV's bookkeeping, step by step (kvrepro/engine/shadow.py).

The inputs are stand-ins shaped like vLLM 0.26.0's: ``SchedulerOutput`` (new requests with their
block ids per group, cached requests with new block ids), ``GPULoadStoreSpec`` (block ids listed
group after group, ``group_sizes``, ``block_indices``) and a KV-cache config whose spec classes
carry vLLM's class names. Stand-ins, because these cases pin exact block layouts that a real
engine reaches only by chance; tests/test_shadow_kv.py runs the same code inside real engines.
"""

from __future__ import annotations

import os

import io
from types import SimpleNamespace as NS

from kvrepro.engine.shadow import ShadowKV


class FullAttentionSpec:
    block_size = 4


class MambaSpec:
    block_size = 4
    mamba_cache_mode = "align"


def shadow(*specs, blocks_per_chunk: int = 1) -> tuple[ShadowKV, io.StringIO]:
    out = io.StringIO()
    config = NS(kv_cache_groups=[NS(kv_cache_spec=spec()) for spec in specs])
    return ShadowKV(config, blocks_per_chunk=blocks_per_chunk, stream=out), out


def step(kv: ShadowKV, new=(), cached=(), finished=(), copies=(), resumed=()):
    """One scheduler output: new = [(req, prompt, block ids per group, computed)],
    cached = [(req, new block ids per group, computed)], copies = [(source, destination) block ids]."""
    so = NS(finished_req_ids=set(finished), preempted_req_ids=set(), kv_cache_block_copies=list(copies),
            scheduled_new_reqs=[NS(req_id=r, prompt_token_ids=p, block_ids=b, num_computed_tokens=c)
                                for r, p, b, c in new],
            scheduled_cached_reqs=NS(req_ids=[r for r, _, _ in cached], resumed_req_ids=set(resumed),
                                     new_block_ids=[b for _, b, _ in cached],
                                     num_computed_tokens=[c for _, _, c in cached]))
    kv.update_requests(so)


PROMPT = list(range(100, 110))  # 10 tokens: blocks of 4 -> 2 full blocks + 2 tokens


def prefill(kv, req, blocks, prompt=PROMPT, computed=0):
    step(kv, new=[(req, prompt, blocks, computed)])
    kv.forward(req, computed, len(prompt) - computed, [])
    kv.sampled(req, [7], len(prompt))


def test_a_prefix_hit_on_blocks_another_request_computed_checks_out():
    kv, out = shadow(FullAttentionSpec)
    prefill(kv, "r1", ([1, 2, 3],))
    prefill(kv, "r2", ([1, 2, 4],), prompt=PROMPT[:8] + [55, 56], computed=8)  # 8-token local hit
    assert (kv.checks, kv.violations) == (2, 0)


def test_a_hit_on_blocks_of_other_tokens_is_stale_kv():
    kv, out = shadow(FullAttentionSpec)
    prefill(kv, "r1", ([1, 2, 3],))
    prefill(kv, "r2", ([1, 2, 4],), prompt=[1] * 8 + [55, 56], computed=8)
    assert kv.violations == 1
    line = next(l for l in out.getvalue().splitlines() if " violation " in l)
    assert "request r2 group 0 (full_attention) block index 0 (GPU block 1): positions 0-3" in line
    assert "stale KV: it holds positions 0-3 of request r1, 4 of 4 positions computed from other tokens" in line
    assert "the request got this block with its prefix hit" in line


def test_a_partial_hit_reads_its_copy_on_write_block_and_without_the_copy_it_is_missing():
    """A 6-token hit ends inside block 2 (blocks of 4): vLLM hands the request a private block 9 and
    asks the runner to copy block 2 into it (kv_cache_block_copies). With the copy the hit checks out;
    a scheduler output without it leaves block 9 never written, which is what the shadow must say."""
    kv, out = shadow(FullAttentionSpec)
    prefill(kv, "r1", ([1, 2, 3],))
    step(kv, new=[("r2", PROMPT[:6] + [55, 56], ([1, 9],), 6)], copies=[(2, 9)])
    kv.forward("r2", 6, 2, [])
    assert (kv.checks, kv.violations) == (2, 0)
    kv, out = shadow(FullAttentionSpec)
    prefill(kv, "r1", ([1, 2, 3],))
    step(kv, new=[("r2", PROMPT[:6] + [55, 56], ([1, 9],), 6)])
    kv.forward("r2", 6, 2, [])
    assert kv.violations == 1 and "full_attention/missing/hit" in kv.by_kind, out.getvalue()


def test_store_and_load_move_contents_between_gpu_and_offloaded_chunks():
    """Two GPU blocks per offloaded chunk: a load that starts mid-chunk (block index 1) enters
    the chunk at its second sub-block, as vLLM's CPU offloading worker does."""
    kv, out = shadow(FullAttentionSpec, blocks_per_chunk=2)
    prefill(kv, "r1", ([1, 2, 3],))
    kv.store(0, NS(block_ids=[1, 2], group_sizes=[2], block_indices=[0]), NS(block_ids=[40]))
    # r2: a local hit on block 0 only (block 1 was evicted); block index 1 is loaded from chunk 40
    kv.load(1, NS(block_ids=[40]), NS(block_ids=[9], group_sizes=[1], block_indices=[1]))
    prefill(kv, "r2", ([1, 9, 5],), computed=8)
    assert kv.violations == 0, out.getvalue()
    # the same load one block early (chunk entered at sub-block 0): misplaced KV, named as a load
    kv.load(2, NS(block_ids=[40]), NS(block_ids=[11], group_sizes=[1], block_indices=[0]))
    prefill(kv, "r3", ([1, 11, 6],), computed=8)
    line = [l for l in out.getvalue().splitlines() if " violation " in l][-1]
    assert "request r3 group 0 (full_attention) block index 1 (GPU block 11): positions 4-7" in line
    assert "misplaced KV: it holds positions 0-3 of request r1" in line
    assert "its content: offload load (job 2, CPU block 40.0)" in line


def test_mamba_align_reads_the_state_at_exactly_the_computed_prefix():
    kv, out = shadow(FullAttentionSpec, MambaSpec)
    # r1 computes 8 tokens in a chunk: the state after 8 lands in Mamba block index 1 (id 21)
    step(kv, new=[("r1", PROMPT, ([1, 2, 3], [0, 21, 22]), 0)])
    kv.forward("r1", 0, 8, [])
    # a request hitting 8 tokens reads the state from block index (8 - 1) // 4 = 1
    step(kv, new=[("r2", PROMPT[:8] + [1, 2], ([1, 2, 4], [0, 21, 23]), 8)])
    kv.forward("r2", 8, 2, [])
    assert kv.violations == 0, out.getvalue()
    # ... and a request whose Mamba group has a null block there reads no state at all
    step(kv, new=[("r3", PROMPT[:8] + [3], ([1, 2, 5], [0, 0, 24]), 8)])
    kv.forward("r3", 8, 1, [])
    line = next(l for l in out.getvalue().splitlines() if " violation " in l)
    assert "request r3 group 1 (mamba) block index 1: the state after 8 tokens must be read from a block the " \
           "request does not have (null block)" in line
    assert "by=mamba/null-block/hit:1" in out.getvalue() and "class=mamba/null-block/hit " in line


def test_spec_decode_rollback_keeps_the_state_readable_at_the_accepted_length():
    kv, out = shadow(FullAttentionSpec, MambaSpec)
    step(kv, new=[("r", PROMPT[:6], ([1, 2], [0, 31, 32]), 0)])
    kv.forward("r", 0, 6, [])
    kv.sampled("r", [50], 6)  # 7 tokens known, 6 computed
    # decode with one draft (token 60); the draft is rejected, 51 comes instead
    step(kv, cached=[("r", ([], []), 6)])
    kv.forward("r", 6, 2, [60])
    kv.sampled("r", [51], 7)  # computed 7 now (the draft's position will be recomputed)
    step(kv, cached=[("r", ([3], [33]), 7)])
    kv.forward("r", 7, 2, [61])
    assert (kv.checks, kv.violations) == (3, 0), out.getvalue()
    # the draft 61 is rejected again (52 comes instead); a scheduler that counted it as computed
    # would attend to the draft's KV at position 8
    kv.sampled("r", [52], 8)
    step(kv, cached=[("r", ([], []), 9)])
    kv.forward("r", 9, 1, [])
    line = next(l for l in out.getvalue().splitlines() if " violation " in l)
    assert "request r group 0 (full_attention) block index 2 (GPU block 3): positions 8-8" in line
    assert "1 of 1 positions computed from other tokens" in line


def test_each_violation_is_classed_by_group_offload_read_and_region_and_a_served_hole_is_inherited():
    """The classes the corruption signatures read: r2 resumes at 8 tokens with an offload hit but
    block index 1 was neither loaded nor computed (a hole); r3 then hits the same block locally
    (no offload hit): the prefix cache served the hole again, class region "inherited"."""
    kv, out = shadow(FullAttentionSpec)
    prefill(kv, "r1", ([1, 2, 3],))
    kv.loaded_for.add("r2")  # as the worker reports a load job for r2
    prefill(kv, "r2", ([1, 9, 5],), computed=8)  # block 9 never written: the hole
    prefill(kv, "r3", ([1, 9, 6],), computed=8)
    # r3 had no offload hit itself; "+offload" on an inherited read says the hole's maker had one
    assert kv.by_kind == {"full_attention+offload/missing/hit": 1, "full_attention+offload/missing/inherited": 1}
    lines = [l for l in out.getvalue().splitlines() if " violation " in l]
    assert "class=full_attention+offload/missing/hit request r2" in lines[0]
    assert "class=full_attention+offload/missing/inherited request r3" in lines[1]
    assert "(request had no offload hit)" in lines[1]
    # a block written again is no hole any more: r4 computes block 9 itself, r5 hits it cleanly
    prefill(kv, "r4", ([1, 9, 7],), computed=4)
    prefill(kv, "r5", ([1, 9, 8],), computed=8)
    assert kv.violations == 2, out.getvalue()


def test_the_paths_that_ran_are_counted_whatever_was_found_there():
    """``hits``: each request resumed from a prefix hit counts once per group kind (and under
    "<kind>+offload" too when blocks were loaded for it), correct read or not; ``stored``: blocks stored per group kind, a
    Mamba block only when it held a state. A suite entry calls a build clean only when these ran."""
    from kvrepro.classify.exposure import read_exposure

    kv, out = shadow(FullAttentionSpec, MambaSpec)
    step(kv, new=[("r1", PROMPT, ([1, 2, 3], [0, 21, 22]), 0)])
    kv.forward("r1", 0, 8, [])
    assert kv.hit_reads == {}  # no hit: nothing resumed
    # r2 resumes from an 8-token local hit (checks out), in two forwards: counted once per kind
    step(kv, new=[("r2", PROMPT[:8] + [1, 2, 3, 4, 5], ([1, 2, 4, 5], [0, 21, 23, 24]), 8)])
    kv.forward("r2", 8, 2, [])
    kv.forward("r2", 10, 3, [])
    # r3 resumes too but finds a null Mamba block (a violation): its path ran all the same
    step(kv, new=[("r3", PROMPT[:8] + [3], ([1, 2, 5], [0, 0, 25]), 8)])
    kv.forward("r3", 8, 1, [])
    assert kv.hit_reads == {"full_attention": 2, "mamba": 2} and kv.violations == 1
    # a store of two attention blocks and two Mamba blocks, one of them holding no state
    kv.store(0, NS(block_ids=[1, 2, 21, 0], group_sizes=[2, 2], block_indices=[0, 0]), NS(block_ids=[40, 41, 42, 43]))
    assert kv.stored == {"full_attention": 2, "mamba": 1}
    # a request with blocks loaded for it counts as +offload
    kv.load_owner = lambda job: "r4"
    kv.load(1, NS(block_ids=[42]), NS(block_ids=[26], group_sizes=[0, 1], block_indices=[0, 1]))
    step(kv, new=[("r4", PROMPT[:8] + [9], ([1, 2, 6], [0, 26, 27]), 8)])
    kv.forward("r4", 8, 1, [])
    assert kv.hit_reads == {"full_attention": 3, "mamba": 3, "full_attention+offload": 1, "mamba+offload": 1}
    kv.report(force=True)
    last = [line for line in out.getvalue().splitlines() if " counts " in line][-1]
    assert last.endswith("hits=full_attention:3,full_attention+offload:1,mamba:3,mamba+offload:1 "
                         f"stored=full_attention:2,mamba:1 pid={os.getpid()}")
    exposure = read_exposure(last + "\n")
    assert exposure.kv_hit_reads == {"full_attention": 3, "mamba": 3, "full_attention+offload": 1, "mamba+offload": 1}
    assert exposure.kv_stored == {"full_attention": 2, "mamba": 1}
    assert read_exposure("kvrepro-shadow: counts checks=1 violations=0 by=-\n").kv_hit_reads == {}  # older engines


def test_a_resumed_requests_new_prefix_hit_is_its_hit_region():
    """A request preempted and resumed by vLLM (``resumed_req_ids``) comes back with a new block
    table and ``num_computed_tokens`` from its new prefix hit. A wrong block in that hit is a
    ``.../hit`` read, not one of its own computed positions (the 0.26.0 explore lead of 2026-12-02:
    one preemption, one ``full_attention/foreign/computed``)."""
    kv, out = shadow(FullAttentionSpec, FullAttentionSpec)
    step(kv, new=[("r1", PROMPT, ([1, 2, 3], [11, 12, 13]), 0)])  # a first hit of 0
    kv.forward("r1", 0, 10, [])
    kv.sampled("r1", [7], 10)
    # r2 writes group 0's KV into block 5, which r1 then gets back as a group-1 hit block
    step(kv, new=[("r2", [1, 2, 3, 4, 5, 6], ([5, 6], [15, 16]), 0)])
    kv.forward("r2", 0, 6, [])
    step(kv, cached=[("r1", ([1, 2, 4], [5, 12, 14]), 8)], resumed=["r1"])
    kv.forward("r1", 8, 3, [])
    assert kv.by_kind == {"full_attention/foreign/hit": 1}, out.getvalue()
