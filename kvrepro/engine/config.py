"""The fake model's knobs: what a GPU node has no `vllm serve` flag for.

Everything else about the engine comes from vLLM's own argument parsing (``vllm serve`` builds
the ``VllmConfig``); the platform plugin (``platform``) changes only what a CPU-only process has
to. These knobs reach the engine process as ``KVREPRO_SIM_*`` environment variables, because
vLLM's command line has no place for them and the EngineCore process inherits the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class EngineSetupError(Exception):
    """The engine cannot start: a message for a person (a bad knob, an unsupported model)."""


@dataclass(frozen=True)
class SimKnobs:
    """What has no `vllm serve` flag: the fake model's behaviour (from KVREPRO_SIM_* env vars)."""

    acceptance_rate: float = 0.7
    seed: int = 0
    step_delay_ms: float = 0.0
    load_steps: int = 1  # an offload load job is reported finished this many engine steps after it was submitted

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "SimKnobs":
        env = os.environ if environ is None else environ

        def number(name: str, default, kind, lo, hi=None):
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise EngineSetupError(f"{name}={raw!r}: not a {kind.__name__}") from None
            if value < lo or (hi is not None and value > hi):
                bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
                raise EngineSetupError(f"{name}={raw!r}: must be {bound}")
            return value

        return cls(
            acceptance_rate=number("KVREPRO_SIM_ACCEPTANCE_RATE", 0.7, float, 0.0, 1.0),
            seed=number("KVREPRO_SIM_SEED", 0, int, 0),
            step_delay_ms=number("KVREPRO_SIM_STEP_DELAY_MS", 0.0, float, 0.0),
            load_steps=number("KVREPRO_SIM_LOAD_STEPS", 1, int, 1),
        )
