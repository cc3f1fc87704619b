"""How much a handful of repetitions proves.

Three crashes out of three against zero out of three is p = 0.05 (one-sided Fisher exact): the
report says so, so that nobody ships a fix on a 1-of-1 coincidence. Pairs of builds whose
patch stacks differ by exactly one patch measure that patch's effect in that context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# verdicts that say something about the code's crash rate: it crashed, or it served the budget
# with the trigger path exercised (CORRUPT and UNREACHED runs did not crash either)
COUNTED = ("CRASH", "CORRUPT", "SURVIVED", "UNREACHED")


@dataclass(frozen=True)
class Rate:
    crashes: int
    trials: int  # COUNTED runs; VACUOUS/INFRA/STALL prove nothing and are left out

    def wilson(self, z: float = 1.96) -> tuple[float, float]:
        """95% Wilson score interval of the crash probability."""
        if self.trials == 0:
            return (0.0, 1.0)
        n, p = self.trials, self.crashes / self.trials
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return (max(0.0, centre - half), min(1.0, centre + half))


def rate(runs: list[dict[str, Any]]) -> Rate:
    counted = [r for r in runs if r.get("verdict") in COUNTED]
    return Rate(crashes=sum(r["verdict"] == "CRASH" for r in counted), trials=len(counted))


def fisher_one_sided(a_crash: int, a_n: int, b_crash: int, b_n: int) -> float:
    """P(B crashes this rarely or less | same crash probability), hypergeometric tail."""
    total_crash, n = a_crash + b_crash, a_n + b_n
    if a_n == 0 or b_n == 0 or total_crash == 0:
        return 1.0
    denom = math.comb(n, total_crash)
    return sum(
        math.comb(b_n, k) * math.comb(a_n, total_crash - k)
        for k in range(0, b_crash + 1)
        if 0 <= total_crash - k <= a_n
    ) / denom


@dataclass(frozen=True)
class PatchEffect:
    patch: str
    without: str  # build without the patch
    with_: str  # build with it
    without_rate: Rate
    with_rate: Rate
    p_value: float  # that adding the patch lowered the crash rate by chance


def patch_effects(builds: dict[str, list[str]], runs: dict[str, list[dict[str, Any]]],
                  bases: dict[str, str] | None = None) -> list[PatchEffect]:
    """One entry per pair of builds on the same base whose stacks differ by one added patch."""
    effects = []
    bases = bases or {}
    for a, a_stack in builds.items():
        for b, b_stack in builds.items():
            if bases.get(a) != bases.get(b):
                continue
            extra = [p for p in b_stack if p not in a_stack]
            if len(b_stack) == len(a_stack) + 1 and len(extra) == 1 and all(p in b_stack for p in a_stack):
                ra, rb = rate(runs.get(a, [])), rate(runs.get(b, []))
                p = fisher_one_sided(ra.crashes, ra.trials, rb.crashes, rb.trials)
                effects.append(PatchEffect(extra[0], a, b, ra, rb, p))
    return effects
