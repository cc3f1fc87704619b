"""The shadow KV applies vLLM's copy-on-write block copies (``SchedulerOutput.kv_cache_block_copies``).

With a prefix-match unit below the KV block (``--prefix-match-unit 16`` on 32-token blocks) a
prefix hit can end inside a block. vLLM then copies whole GPU blocks before the forward: the
runner's ``copy_kv_cache_blocks_inplace`` (0.30.0 gpu_model_runner.py:1247). Until 2026-12-02 the
shadow KV ignored those copies, so every such hit read as another group's data or another prefix's
state: ``truncate-lagging-mamba`` was CORRUPT on 0.30.0-0.33.0 (73 false violations on 0.33.0,
issue 25) while vLLM itself was right.

The first tests drive the shadow KV with stand-ins shaped like vLLM's ``SchedulerOutput`` (the
layouts are pinned). The last runs two recorded requests through vLLM 0.30.0's real EngineCore on
the offline engine (kvrepro/engine/offline.py); faked there, because no GPU is here: the model and
the offload data movement (kvrepro/engine/executor.py). It needs the runtime env; 0.30.0's wheel is
downloaded from PyPI on first use, as any build's is.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from kvrepro.engine.shadow import ShadowKV


ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "data" / "traces" / "partial-tail-cow.trace.jsonl"


class FullAttentionSpec:
    block_size = 4


class MambaSpec:
    block_size = 4
    mamba_cache_mode = "align"


def _shadow(*specs) -> tuple[ShadowKV, io.StringIO]:
    out = io.StringIO()
    return ShadowKV(NS(kv_cache_groups=[NS(kv_cache_spec=s()) for s in specs]), stream=out), out


def _step(kv: ShadowKV, new=(), copies=None) -> None:
    """One scheduler output: new = [(req, prompt, block ids per group, computed)]; copies as
    vLLM's ``KVCacheBlockCopy`` (src_block_id, dst_block_id) tuples."""
    so = NS(finished_req_ids=set(), preempted_req_ids=set(), kv_cache_block_copies=copies,
            scheduled_new_reqs=[NS(req_id=r, prompt_token_ids=p, block_ids=b, num_computed_tokens=c) for r, p, b, c in new],
            scheduled_cached_reqs=NS(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]))
    kv.update_requests(so)


PROMPT = list(range(100, 110))  # 10 tokens on 4-token blocks


def test_a_hit_ending_inside_a_block_reads_its_copy_on_write_block():
    """r2 hits 6 tokens of r1 (block 1 half full): vLLM gives it a private block 7 and copies 2 -> 7."""
    kv, out = _shadow(FullAttentionSpec)
    _step(kv, new=[("r1", PROMPT, ([1, 2, 3],), 0)])
    kv.forward("r1", 0, 10, [])
    _step(kv, new=[("r2", PROMPT[:6] + [55, 56], ([1, 7],), 6)], copies=[(2, 7)])
    kv.forward("r2", 6, 2, [])
    assert (kv.copied, kv.violations) == (1, 0), out.getvalue()
    # the same hit without the copy is what the old model saw: block 7 never written
    kv2, _ = _shadow(FullAttentionSpec)
    _step(kv2, new=[("r1", PROMPT, ([1, 2, 3],), 0)])
    kv2.forward("r1", 0, 10, [])
    _step(kv2, new=[("r2", PROMPT[:6] + [55, 56], ([1, 7],), 6)])
    kv2.forward("r2", 6, 2, [])
    assert kv2.violations == 1 and kv2.by_kind == {"full_attention/missing/hit": 1}


def test_a_mamba_state_moved_to_a_fresh_block_is_read_there_after_the_copy():
    """The producer's state after 6 tokens sits in block 2; vLLM moves the cache entry to block 9
    (which held full attention's data) and copies 2 -> 9; a later hit at 6 tokens reads block 9."""
    kv, out = _shadow(MambaSpec, FullAttentionSpec)
    _step(kv, new=[("r0", [5] * 8, ([], [9, 8]), 0)])
    kv.forward("r0", 0, 8, [])  # block 9 now holds group 1's (full attention) data
    _step(kv, new=[("r1", PROMPT[:6], ([1, 2], [3, 4]), 0)])
    kv.forward("r1", 0, 6, [])  # its running state after 6 tokens is in block 2
    _step(kv, copies=[(2, 9)])
    _step(kv, new=[("r2", PROMPT[:6] + [55, 56], ([0, 9], [3, 6]), 6)], copies=[(4, 6)])
    kv.forward("r2", 6, 2, [])
    assert (kv.copied, kv.violations) == (2, 0), out.getvalue()


