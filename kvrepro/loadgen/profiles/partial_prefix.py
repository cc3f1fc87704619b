"""Partial prefix reuse under eviction pressure: the default profile.

The crash (vLLM 0.26.0, hybrid model with MTP and KV offloading) needs one request whose prefix is
partly on the GPU (full-attention blocks and a Mamba state up to a boundary) and continues in the
offload tier past that boundary, where a Mamba state was offloaded too. Measured on the GPU-free
engine (docs/load.md): a Mamba state is kept only where a prompt's computed part ends on a block
boundary (without chunked prefill: where the prompt itself ends on one), so both boundaries must be
the end of an earlier prompt, and the GPU must have lost the blocks between them but not the part
before. Production traffic does that when a document or an agent transcript is used in full, then
only up to an earlier point (a question on its first sections, an agent rewinding to a checkpoint),
then in full again with something new after it, while other traffic pushes the family's tail out
of the GPU cache into the offload tier.

Two schedules (``schedule``):

* ``revisit`` (default): every family is used three times -- ``deep`` (the whole body), ``shallow``
  (the body up to a depth drawn from ``depth``) and ``again`` (the whole body and a fresh suffix:
  a question, an agent's next step) -- and families are interleaved ``lag`` apart: the requests
  go ``deep(i), shallow(i-lag), again(i-lag)`` for i = 0, 1, ... Each body is ``family_share`` of
  the GPU prefix cache (``EngineCapacity.gpu_tokens``: read from the engine's log, or given), so
  the next family's deep use evicts the oldest cached blocks: vLLM frees a request's blocks last
  first, so a family loses its tail before its head and keeps it in the offload tier. The shallow
  use then leaves a Mamba state where the cached part ends, and ``again`` finds the rest offloaded.
  Measured before pass-through (shipped matrix, build A, 10 seeds): the first target crash at
  request 4 or 7 for any share from 0.55 to 0.65, at 7-10 from 0.33 to 0.45 (``lag: 1``).

  **Pass-through** (``pass_through``, default on): right after its deep use, each family is asked
  about its last two chunks -- ``pass`` uses: the body up to ``L - chunk`` and up to ``L``, each
  followed by a new question of two chunks. Why: ``again`` needs the states at the end of the body
  in the offload tier, and *which* chunks a release offloads is release policy that keeps changing
  (vLLM 0.25.1 never stores the last chunk of a step in an MTP/eagle group, nor anything at finish;
  0.26.0 stores prefill's last chunk). What every release stores is a chunk that lies inside a
  request's computed range, and a ``pass`` use hits the state at its depth locally and computes two
  chunks past it in the same step. Two adjacent depths because a connector that widens a group's
  window (eagle groups, 0.25.1-0.29.0) needs two consecutive states for one hit. Without it the
  revisit load made 0 trigger calls on 0.25.1 in 2 x 600 requests; with it both 0.25.1 and 0.26.0
  crash at the first ``again`` (request 8; docs/defect-family.md section 4, docs/load.md).
* ``random``: a fixed set of families (their bodies together ``pressure`` times the GPU cache,
  capped to fit the offload tier), each use a family at random reused to a drawn depth (the
  previous default; agent transcripts grow with every use).

Families are of three kinds, as production traffic has them: ``documents`` (RAG, long-context
Q&A), ``system_prompts`` (short bodies) and ``agent_transcripts`` (their ``again`` adds a longer
step, ``transcript_step_tokens``). Reuse depth is drawn from a distribution (``constant``,
``uniform``, ``lognormal``, ``zipf``) in units of ``align`` (a block or an offload chunk; ``none``:
any token, plus a uniform position inside the chunk) so hits end at every block and chunk
boundary of a body. Every choice is seeded: request ``index`` is a pure function of (settings,
seed, capacity, index).
"""

from __future__ import annotations

import array
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
    """How deep a family is reused, in units of ``align`` (blocks or chunks).

    ``uniform`` draws from ``low_share`` of the body up to one unit short of it (revisit) or from
    one unit up to the whole body (random); the others are bounded by the body.
    """

    dist: Literal["constant", "uniform", "lognormal", "zipf"] = "uniform"
    chunks: int | None = Field(None, ge=1, description="constant: this many units")
    median_chunks: float = Field(8.0, gt=0, description="lognormal: the median depth")
    sigma: float = Field(0.8, gt=0, description="lognormal: spread (of the log)")
    exponent: float = Field(1.1, gt=0, description="zipf: P(depth = n units) ~ 1 / n**exponent")
    low_share: float = Field(0.5, ge=0, lt=1, description="uniform, revisit: the shallowest depth, as a share of the body")

    @model_validator(mode="after")
    def _needs(self) -> "Depth":
        if (self.dist == "constant") != (self.chunks is not None):
            raise ValueError("depth.chunks is required for dist: constant and only allowed there")
        return self


