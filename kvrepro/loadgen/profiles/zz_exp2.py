"""EXPERIMENT (not to commit): deep -> shallow -> deep-again, pipelined."""
from __future__ import annotations
import random
from . import Profile, ProfileSettings, Prompt

class S(ProfileSettings):
    share: float = 0.33         # family length / gpu tokens
    lag: int = 2                # pipeline depth: families in flight
    shallow: tuple[float, float] = (0.5, 0.95)   # share of the body
    suffix: tuple[int, int] = (1, 8)
    align_shallow: bool = True

class Exp(Profile):
    name = "zz-exp2"
    Settings = S
    def __init__(self, load, seed, capacity=None):
        super().__init__(load, seed, capacity)
        self.plan = []
        self.fams = {}
        self.step = 0
    def _fam(self, i):
        if i not in self.fams:
            rng = random.Random(f"exp2/{self.seed}/{i}")
            L = max(48, int(self.settings.share * self.capacity.gpu_tokens * rng.uniform(0.85, 1.15)))
            L = min(L, (self.capacity.max_model_len or 4096) - 40)
            L -= L % 16
            body = tuple(rng.randrange(self.load.vocab_size) for _ in range(L))
            b1 = int(L * rng.uniform(*self.settings.shallow)) // 16 * 16
            self.fams[i] = (body, b1)
        return self.fams[i]
    def _suffix(self, rng, room=None):
        lo, hi = self.settings.suffix
        n = rng.randint(lo, hi)
        if room is not None:
            n = min(n, room)
        return tuple(rng.randrange(self.load.vocab_size) for _ in range(n))
    def _emit_step(self):
        i = self.step; self.step += 1
        rng = random.Random(f"exp2/step/{self.seed}/{i}")
        B = self.capacity.block_tokens
        # phase 0: family i deep; phase 1: family i-1 shallow; phase 2: family i-lag deep again
        body, b1 = self._fam(i)
        self.plan.append(body)
        if i - 1 >= 0:
            body, b1 = self._fam(i - 1)
            self.plan.append(body[:b1])
        if i - self.settings.lag >= 0:
            body, b1 = self._fam(i - self.settings.lag)
            self.plan.append(body + self._suffix(rng))
    def prompt(self, index):
        while len(self.plan) <= index:
            self._emit_step()
        return Prompt(index=index, tokens=self.plan[index], max_tokens=self.load.max_tokens)

PROFILE = Exp
