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
from dataclasses import dataclass, field

from ..spec.geometry import BuiltGeometry, parse_geometry_line
from ..spec.matrix import LoadSpec
from .profiles import DEFAULT_CAPACITY, EngineCapacity

_GPU_TOKENS_RE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_BLOCK_RE = re.compile(r"\bblock size (\d+)")
_MAX_GEOMETRIES = 256


@dataclass
class LoggedCapacity:
    """What an engine's log says about its KV capacity, fed one line at a time (the run's one
    pass over the log, kvrepro/classify/report.py, feeds it); the last line of each kind wins."""

    gpu_tokens: int | None = None  # vLLM's ``GPU KV cache size: N tokens``
    block_tokens: int | None = None  # any ``block size N``
    # the GPU-free engine's geometry lines (what vLLM really built), one per rank, in order
    geometries: list[BuiltGeometry] = field(default_factory=list)

    @property
    def built(self) -> BuiltGeometry | None:
        return self.geometries[-1] if self.geometries else None

    def feed(self, raw: str) -> None:
        if "KV cache size: " in raw and (found := _GPU_TOKENS_RE.findall(raw)):
            self.gpu_tokens = int(found[-1].replace(",", ""))
        if "block size " in raw and (found := _BLOCK_RE.findall(raw)):
            self.block_tokens = int(found[-1])
        if (built := parse_geometry_line(raw)) is not None:
            if len(self.geometries) >= _MAX_GEOMETRIES:  # one per DP rank (and restart): more says nothing new
                del self.geometries[1]  # the first and the latest are the ones read
            self.geometries.append(built)

    @classmethod
    def of(cls, log_text: str) -> LoggedCapacity:
        logged = cls()
        for raw in log_text.splitlines():
            logged.feed(raw)
        return logged


def engine_capacity(load: LoadSpec, logged: LoggedCapacity | str = "", block_size: int | None = None,
                    max_model_len: int | None = None, chunk_tokens: int | None = None,
                    data_parallel_size: int = 1) -> EngineCapacity:
    """What the matrix's load says, else what the log says (``logged``: its facts, or its text),
    else the engine spec (``block_size``, ``chunk_tokens``), else the defaults (``source`` tells which)."""
    if isinstance(logged, str):
        logged = LoggedCapacity.of(logged)
    sources = []
    gpu = load.gpu_kv_tokens
    if gpu is not None:
        sources.append("matrix")
    elif logged.gpu_tokens is not None:
        gpu = logged.gpu_tokens
        sources.append("engine log")
    block = chunk = None
    if logged.built is not None:  # what vLLM really built (GPU-free engine)
        block = logged.built.block_size
        chunk = logged.built.chunk_tokens
    else:
        block = logged.block_tokens
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