class PartialPrefixSettings(ProfileSettings):
    schedule: Literal["revisit", "random"] = Field("revisit", description="how families are used (module docstring)")
    mix: dict[Literal["documents", "system_prompts", "agent_transcripts"], float] = Field(
        default_factory=lambda: {"documents": 0.7, "system_prompts": 0.0, "agent_transcripts": 0.3},
        description="share of families per kind (weights, need not sum to 1)")
    align: Literal["block", "chunk", "none"] = Field(
        "block", description="where reused parts end: on a KV block, an offload chunk, or anywhere")
    depth: Depth = Field(default_factory=Depth, description="partial use: depth distribution")
    suffix_tokens: tuple[int, int] = Field((1, 8), description="fresh tokens after the reused part")
    # revisit
    family_share: float = Field(0.6, gt=0, le=2, description="revisit: a body's length / the GPU prefix cache")
    lag: int = Field(1, ge=1, description="revisit: families between a family's deep use and its again "
                     "(times the DP ranks with dp_routing: affinity)")
    transcript_step_tokens: tuple[int, int] = Field((16, 64), description="revisit: an agent's new step")
    pass_through: bool = Field(True, description="revisit: after a family's deep use, ask about its last two "
                               "chunks (body up to each + a new question), so the states that `again` needs "
                               "are inside a computed range whatever a release offloads (module docstring)")
    # random
    document_tokens: tuple[int, int] = Field((720, 880), description="random: document body length range")
    system_prompt_tokens: tuple[int, int] = Field((160, 320), description="system prompt length range")
    transcript_tokens: tuple[int, int] = Field((720, 880), description="random: full agent transcript length range")
    transcript_start: float = Field(0.25, gt=0, le=1, description="random: an agent transcript's first use (share of it)")
    transcript_step_chunks: int = Field(2, ge=1, description="random: chunks an agent transcript grows per use")
    pressure: float = Field(1.7, gt=0, description="random: families' bodies together, in GPU prefix caches")
    families: int | None = Field(None, ge=1, description="random: this many families (default: sized by pressure)")

    @model_validator(mode="after")
    def _ranges(self) -> "PartialPrefixSettings":
        for name in ("document_tokens", "system_prompt_tokens", "transcript_tokens", "suffix_tokens",
                     "transcript_step_tokens"):
            lo, hi = getattr(self, name)
            low = 0 if name == "suffix_tokens" else 2 if name.endswith("_tokens") and "step" not in name else 1
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
    shallow: int = 0  # revisit: tokens of the body the shallow use keeps


@dataclass(frozen=True)
class _Use:
    family: int
    phase: str
    reused: int  # tokens of the body the prompt starts with
    cycle: int
    suffix: tuple[int, int] = (0, 0)  # fresh tokens after it: [low, high]


