"""Conversations that grow turn by turn (chat and agent sessions), interleaved.

``conversations`` sessions are open at once; each request continues one of them (chosen at
random, seeded): its prompt is the whole conversation so far -- a system prompt shared by all
sessions of the run, every earlier user turn and a stand-in for every earlier reply -- plus a new
user turn. A session that would outgrow ``max_context_tokens`` or ``max_turns`` ends and a new one
takes its place. The replies are seeded stand-in tokens, not the engine's output: the profile
stays a pure function of (settings, seed, index) and the load does not depend on what the engine
answers (the reply part is then never a prefix-cache hit, as when a chat client re-renders the
reply differently).
"""

from __future__ import annotations

import random
import threading

from pydantic import Field, model_validator

from . import Profile, ProfileSettings, Prompt


class MultiTurnSettings(ProfileSettings):
    conversations: int | None = Field(None, ge=1, description="sessions open at once; default: sized by pressure")
    pressure: float = Field(2.0, gt=0, description="open sessions' mean context / GPU prefix cache")
    system_prompt_tokens: int = Field(64, ge=0)
    user_tokens: tuple[int, int] = Field((8, 64), description="tokens per user turn")
    reply_tokens: tuple[int, int] = Field((8, 48), description="tokens per stand-in reply")
    max_turns: int = Field(12, ge=1)
    max_context_tokens: int = Field(900, ge=16, description="a session ends before its prompt outgrows this")

    @model_validator(mode="after")
    def _ranges(self) -> "MultiTurnSettings":
        for name in ("user_tokens", "reply_tokens"):
            lo, hi = getattr(self, name)
            if lo < 1 or hi < lo:
                raise ValueError(f"{name} must be [low, high] with 1 <= low <= high")
        return self


class MultiTurn(Profile):
    name = "multi-turn"
    Settings = MultiTurnSettings
    affinity_field = "session"

    def __init__(self, load, seed, capacity=None):
        super().__init__(load, seed, capacity)
        s = self.settings
        rng = random.Random(f"multi-turn/system/{seed}")
        self.system = tuple(rng.randrange(load.vocab_size) for _ in range(s.system_prompt_tokens))
        if s.conversations is not None:
            self.open = s.conversations
        else:
            mean_turn = (sum(s.user_tokens) + sum(s.reply_tokens)) / 2
            mean_context = s.system_prompt_tokens + mean_turn * min(s.max_turns, 6) / 2
            self.open = max(2, round(s.pressure * self.capacity.gpu_tokens / max(1.0, mean_context)))
        self._lock = threading.Lock()
        self._plan: list[tuple[int, tuple[int, ...], int]] = []  # index -> (session id, prompt, turn)
        self._slots: list[tuple[int, tuple[int, ...], int]] = []  # open sessions: (id, context, turns)
        self._next_session = 0

    def _new_session(self) -> tuple[int, tuple[int, ...], int]:
        sid = self._next_session
        self._next_session += 1
        return sid, self.system, 0

    def _turn(self, rng: random.Random, lo_hi: tuple[int, int]) -> tuple[int, ...]:
        return tuple(rng.randrange(self.load.vocab_size) for _ in range(rng.randint(*lo_hi)))

    def _planned(self, index: int) -> tuple[int, tuple[int, ...], int]:
        s = self.settings
        with self._lock:
            while len(self._plan) <= index:
                i = len(self._plan)
                rng = random.Random(f"multi-turn/request/{self.seed}/{i}")
                if len(self._slots) < self.open:
                    self._slots.append(self._new_session())
                    slot = len(self._slots) - 1
                else:
                    slot = rng.randrange(len(self._slots))
                sid, context, turns = self._slots[slot]
                user = self._turn(rng, s.user_tokens)
                if turns >= s.max_turns or len(context) + len(user) + self.load.max_tokens > s.max_context_tokens:
                    sid, context, turns = self._new_session()
                prompt = context + user
                if not prompt:
                    prompt = (rng.randrange(self.load.vocab_size),)
                reply = self._turn(rng, s.reply_tokens)
                self._slots[slot] = (sid, prompt + reply, turns + 1)
                self._plan.append((sid, prompt, turns))
            return self._plan[index]

    def prompt(self, index: int) -> Prompt:
        sid, tokens, turn = self._planned(index)
        return Prompt(index=index, tokens=tokens, max_tokens=self.load.max_tokens,
                      fields={"session": sid, "turn": turn})


PROFILE = MultiTurn
