"""Prompts to token ids and token ids to text, without a tokenizer (the sim has none).

A text prompt is split on whitespace and each word maps to a stable id (blake2b of the word),
so two prompts that share leading words share leading tokens: prefix caching sees the same
sharing a real tokenizer would give. Token-id prompts pass through. Output text spells each
token as `` t<id>``.
"""

from __future__ import annotations

import hashlib


class PromptError(ValueError):
    """The request's prompt is unusable; the message says why (HTTP 400)."""


def word_token(word: str, vocab_size: int) -> int:
    digest = hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab_size


def prompt_to_token_ids(prompt, vocab_size: int) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI allows a batch of one
    if isinstance(prompt, str):
        ids = [word_token(w, vocab_size) for w in prompt.split()]
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise PromptError(f"token id {bad[0]} is out of vocabulary (0..{vocab_size - 1})")
        ids = list(prompt)
    else:
        raise PromptError("prompt must be a string or a list of token ids (one prompt per request)")
    if not ids:
        raise PromptError("the prompt is empty")
    return ids


def detokenize(token_ids: list[int]) -> str:
    return "".join(f" t{t}" for t in token_ids)