def test_the_copies_of_a_step_read_every_source_before_writing():
    """A batched index copy: 1 -> 2 and 2 -> 1 in one step swap the blocks."""
    kv, _ = _shadow(FullAttentionSpec)
    _step(kv, new=[("a", [1, 2, 3, 4], ([1],), 0), ("b", [5, 6, 7, 8], ([2],), 0)])
    kv.forward("a", 0, 4, [])
    kv.forward("b", 0, 4, [])
    before = {b: kv.gpu[b].slots for b in (1, 2)}
    _step(kv, copies=[(1, 2), (2, 1)])
    assert kv.gpu[1].slots == before[2] and kv.gpu[2].slots == before[1]
    assert "copied from GPU block 2" in kv.gpu[1].source


@pytest.mark.parametrize("order", ["filling copy first", "filling copy last"])
def test_a_copy_whose_source_another_copy_of_the_step_fills_copies_the_old_block(order):
    """vLLM 0.34.0 explore finding (2026-12-04, step 112 of its run): two requests of one step hit the
    same 6-token prefix (a partial hit in block index 1). r1 gets its private block 5 (copy 2 -> 5) and
    caches it as a full block at once; r2's lookup finds block 5 and gets a private block 6 of it
    (copy 5 -> 6). One batched index copy reads every source first, so block 6 receives what block 5
    held before the step (on a GPU the zeroed new block; here another request's KV), and r2 reads
    it. The shadow names that read ``chained-copy``: before 2026-12-05 it read as a plain ``stale``
    hit, which kvrepro's matcher took for #46453 (fixed in 0.27.0)."""
    kv, out = _shadow(FullAttentionSpec)
    _step(kv, new=[("p", PROMPT, ([1, 2, 3],), 0), ("old", [7] * 8, ([4, 5],), 0)])
    kv.forward("p", 0, 10, [])
    kv.forward("old", 0, 8, [])  # block 5: positions 4-7 of another prompt
    copies = [(2, 5), (5, 6)] if order == "filling copy first" else [(5, 6), (2, 5)]
    tail = PROMPT[:6] + [55, 56]
    _step(kv, new=[("r1", tail, ([1, 5],), 6), ("r2", tail, ([1, 6],), 6)], copies=copies)
    kv.forward("r1", 6, 2, [])
    kv.forward("r2", 6, 2, [])
    assert kv.by_kind == {"full_attention/chained-copy/hit": 1}, out.getvalue()
    assert kv.records[0]["request"] == "r2"
    assert "read GPU block 5 before the same step's copy 2->5 filled it" in kv.records[0]["text"]
    # the stale positions stay the chain's when r2's own tokens fill the rest of block 6 and a
    # later request hits it
    _step(kv, new=[("r3", tail, ([1, 6],), 7)])
    kv.forward("r3", 7, 1, [])
    assert kv.by_kind == {"full_attention/chained-copy/hit": 2}, out.getvalue()


def test_copies_that_do_not_chain_are_not_marked():
    """Two partial hits on the same source block in one step (2 -> 5, 2 -> 6) are two good copies."""
    kv, out = _shadow(FullAttentionSpec)
    _step(kv, new=[("p", PROMPT, ([1, 2, 3],), 0)])
    kv.forward("p", 0, 10, [])
    tail = PROMPT[:6] + [55, 56]
    _step(kv, new=[("r1", tail, ([1, 5],), 6), ("r2", tail, ([1, 6],), 6)], copies=[(2, 5), (2, 6)])
    kv.forward("r1", 6, 2, [])
    kv.forward("r2", 6, 2, [])
    assert kv.violations == 0 and not kv.gpu[6].chained, out.getvalue()


# --------------------------------------------------------------------------- with vLLM


def test_partial_tail_hits_on_vllm_0_30_0_are_copied_and_check_out_clean(runtime_python, shared_zygotes_here):
    """Requests 0 and 2 of the suite's CORRUPT 0.33.0 run (results/suite-20261202-091654-92ef), one
    at a time on vLLM 0.30.0 with the truncate-lagging-mamba entry's engine: the second one's hit
    ends inside a block (208 tokens on 32-token blocks), so vLLM queues copies; with them applied
    the shadow KV finds every context in place. The old model (no copies) reports violations here."""
    from kvrepro.minimize.shrink import OfflineEngine
    from kvrepro.loadgen.trace import read_trace
    from kvrepro.suite.run import SuiteBuild, entry_matrix, load

    entry = next(e for e in load().entries if e.name == "truncate-lagging-mamba")
    engine = OfflineEngine(entry_matrix(entry, [SuiteBuild("0.30.0")]), entry.name, 0)
    try:
        result = engine.run(read_trace(TRACE).requests)
    finally:
        engine.close()
    assert not result.crashed and result.requests_done == 2, result
    assert result.kv_copied > 0, "vLLM queued no copy-on-write copy: the trace no longer reaches a partial hit"
    assert result.kv_checks and result.kv_checks > 0
    assert result.kv_violations == 0, [r["text"] for r in result.kv_records]
