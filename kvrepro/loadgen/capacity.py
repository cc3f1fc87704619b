"""The engine's KV capacity, which profiles size their eviction pressure from.

Read from what vLLM logs at start-up (``GPU KV cache size: 1,404 tokens``; the GPU-free engine
also logs ``block size N``), unless the matrix gives it (``load.gpu_kv_tokens``,
``load.offload_kv_tokens``, ``load.chunk_tokens``): an engine on another host, or a log that
says nothing, still gets a load sized for it.
"""

from __future__ import annotations

import re

from ..spec import LoadSpec
from .profiles import DEFAULT_CAPACITY, EngineCapacity

_GPU_TOKENS_RE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_BLOCK_RE = re.compile(r"\bblock size (\d+)")


def engine_capacity(load: LoadSpec, log_text: str = "", block_size: int | None = None,
                    max_model_len: int | None = None) -> EngineCapacity:
    """What the matrix says, else what the log says, else the defaults (``source`` tells which)."""
    sources = []
    gpu = load.gpu_kv_tokens
    if gpu is not None:
        sources.append("matrix")
    else:
        found = _GPU_TOKENS_RE.findall(log_text)
        if found:
            gpu = int(found[-1].replace(",", ""))
            sources.append("engine log")
    block = None
    found_block = _BLOCK_RE.findall(log_text)
    if found_block:
        block = int(found_block[-1])
    block = block or block_size or DEFAULT_CAPACITY.block_tokens
    return EngineCapacity(
        gpu_tokens=gpu or DEFAULT_CAPACITY.gpu_tokens,
        offload_tokens=load.offload_kv_tokens,
        block_tokens=block,
        chunk_tokens=load.chunk_tokens or block,
        max_model_len=max_model_len,
        source="+".join(sources) or "default",
    )
