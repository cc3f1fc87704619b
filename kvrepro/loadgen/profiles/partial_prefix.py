"""Partial prefix reuse under eviction pressure: the default profile.

The crash (vLLM 0.26.0, hybrid model with MTP and KV offloading) needs one request whose prefix is
partly on the GPU (full-attention blocks and a Mamba state up to a boundary) and continues in the
offload tier past that boundary. That takes a prefix reused to many different depths, families
that fall out of the GPU cache between two uses but stay in the offload tier, and Mamba states at
many boundaries (the hybrid scheduler keeps one where a request diverges from a cached prefix).
This profile makes each of those frequent:

* **Prefix families** of three kinds, as production traffic has them: ``documents`` (RAG,
  long-context Q&A: reused to a depth drawn from ``depth``), ``system_prompts`` (short bodies,
  reused whole, then a user turn) and ``agent_transcripts`` (reused to a depth that grows with
  every use of the family, as an agent's context does, and starts over when it reaches the end).
* **Reuse depth** drawn from a distribution (``constant``, ``uniform``, ``lognormal``, ``zipf``)
  in offload chunks, plus a uniform position inside the chunk: hits end at every block and chunk
  boundary, not only at a family's end. A short fresh suffix follows (a long one only dilutes).
* **Eviction pressure**: the families' bodies together hold ``pressure`` times the engine's GPU
  prefix cache (``EngineCapacity.gpu_tokens``: read from the engine's log, or given), capped so
  they fit the offload tier: families fall out of the GPU cache and stay offloaded.

Measured on the GPU-free engine (build A, 0.26.0, sequential): see benchmarks/requests_to_crash.py.
Every choice is seeded: request ``index`` is a pure function of (settings, seed, capacity, index).
"""

from __future__ import annotations

import bisect
import math
import random
import threading
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from . import Profile, ProfileSettings, Prompt

KINDS = ("documents", "system_prompts", "agent_transcripts")


class Depth(ProfileSettings):
    """How deep (in offload chunks) a document is reused."""

    dist: Literal["constant", "uniform", "lognormal", "zipf"] = "uniform"
    chunks: int | None = Field(None, ge=1, description="constant: this many chunks")
    median_chunks: float = Field(8.0, gt=0, description="lognormal: the median depth")
    sigma: float = Field(0.8, gt=0, description="lognormal: spread (of the log)")
    exponent: float = Field(1.1, gt=0, description="zipf: P(depth = n chunks) ~ 1 / n**exponent")

    @model_validator(mode="after")
    def _needs(self) -> "Depth":
        if (self.dist == "constant") != (self.chunks is not None):
            raise ValueError("depth.chunks is required for dist: constant and only allowed there")
        return self


class PartialPrefixSettings(ProfileSettings):
    mix: dict[Literal["documents", "system_prompts", "agent_transcripts"], float] = Field(
        default_factory=lambda: {"documents": 0.7, "system_prompts": 0.0, "agent_transcripts": 0.3},
        description="share of families per kind (weights, need not sum to 1)")
    document_tokens: tuple[int, int] = Field((720, 880), description="document body length range")
    system_prompt_tokens: tuple[int, int] = Field((160, 320), description="system prompt length range")
    transcript_tokens: tuple[int, int] = Field((720, 880), description="full agent transcript length range")
    transcript_start: float = Field(0.25, gt=0, le=1, description="an agent transcript's first use (share of it)")
    transcript_step_chunks: int = Field(2, ge=1, description="chunks an agent transcript grows per use")
    depth: Depth = Field(default_factory=Depth, description="partial use k: depth distribution")
    suffix_tokens: tuple[int, int] = Field((0, 8), description="fresh tokens after the reused part")
    pressure: float = Field(1.7, gt=0, description="families' bodies together, in GPU prefix caches")
    families: int | None = Field(None, ge=1, description="this many families (default: sized by pressure)")

    @model_validator(mode="after")
    def _ranges(self) -> "PartialPrefixSettings":
        for name in ("document_tokens", "system_prompt_tokens", "transcript_tokens", "suffix_tokens"):
            lo, hi = getattr(self, name)
            low = 0 if name == "suffix_tokens" else 2
            if lo < low or hi < lo:
                raise ValueError(f"{name} must be [low, high] with {low} <= low <= high")
        if not any(w > 0 for w in self.mix.values()) or any(w < 0 for w in self.mix.values()):
            raise ValueError("mix: weights must be >= 0 and at least one > 0")
        return self


@dataclass
class _Family:
    kind: str
    body: tuple[int, ...]
    cycles: int = 0


@dataclass(frozen=True)
class _Use:
    family: int
    phase: str
    reused: int  # tokens of the body the prompt starts with
    cycle: int


