"""Requests that share prefixes of varying length -- the traffic that reaches the crash.

``documents`` random token sequences of ``document_tokens`` ids each are drawn once per run.
Request ``i`` takes a random document, a random-length prefix of it
(``min_prefix_tokens`` .. ``document_tokens``) and appends a random suffix (``suffix_tokens``
``[low, high]`` ids). Prefixes of one document shared at different lengths are what give a
request both a local prefix-cache hit (a shorter earlier prefix still on the GPU) and an offload
hit (a longer one stored to the CPU and evicted from the GPU) -- the crash's precondition.

Token ids are drawn below ``vocab_size``; no tokenizer is involved, prompts go out as id lists.
"""

from __future__ import annotations

import random

from ...spec import LoadSpec
from . import Profile, Prompt


class SharedPrefix(Profile):
    name = "shared_prefix"

    def __init__(self, load: LoadSpec, seed: int):
        super().__init__(load, seed)
        # string seeds: random.Random hashes them with sha512, stable across runs and platforms
        rng = random.Random(f"shared_prefix/documents/{seed}")
        self.documents = [
            tuple(rng.randrange(load.vocab_size) for _ in range(load.document_tokens))
            for _ in range(load.documents)
        ]

    def prompt(self, index: int) -> Prompt:
        load = self.load
        rng = random.Random(f"shared_prefix/request/{self.seed}/{index}")
        doc = rng.randrange(len(self.documents))
        prefix = rng.randint(load.min_prefix_tokens, load.document_tokens)
        low, high = load.suffix_tokens
        suffix = rng.randint(low, high)
        if prefix + suffix == 0:
            suffix = 1  # an empty prompt is rejected by the server; one token keeps the request valid
        tokens = self.documents[doc][:prefix] + tuple(rng.randrange(load.vocab_size) for _ in range(suffix))
        return Prompt(index=index, tokens=tokens, max_tokens=load.max_tokens,
                      fields={"doc": doc, "prefix_tokens": prefix, "suffix_tokens": suffix})


PROFILE = SharedPrefix