class PartialPrefix(Profile):
    name = "partial-prefix"
    Settings = PartialPrefixSettings
    affinity_field = "family"

    def __init__(self, load, seed, capacity=None):
        super().__init__(load, seed, capacity)
        s = self.settings
        cap = self.capacity
        self.block = max(1, cap.block_tokens)
        self.chunk = max(self.block, cap.chunk_tokens)
        self.unit = {"block": self.block, "chunk": self.chunk, "none": 1}[s.align]
        self.kinds = [k for k in KINDS if s.mix.get(k, 0) > 0]
        self.weights = [s.mix[k] for k in self.kinds]
        # a prompt must fit the engine (body + suffix + output <= max_model_len)
        most_suffix = max(s.suffix_tokens[1], s.transcript_step_tokens[1] if "agent_transcripts" in self.kinds else 0)
        if s.schedule == "revisit" and s.pass_through:  # a pass use's question follows the whole body
            most_suffix = max(most_suffix, 2 * self.chunk + s.suffix_tokens[1])
        self.longest = max(2 * self.chunk, (cap.max_model_len or 1 << 30) - most_suffix - load.max_tokens - 1)
        self._lock = threading.Lock()
        self._uses: list[_Use] = []
        self.families: list[_Family] = []
        if s.schedule == "random":
            self._make_fixed_families()
            self._program = self._random_schedule()
        else:
            self._program = self._revisit_schedule()

    def describe(self) -> dict:
        d = super().describe()
        if self.settings.schedule == "random":
            d["families"] = [{"kind": f.kind, "tokens": len(f.body)} for f in self.families]
        else:
            d["family_tokens"] = self._revisit_length_range()
        return d

    def _body(self, rng: random.Random, length: int) -> tuple[int, ...]:
        return tuple(rng.randrange(self.load.vocab_size) for _ in range(length))

    def _fresh_body(self, key: str, length: int) -> tuple[int, ...]:
        """``length`` seeded token ids, ~25x cheaper than ``_body``: the revisit schedule makes a
        new family every third request, and drawing each id with randrange made the profile the
        load generator's main cost (1.5 of 2.4 CPU-seconds per 5,000 requests). 16-bit draws
        taken modulo the vocabulary: the slight bias towards low ids does not matter here."""
        raw = array.array("H", random.Random(key).randbytes(2 * length))
        vocab = self.load.vocab_size
        return tuple(x % vocab for x in raw)

    def _round(self, tokens: int) -> int:
        """Down to a whole ``align`` unit (at least one)."""
        return max(self.unit, tokens - tokens % self.unit)

    # ------------------------------------------------------------------ revisit

    def _revisit_length_range(self) -> tuple[int, int]:
        target = self.settings.family_share * self.capacity.gpu_tokens
        if self.capacity.offload_tokens is not None:  # the families in flight must stay in the offload tier
            target = min(target, 0.8 * self.capacity.offload_tokens / (self.settings.lag + 1))
        lo = self._round(min(self.longest, max(2 * self.unit, int(0.85 * target))))
        hi = self._round(min(self.longest, max(2 * self.unit, int(1.15 * target))))
        return lo, max(lo, hi)

    def _revisit_family(self, i: int) -> _Family:
        while len(self.families) <= i:
            n = len(self.families)
            rng = random.Random(f"partial-prefix/revisit-family/{self.seed}/{n}")
            kind = self.kinds[n % len(self.kinds)] if n < len(self.kinds) else rng.choices(self.kinds, self.weights)[0]
            lo, hi = self._revisit_length_range()
            if kind == "system_prompts":  # short bodies: at most their own range
                hi = max(2 * self.unit, min(hi, self._round(self.settings.system_prompt_tokens[1])))
                lo = min(lo, hi)
            length = self._round(rng.randint(lo, hi))
            units = length // self.unit
            fam = _Family(kind, self._fresh_body(f"partial-prefix/revisit-body/{self.seed}/{n}", length))
            fam.shallow = self._depth_units(rng, units, revisit=True) * self.unit
            self.families.append(fam)
        return self.families[i]

    def _pass_through_uses(self, i: int, fam: _Family):
        """``pass`` uses of family ``i``: its body up to ``L - chunk`` and up to ``L``, each followed by
        a new question of two chunks (plus the suffix draw), so each request hits the state at its
        depth locally and computes past it in the same step (module docstring, "pass-through")."""
        length, chunk = len(fam.body), self.chunk
        if length < 2 * chunk:
            return
        lo, hi = self.settings.suffix_tokens
        question = (2 * chunk + lo, 2 * chunk + hi)
        for depth in (length - chunk, length):  # self.longest leaves room for the question
            yield _Use(i, "pass", depth, 0, question)

    def _revisit_schedule(self):
        """deep(i), [pass(i) x 2], shallow(i-lag), again(i-lag) for i = 0, 1, 2, ... (the uses that exist)."""
        lag = self.settings.lag
        if getattr(self.load, "dp_routing", "engine") == "affinity":
            # family i goes to rank i % ranks: the next deep use on its rank is `ranks` families on
            lag *= max(1, self.capacity.data_parallel_size)
        step_suffix = self.settings.transcript_step_tokens
        i = 0
        while True:
            fam = self._revisit_family(i)
            yield _Use(i, "deep", len(fam.body), 0)
            if self.settings.pass_through:
                yield from self._pass_through_uses(i, fam)
            if i >= lag:
                prev = self._revisit_family(i - lag)
                yield _Use(i - lag, "shallow", prev.shallow, 0)
                suffix = step_suffix if prev.kind == "agent_transcripts" else self.settings.suffix_tokens
                yield _Use(i - lag, "again", len(prev.body), 0, (max(1, suffix[0]), max(1, suffix[1])))
            i += 1

    # ------------------------------------------------------------------ random

    def _make_fixed_families(self) -> None:
        s = self.settings
        cap = self.capacity
        rng = random.Random(f"partial-prefix/families/{self.seed}")
        ranges = {"documents": s.document_tokens, "system_prompts": s.system_prompt_tokens,
                  "agent_transcripts": s.transcript_tokens}
        target = s.pressure * cap.gpu_tokens
        if cap.offload_tokens is not None:  # every family must stay in the offload tier
            target = min(target, 0.8 * cap.offload_tokens)
        total = 0
        while (len(self.families) < s.families) if s.families else (total < target or len(self.families) < 2):
            n = len(self.families)
            kind = self.kinds[n % len(self.kinds)] if n < len(self.kinds) else rng.choices(self.kinds, self.weights)[0]
            lo, hi = ranges[kind]
            length = max(2 * self.chunk, min(rng.randint(lo, hi), self.longest))
            self.families.append(_Family(kind, self._body(rng, length)))
            total += length
        rng.shuffle(self.families)

    def _deep_end(self, fam: _Family) -> int:
        if fam.kind != "agent_transcripts":
            return len(fam.body)
        start = self.settings.transcript_start * len(fam.body)
        grown = start + fam.cycles * self.chunk * self.settings.transcript_step_chunks
        if grown > len(fam.body):  # the agent's session ended; a new one starts from the top
            fam.cycles = 0
            grown = start
        return int(grown)

    def _depth_units(self, rng: random.Random, most: int, revisit: bool = False) -> int:
        """A depth in align units: 1..most (random) or 1..most-1 (revisit: short of the body)."""
        d = self.settings.depth
        top = max(1, most - 1) if revisit else most
        if d.dist == "constant":
            n = d.chunks or top
        elif d.dist == "uniform":
            low = max(1, math.ceil(d.low_share * most)) if revisit else 1
            n = rng.randint(min(low, top), top)
        elif d.dist == "lognormal":
            n = round(math.exp(rng.gauss(math.log(d.median_chunks), d.sigma)))
        else:  # zipf over 1..top
            cum, acc = [], 0.0
            for j in range(1, top + 1):
                acc += 1.0 / j ** d.exponent
                cum.append(acc)
            n = bisect.bisect_left(cum, rng.random() * acc) + 1
        return max(1, min(top, n))

    def _random_schedule(self):
        """The endless sequence of uses: a family at random, reused to a drawn depth."""
        turn = 0
        while True:
            rng = random.Random(f"partial-prefix/use/{self.seed}/{turn}")
            turn += 1
            fi = rng.randrange(len(self.families))
            fam = self.families[fi]
            inside = rng.randrange(self.chunk) if self.settings.align == "none" else 0
            if fam.kind == "system_prompts":
                reused = len(fam.body)
            elif fam.kind == "agent_transcripts":
                reused = self._deep_end(fam) + inside
                fam.cycles += 1
            else:
                units = max(1, len(fam.body) // self.unit)
                reused = self._depth_units(rng, units) * self.unit + inside
            yield _Use(fi, "reuse", max(1, min(reused, len(fam.body))), fam.cycles, self.settings.suffix_tokens)

    # ------------------------------------------------------------------ prompts

    def _use(self, index: int) -> _Use:
        with self._lock:  # memoised in index order: the same answer whichever thread asks first
            while len(self._uses) <= index:
                self._uses.append(next(self._program))
            return self._uses[index]

    def prompt(self, index: int) -> Prompt:
        use = self._use(index)
        fam = self.families[use.family]
        rng = random.Random(f"partial-prefix/request/{self.seed}/{index}")
        suffix = rng.randint(*use.suffix)
        if use.reused + suffix == 0:
            suffix = 1
        tokens = fam.body[:use.reused] + self._body(rng, suffix)
        return Prompt(index=index, tokens=tokens, max_tokens=self.load.max_tokens,
                      fields={"family": use.family, "kind": fam.kind, "phase": use.phase,
                              "reused_tokens": use.reused, "suffix_tokens": suffix})


PROFILE = PartialPrefix
