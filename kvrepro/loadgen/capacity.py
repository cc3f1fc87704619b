"""The engine's KV capacity, which profiles size their eviction pressure from.

Read from what vLLM logs at start-up (``GPU KV cache size: 1,404 tokens``; the GPU-free engine
also logs the geometry vLLM built: ``kvrepro-sim: geometry ... block_size=N
offload_chunk_tokens=M``), unless the matrix gives it (``load.gpu_kv_tokens``,
``load.offload_kv_tokens``, ``load.chunk_tokens``): an engine on another host, or a log that
says nothing, still gets a load sized for it (block and chunk from ``engine.geometry``).
With data parallelism every rank logs its own pool; the load is sized for one rank's.
"""

from __future__ import annotations

import re

from ..spec.matrix import LoadSpec
from .profiles import DEFAULT_CAPACITY, EngineCapacity

_GPU_TOKENS_RE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_BLOCK_RE = re.compile(r"\bblock size (\d+)")
_GEOMETRY_RE = re.compile(r"kvrepro-sim: geometry .*?\bblock_size=(\d+) offload_chunk_tokens=(\d+|-)")


def engine_capacity(load: LoadSpec, log_text: str = "", block_size: int | None = None,
                    max_model_len: int | None = None, chunk_tokens: int | None = None,
                    data_parallel_size: int = 1) -> EngineCapacity:
    """What the matrix's load says, else what the log says, else the engine spec (``block_size``,
    ``chunk_tokens``), else the defaults (``source`` tells which)."""
    sources = []
    gpu = load.gpu_kv_tokens
    if gpu is not None:
        sources.append("matrix")
    else:
        found = _GPU_TOKENS_RE.findall(log_text)
        if found:
            gpu = int(found[-1].replace(",", ""))
            sources.append("engine log")
    block = chunk = None
    geometry = _GEOMETRY_RE.findall(log_text)
    if geometry:  # what vLLM really built (GPU-free engine)
        block = int(geometry[-1][0])
        chunk = int(geometry[-1][1]) if geometry[-1][1] != "-" else None
    else:
        found_block = _BLOCK_RE.findall(log_text)
        if found_block:
            block = int(found_block[-1])
    block = block or block_size or DEFAULT_CAPACITY.block_tokens
    return EngineCapacity(
        gpu_tokens=gpu or DEFAULT_CAPACITY.gpu_tokens,
        offload_tokens=load.offload_kv_tokens,
        block_tokens=block,
        chunk_tokens=load.chunk_tokens or chunk or chunk_tokens or block,
        max_model_len=max_model_len,
        source="+".join(sources) or "default",
        data_parallel_size=data_parallel_size,
    )
