"""Requests that share prefixes of varying length: the first profile that reached the crash.

``documents`` random token sequences of ``document_tokens`` ids each are drawn once per run.
Request ``i`` takes a random document, a random-length prefix of it
(``min_prefix_tokens`` .. ``document_tokens``) and appends a random suffix (``suffix_tokens``
``[low, high]`` ids). Prefixes of one document shared at different lengths are what give a
request both a local prefix-cache hit (a shorter earlier prefix still on the GPU) and an offload
hit (a longer one stored to the CPU and evicted from the GPU) -- the crash's precondition.
Kept as it was so that older results stay comparable; ``partial-prefix`` supersedes it.

Token ids are drawn below ``vocab_size``; no tokenizer is involved, prompts go out as id lists.
"""

from __future__ import annotations

import random

from pydantic import Field, model_validator

from . import Profile, ProfileSettings, Prompt


class SharedPrefixSettings(ProfileSettings):
    documents: int = Field(6, ge=1)
    document_tokens: int = Field(400, ge=1)
    min_prefix_tokens: int = Field(1, ge=0)
    suffix_tokens: tuple[int, int] = (0, 39)

    @model_validator(mode="after")
    def _ranges(self) -> "SharedPrefixSettings":
        lo, hi = self.suffix_tokens
        if lo < 0 or hi < lo:
            raise ValueError("suffix_tokens must be [low, high] with 0 <= low <= high")
        if self.min_prefix_tokens > self.document_tokens:
            raise ValueError("min_prefix_tokens must not exceed document_tokens")
        return self


class SharedPrefix(Profile):
    name = "shared_prefix"
    Settings = SharedPrefixSettings

    def __init__(self, load, seed, capacity=None):
        super().__init__(load, seed, capacity)
        s = self.settings
        # string seeds: random.Random hashes them with sha512, stable across runs and platforms
        rng = random.Random(f"shared_prefix/documents/{seed}")
        self.documents = [
            tuple(rng.randrange(load.vocab_size) for _ in range(s.document_tokens))
            for _ in range(s.documents)
        ]

    def prompt(self, index: int) -> Prompt:
        s = self.settings
        rng = random.Random(f"shared_prefix/request/{self.seed}/{index}")
        doc = rng.randrange(len(self.documents))
        prefix = rng.randint(s.min_prefix_tokens, s.document_tokens)
        low, high = s.suffix_tokens
        suffix = rng.randint(low, high)
        if prefix + suffix == 0:
            suffix = 1  # an empty prompt is rejected by the server; one token keeps the request valid
        tokens = self.documents[doc][:prefix] + tuple(rng.randrange(self.load.vocab_size) for _ in range(suffix))
        return Prompt(index=index, tokens=tokens, max_tokens=self.load.max_tokens,
                      fields={"doc": doc, "prefix_tokens": prefix, "suffix_tokens": suffix})


PROFILE = SharedPrefix
