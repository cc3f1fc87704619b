"""Partial prefix reuse under eviction pressure: the default profile, built to reach the crash.

The crash needs one request to get a *local* prefix-cache hit (the start of a prefix still on
the GPU) and an *offload* hit right behind it (the rest of that prefix stored to the offload tier
and evicted from the GPU), with the hit's end at a block boundary where the hybrid model's groups
disagree. Organic traffic gets there rarely (47,142 requests in production). This profile makes
every ingredient frequent:

* **Prefix families** of three kinds, as production traffic has them: ``documents`` (a long body
  reused to a random depth: RAG, long-context Q&A), ``system_prompts`` (a short body always reused
  whole, then a user turn) and ``agent_transcripts`` (a body reused to a depth that grows with
  every use of the family, as an agent's context does).
* **Reuse depth** drawn from a distribution (``constant``, ``uniform``, ``lognormal``, ``zipf``)
  in blocks, and the end of the reused part placed exactly on a block boundary with probability
  ``aligned_fraction`` (on a chunk boundary with ``chunk_aligned_fraction``), a few tokens past one
  otherwise: hits end at every block and chunk boundary, not only at the family's end.
* **Eviction pressure**: the families' bodies together hold ``pressure`` times the engine's GPU
  prefix cache (``EngineCapacity.gpu_tokens``, read from the engine's log or given), capped so they
  still fit the offload tier: a family falls out of the GPU between two uses but stays offloaded.

Every choice is seeded: request ``index`` is a pure function of (settings, seed, capacity, index).
"""

from __future__ import annotations

import bisect
import math
import random
import threading
from typing import Literal

from pydantic import Field, model_validator

from . import Profile, ProfileSettings, Prompt

KINDS = ("documents", "system_prompts", "agent_transcripts")


class Depth(ProfileSettings):
    """How deep (in blocks) a request reuses its family's body."""

    dist: Literal["constant", "uniform", "lognormal", "zipf"] = "uniform"
    blocks: int | None = Field(None, ge=1, description="constant: this many blocks (default: the whole body)")
    median_blocks: float = Field(8.0, gt=0, description="lognormal: the median depth")
    sigma: float = Field(0.8, gt=0, description="lognormal: spread (of the log)")
    exponent: float = Field(1.1, gt=0, description="zipf: P(depth = k blocks) ~ 1 / k**exponent")

    @model_validator(mode="after")
    def _needs(self) -> "Depth":
        if self.dist != "constant" and self.blocks is not None:
            raise ValueError("depth.blocks is only for dist: constant")
        return self


class PartialPrefixSettings(ProfileSettings):
    mix: dict[Literal["documents", "system_prompts", "agent_transcripts"], float] = Field(
        default_factory=lambda: {"documents": 0.6, "system_prompts": 0.1, "agent_transcripts": 0.3},
        description="share of requests per family kind (weights, need not sum to 1)")
    document_tokens: tuple[int, int] = Field((192, 480), description="document body length range")
    system_prompt_tokens: tuple[int, int] = Field((48, 160), description="system prompt length range")
    transcript_tokens: tuple[int, int] = Field((256, 560), description="full agent transcript length range")
    transcript_start_blocks: int = Field(2, ge=1, description="an agent transcript's first use, in blocks")
    transcript_step_blocks: tuple[int, int] = Field((1, 3), description="blocks a transcript grows per use")
    depth: Depth = Field(default_factory=Depth, description="documents: reuse depth distribution")
    aligned_fraction: float = Field(0.5, ge=0, le=1, description="reused part ends exactly on a block boundary")
    chunk_aligned_fraction: float = Field(0.25, ge=0, le=1, description="... on an offload chunk boundary")
    suffix_tokens: tuple[int, int] = Field((1, 24), description="fresh tokens after the reused part")
    pressure: float = Field(2.0, gt=0, description="families' bodies / GPU prefix cache (in tokens)")
    min_families: int = Field(3, ge=1)
    max_families: int = Field(64, ge=1)
    hot_fraction: float = Field(0.0, ge=0, le=1,
                                description="share of requests that go to the most recent family (locality)")

    @model_validator(mode="after")
    def _ranges(self) -> "PartialPrefixSettings":
        for name in ("document_tokens", "system_prompt_tokens", "transcript_tokens", "transcript_step_blocks",
                     "suffix_tokens"):
            lo, hi = getattr(self, name)
            if lo < 0 or hi < lo or (name != "suffix_tokens" and lo < 1):
                raise ValueError(f"{name} must be [low, high] with {0 if name == 'suffix_tokens' else 1} <= low <= high")
        if not any(w > 0 for w in self.mix.values()) or any(w < 0 for w in self.mix.values()):
            raise ValueError("mix: weights must be >= 0 and at least one > 0")
        if self.min_families > self.max_families:
            raise ValueError("min_families must not exceed max_families")
        return self


