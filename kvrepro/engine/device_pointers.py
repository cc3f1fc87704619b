"""The GPU's KV-cache memory as vLLM 0.34.0+'s offloading connector worker sees it, without a GPU.

From 0.34.0 the connector worker turns each transfer's GPU blocks into device pointers before it
submits the job (``resolve_device_pointers``, ``offloading/worker.py`` 0.34.0:242-272), from the KV
caches a GPU worker registers (``register_kv_caches``). Here those caches are vLLM's own
``CanonicalKVCaches`` over :class:`BlockIndexMemory`, whose pointer for block ``b`` is ``b``, so a
transfer worker reads the block ids back from the pointers (:func:`device_blocks`).

One source for the GPU-free executor (kvrepro/engine/executor.py) and the test `kvrepro minimize
--emit-pytest` writes, which carries this module's code inlined as its syntax tree (it imports
nothing of kvrepro). Standard library only at import time; vLLM's classes are imported where used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceBlocks:
    """A transfer's GPU blocks as the shadow KV and the fault plan read them (GPULoadStoreSpec's fields)."""

    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


def device_blocks(spec):
    """``spec`` itself, or for vLLM's DevicePointers (0.34.0+) the block ids they point at: the sim's
    KV caches put block ``b`` at address ``b`` (:class:`BlockIndexMemory`); pointers are laid out
    group after group, data reference after data reference, so the first reference of each group
    lists its blocks."""
    ptrs = getattr(spec, "ptrs", None)
    if ptrs is None:
        return spec
    ids: list[int] = []
    offset = 0
    for size, refs in zip(spec.group_block_counts, spec.group_data_ref_counts, strict=True):
        ids.extend(int(p) for p in ptrs[offset:offset + size])
        offset += size * refs
    return DeviceBlocks(tuple(ids), tuple(spec.group_block_counts), tuple(spec.block_indices))


class BlockIndexMemory:
    """Stands for a KV-cache tensor of shape (num_blocks, page) in vLLM's CanonicalKVCaches: block
    ``b`` starts at address ``b`` (base 0, row stride 1), the only two things
    ``resolve_device_pointers`` asks of it. No memory behind it: the sim moves no bytes."""

    def data_ptr(self) -> int:
        return 0

    def stride(self, dim: int = 0) -> int:
        return 1


def block_index_caches(kv_cache_config):
    """vLLM's CanonicalKVCaches over :class:`BlockIndexMemory`, one data reference per offloaded
    group (the groups the connector worker's register_kv_caches would select)."""
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids

        group_ids = get_offloading_group_ids(kv_cache_config)
    except ImportError:
        group_ids = tuple(range(len(kv_cache_config.kv_cache_groups)))
    tensors, refs = [], []
    for i, group_id in enumerate(group_ids):
        page = kv_cache_config.kv_cache_groups[group_id].kv_cache_spec.page_size_bytes
        tensors.append(CanonicalKVCacheTensor(tensor=BlockIndexMemory(), page_size_bytes=page))
        refs.append([CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page)])
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)