class PartialPrefix(Profile):
    name = "partial-prefix"
    Settings = PartialPrefixSettings

    def __init__(self, load, seed, capacity=None):
        super().__init__(load, seed, capacity)
        s = self.settings
        cap = self.capacity
        self.block = max(1, cap.block_tokens)
        self.chunk = max(self.block, cap.chunk_tokens)
        rng = random.Random(f"partial-prefix/families/{seed}")
        kinds = [k for k in KINDS if s.mix.get(k, 0) > 0]
        weights = [s.mix[k] for k in kinds]
        ranges = {"documents": s.document_tokens, "system_prompts": s.system_prompt_tokens,
                  "agent_transcripts": s.transcript_tokens}
        # a prompt must fit the engine (body + suffix + output <= max_model_len)
        longest = max(2 * self.chunk, (cap.max_model_len or 1 << 30) - s.suffix_tokens[1] - load.max_tokens - 1)
        target = s.pressure * cap.gpu_tokens
        if cap.offload_tokens is not None:  # every family must stay in the offload tier
            target = min(target, 0.8 * cap.offload_tokens)
        self.families = []
        total = 0
        while (len(self.families) < s.families) if s.families else (total < target or len(self.families) < 2):
            n = len(self.families)
            kind = kinds[n % len(kinds)] if n < len(kinds) else rng.choices(kinds, weights)[0]
            lo, hi = ranges[kind]
            length = max(2 * self.chunk, min(rng.randint(lo, hi), longest))
            self.families.append(_Family(kind, tuple(rng.randrange(load.vocab_size) for _ in range(length))))
            total += length
        rng.shuffle(self.families)
        self._lock = threading.Lock()
        self._uses: list[_Use] = []
        self._program = self._schedule()

    def describe(self) -> dict:
        d = super().describe()
        d["families"] = [{"kind": f.kind, "tokens": len(f.body)} for f in self.families]
        return d

    # ------------------------------------------------------------------ the schedule

    def _deep_end(self, fam: _Family) -> int:
        if fam.kind != "agent_transcripts":
            return len(fam.body)
        start = self.settings.transcript_start * len(fam.body)
        grown = start + fam.cycles * self.chunk * self.settings.transcript_step_chunks
        if grown > len(fam.body):  # the agent's session ended; a new one starts from the top
            fam.cycles = 0
            grown = start
        return int(grown)

    def _depth_chunks(self, rng: random.Random, most: int) -> int:
        d = self.settings.depth
        if d.dist == "constant":
            n = d.chunks or most
        elif d.dist == "uniform":
            n = rng.randint(1, most)
        elif d.dist == "lognormal":
            n = round(math.exp(rng.gauss(math.log(d.median_chunks), d.sigma)))
        else:  # zipf over 1..most
            cum, acc = [], 0.0
            for j in range(1, most + 1):
                acc += 1.0 / j ** d.exponent
                cum.append(acc)
            n = bisect.bisect_left(cum, rng.random() * acc) + 1
        return max(1, min(most, n))

    def _schedule(self):
        """The endless sequence of uses: a family at random, reused to a drawn depth."""
        turn = 0
        while True:
            rng = random.Random(f"partial-prefix/use/{self.seed}/{turn}")
            turn += 1
            fi = rng.randrange(len(self.families))
            fam = self.families[fi]
            if fam.kind == "system_prompts":
                reused = len(fam.body)
            elif fam.kind == "agent_transcripts":
                reused = self._deep_end(fam) + rng.randrange(self.chunk)
                fam.cycles += 1
            else:
                chunks = max(1, len(fam.body) // self.chunk)
                reused = self._depth_chunks(rng, chunks) * self.chunk + rng.randrange(self.chunk)
            yield _Use(fi, "reuse", max(1, min(reused, len(fam.body))), fam.cycles)

    def _use(self, index: int) -> _Use:
        with self._lock:  # memoised in index order: the same answer whichever thread asks first
            while len(self._uses) <= index:
                self._uses.append(next(self._program))
            return self._uses[index]

    def prompt(self, index: int) -> Prompt:
        use = self._use(index)
        fam = self.families[use.family]
        rng = random.Random(f"partial-prefix/request/{self.seed}/{index}")
        suffix = rng.randint(*self.settings.suffix_tokens)
        if use.reused + suffix == 0:
            suffix = 1
        tokens = fam.body[:use.reused] + tuple(rng.randrange(self.load.vocab_size) for _ in range(suffix))
        return Prompt(index=index, tokens=tokens, max_tokens=self.load.max_tokens,
                      fields={"family": use.family, "kind": fam.kind,
                              "reused_tokens": use.reused, "suffix_tokens": suffix})


PROFILE = PartialPrefix
