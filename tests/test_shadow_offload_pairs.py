"""The shadow KV places an offload store's GPU blocks in CPU sub-blocks the way vLLM's CPU worker does.

Why: `kvrepro explore` on build E found `mamba+offload/missing/hit` (docs/explore.md). Its store
job 25 listed a Mamba group's two non-null blocks of one 64-token chunk with one start index
(``group_sizes=[2, 2, 0] block_indices=[1, 1, 0]``). vLLM's ``compute_sub_block_ptrs``
(vllm/v1/kv_offload/cpu/gpu_worker.py) writes a group's blocks to consecutive sub-blocks from
``block_indices[g] % blocks_per_chunk``, so they land in sub-blocks 1 and 2, and sub-block 3, the
one a Mamba load at the chunk boundary reads, is never written. This test replays the two specs
of that run (store job 25, load job 32) through the shadow KV: if the shadow ever paired a gapped
store differently from the worker, the finding would be an artefact of kvrepro, not vLLM's.

Faked (no GPU, no vLLM import): the KV-cache config and the transfer specs are plain objects with
the field names of vLLM's ``KVCacheConfig`` and ``GPULoadStoreSpec``/``CPULoadStoreSpec``.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

from kvrepro.engine.shadow import Content, ShadowKV


class MambaSpec:  # describe_groups() reads the class name, as it does for vLLM's specs
    block_size = 16
    mamba_cache_mode = "align"


class FullAttentionSpec:
    block_size = 16


def _config():
    groups = [SimpleNamespace(kv_cache_spec=spec) for spec in (MambaSpec(), MambaSpec(), FullAttentionSpec())]
    return SimpleNamespace(kv_cache_groups=groups)


def _gpu(block_ids, group_sizes, block_indices):
    return SimpleNamespace(block_ids=block_ids, group_sizes=group_sizes, block_indices=block_indices)


def _cpu(block_ids):
    return SimpleNamespace(block_ids=block_ids)


def test_a_gapped_mamba_store_leaves_the_boundary_sub_block_unwritten(monkeypatch):
    monkeypatch.setenv("KVREPRO_SIM_SHADOW_DEBUG", "1")
    out = io.StringIO()
    shadow = ShadowKV(_config(), blocks_per_chunk=4, stream=out)
    for block in (95, 49, 31, 7):  # the two Mamba groups' states, as the forwards left them
        shadow.gpu[block] = Content(0 if block in (95, 49) else 1, states=frozenset({block}), source=f"state {block}")

    # store job 25 of the run: one chunk, each Mamba group's non-null blocks from index 1
    shadow.store(25, _gpu([95, 49, 31, 7], [2, 2, 0], [1, 1, 0]), _cpu([41, 42]))
    assert set(shadow.cpu) == {(41, 1), (41, 2), (42, 1), (42, 2)}  # sub-block 3 of neither chunk
    assert "pairs=g0:95->41.1,g0:49->41.2,g1:31->42.1,g1:7->42.2" in out.getvalue()

    # load job 32: a 64-token offload hit reads each Mamba group's block index 3 from sub-block 3
    shadow.load(32, _cpu([41, 42, 0]), _gpu([29, 73, 66, 40, 61, 54], [1, 1, 4], [3, 3, 0]))
    for block in (29, 73):
        assert shadow.gpu[block].states is None and "no store wrote" in shadow.gpu[block].source
    assert "load(for None) step=0 job=32" in out.getvalue()


def test_a_mamba_store_ending_on_the_chunk_boundary_loads_back_its_state():
    """The shape 0.30.0 stores (one block per Mamba boundary, index boundary/16 - 1): it lands in
    sub-block 3 and a load at that boundary reads the same state back."""
    shadow = ShadowKV(_config(), blocks_per_chunk=4, stream=io.StringIO())
    shadow.gpu[49] = Content(0, states=frozenset({"after 64"}), source="state after 64 tokens")
    shadow.store(26, _gpu([49], [1, 0, 0], [3, 0, 0]), _cpu([41]))
    shadow.load(33, _cpu([41]), _gpu([29], [1, 0, 0], [3, 0, 0]))
    assert shadow.gpu[29].states == frozenset({"after 64"})
