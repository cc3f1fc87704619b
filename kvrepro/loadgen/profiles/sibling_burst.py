"""Sibling prompts that arrive together after their parent: partial prefix hits on one block in one step.

Production shape: a document (or a system prompt, an agent transcript) is read once, then two or more
follow-ups that extend it identically arrive at the same moment (a fan-out: n parallel questions, a
retry racing the original, an agent's parallel tool calls). With a prefix-match unit below the KV
block, the follow-ups' hit ends inside a block, and vLLM gives each of them a private copy-on-write
block in the same scheduling step; vLLM 0.34.0 then chains the copies (``cow-chained-copy``,
docs/defect-family.md).

Every family ``i`` is four requests, a fresh random document each (so families share nothing):

* ``4i``: a *busy* request (``busy_tokens`` random tokens, ``busy_max_tokens`` output tokens) that keeps
  the engine stepping: two prompts sent at once to an idle engine often land in two steps (the first
  wakes the engine before the second arrives: 2 of 6 HTTP replays of one pair landed in one step,
  2026-12-05), while a running engine takes both at its next step;
* ``4i + 1``: the *parent*, the document's first ``parent_tokens`` tokens;
* ``4i + 2`` .. ``4i + 1 + siblings``: the *siblings*, the first ``sibling_tokens`` tokens of the same
  document each, sent together (the first carries ``burst: siblings``, kvrepro.spec.records.RequestEvents).

With ``load.concurrency: 2`` the busy request runs in one slot while the other sends the parent and,
once the parent has finished, the siblings. A pure function of (settings, seed, index).
"""

from __future__ import annotations

import random

from pydantic import Field, model_validator

from ...spec.records import RequestEvents
from . import Profile, ProfileSettings, Prompt


class SiblingBurstSettings(ProfileSettings):
    parent_tokens: int = Field(176, ge=1, description="the parent prompt: ends on a block boundary so that "
                               "the siblings' hit ends inside that block (after MTP's one-unit drop)")
    sibling_tokens: int = Field(240, ge=2, description="each sibling prompt (the parent's tokens and more)")
    siblings: int = Field(2, ge=2, le=16, description="siblings sent at once")
    busy_tokens: int = Field(32, ge=1)
    busy_max_tokens: int = Field(64, ge=1, description="output tokens of the busy request: how long it keeps "
                                 "the engine stepping")

    @model_validator(mode="after")
    def _longer(self) -> "SiblingBurstSettings":
        if self.sibling_tokens <= self.parent_tokens:
            raise ValueError("sibling_tokens must exceed parent_tokens (a sibling extends the parent)")
        return self


class SiblingBurst(Profile):
    name = "sibling-burst"
    Settings = SiblingBurstSettings
    affinity_field = "family"

    def prompt(self, index: int) -> Prompt:
        s = self.settings
        size = 2 + s.siblings
        family, role = divmod(index, size)
        vocab = self.load.vocab_size
        if role == 0:
            rng = random.Random(f"sibling-burst/busy/{self.seed}/{family}")
            return Prompt(index=index, tokens=tuple(rng.randrange(vocab) for _ in range(s.busy_tokens)),
                          max_tokens=s.busy_max_tokens, fields={"family": family, "role": "busy"})
        rng = random.Random(f"sibling-burst/document/{self.seed}/{family}")
        document = tuple(rng.randrange(vocab) for _ in range(s.sibling_tokens))
        if role == 1:
            return Prompt(index=index, tokens=document[:s.parent_tokens], max_tokens=self.load.max_tokens,
                          fields={"family": family, "role": "parent"})
        # the first sibling claims the others (the runner sends a burst together); the rest ride along
        events = RequestEvents(burst=s.siblings) if role == 2 else RequestEvents()
        return Prompt(index=index, tokens=document, max_tokens=self.load.max_tokens,
                      fields={"family": family, "role": "sibling"}, events=events)


PROFILE = SiblingBurst