class _Family:
    def __init__(self, kind: str, body: tuple[int, ...]):
        self.kind = kind
        self.body = body


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
        # A body of more than half the GPU cache could not be partly cached while others are.
        max_body = max(self.block, cap.gpu_tokens // 2)
        target = s.pressure * cap.gpu_tokens
        if cap.offload_tokens is not None:
            target = min(target, 0.8 * cap.offload_tokens)  # stay in the offload tier
        self.families: list[_Family] = []
        total = 0
        while len(self.families) < s.max_families and (total < target or len(self.families) < s.min_families):
            kind = kinds[len(self.families) % len(kinds)] if len(self.families) < len(kinds) else \
                rng.choices(kinds, weights)[0]
            lo, hi = ranges[kind]
            length = min(rng.randint(lo, hi), max_body)
            body = tuple(rng.randrange(self.load.vocab_size) for _ in range(length))
            self.families.append(_Family(kind, body))
            total += length
        self.by_kind = {k: [i for i, f in enumerate(self.families) if f.kind == k] for k in kinds}
        self.kinds, self.weights = [k for k in kinds if self.by_kind[k]], [s.mix[k] for k in kinds if self.by_kind[k]]
        self._choices: list[tuple[int, int]] = []  # index -> (family, how many earlier uses)
        self._uses: dict[int, int] = {}
        self._last_family = 0
        self._lock = threading.Lock()

    def describe(self) -> dict:
        d = super().describe()
        d["families"] = [{"kind": f.kind, "tokens": len(f.body)} for f in self.families]
        return d

    def _choice(self, index: int) -> tuple[int, int]:
        """Which family request ``index`` reuses and how often it was reused before (memoised in
        index order, so the answer does not depend on which thread asks first)."""
        with self._lock:
            return self._choice_locked(index)

    def _choice_locked(self, index: int) -> tuple[int, int]:
        while len(self._choices) <= index:
            i = len(self._choices)
            rng = random.Random(f"partial-prefix/choice/{self.seed}/{i}")
            if i > 0 and rng.random() < self.settings.hot_fraction:
                fam = self._last_family
            else:
                kind = rng.choices(self.kinds, self.weights)[0]
                fam = rng.choice(self.by_kind[kind])
            uses = self._uses.get(fam, 0)
            self._uses[fam] = uses + 1
            self._last_family = fam
            self._choices.append((fam, uses))
        return self._choices[index]

    def _depth_blocks(self, rng: random.Random, max_blocks: int) -> int:
        d = self.settings.depth
        if d.dist == "constant":
            k = d.blocks or max_blocks
        elif d.dist == "uniform":
            k = rng.randint(1, max_blocks)
        elif d.dist == "lognormal":
            k = round(math.exp(rng.gauss(math.log(d.median_blocks), d.sigma)))
        else:  # zipf over 1..max_blocks
            cum, acc = [], 0.0
            for j in range(1, max_blocks + 1):
                acc += 1.0 / j ** d.exponent
                cum.append(acc)
            k = bisect.bisect_left(cum, rng.random() * acc) + 1
        return max(1, min(max_blocks, k))

    def _end(self, rng: random.Random, blocks: int, body_len: int) -> int:
        """Where the reused part ends: on a chunk boundary, a block boundary, or a few tokens past."""
        s = self.settings
        r = rng.random()
        if r < s.chunk_aligned_fraction and self.chunk > self.block:
            end = max(self.chunk, (blocks * self.block) // self.chunk * self.chunk)
        elif r < s.chunk_aligned_fraction + s.aligned_fraction:
            end = blocks * self.block
        else:
            end = blocks * self.block + rng.randint(1, self.block - 1) if self.block > 1 else blocks
        return max(1, min(end, body_len))

    def prompt(self, index: int) -> Prompt:
        fam_index, uses = self._choice(index)
        fam = self.families[fam_index]
        s = self.settings
        rng = random.Random(f"partial-prefix/request/{self.seed}/{index}")
        max_blocks = max(1, len(fam.body) // self.block)
        if fam.kind == "system_prompts":
            reused = len(fam.body)
        elif fam.kind == "agent_transcripts":
            grown = s.transcript_start_blocks + sum(
                random.Random(f"partial-prefix/grow/{self.seed}/{fam_index}/{u}").randint(*s.transcript_step_blocks)
                for u in range(uses))
            if grown > max_blocks:  # the agent's session ended: a new one starts from the top
                grown = s.transcript_start_blocks + grown % max(1, max_blocks - s.transcript_start_blocks)
            reused = self._end(rng, min(grown, max_blocks), len(fam.body))
        else:
            reused = self._end(rng, self._depth_blocks(rng, max_blocks), len(fam.body))
        suffix = rng.randint(*s.suffix_tokens)
        if reused + suffix == 0:
            suffix = 1
        tokens = fam.body[:reused] + tuple(rng.randrange(self.load.vocab_size) for _ in range(suffix))
        return Prompt(index=index, tokens=tokens, max_tokens=self.load.max_tokens,
                      fields={"family": fam_index, "kind": fam.kind, "reused_tokens": reused,
                              "suffix_tokens": suffix})


PROFILE = PartialPrefix
