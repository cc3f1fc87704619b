"""Offload-tier faults: which transfer jobs of the GPU-free data movement fail, and how long each takes.

Why: production offload tiers fail (a load that errors, a store that errors) and are slow in
bursts; vLLM has a path for a failed load (``kv_load_failure_policy``), and no kvrepro run
exercised it. The fake transfer worker (``executor.SimTransferWorker``) asks a :class:`FaultPlan`
for every job it is handed: fail it or not (at a rate, or at the k-th job of its kind, counted
from 1 in submission order) and after how many engine steps it finishes (a latency distribution
that generalises ``engine.sim.load_steps``). A failed job is logged on purpose, one line each::

    kvrepro-fault: load job 7 failed on purpose (load #2, request cmpl-kvrepro-3-..., policy recompute, 4 GPU blocks not filled: 12,13,14,15)
    kvrepro-fault: counts load_jobs=<N> load_faults=<F> store_jobs=<S> store_faults=<G> failed_requests=<R> policy=<P> load_steps_total=<L> store_steps_total=<T> pid=<P>

(``*_steps_total``: the steps the latency gave the jobs, summed: a run's mean latency per job)

so that kvrepro's classifier (kvrepro/classify/exposure.py) can tell an injected fault's
consequence (a request ended with an error under policy ``fail``) from a defect.

The settings arrive as JSON in ``KVREPRO_SIM_OFFLOAD_FAULTS`` (written by matrix.yaml's
``engine.sim.offload_faults``, checked there with file:line errors). Stdlib only, no vLLM import.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field

ENV = "KVREPRO_SIM_OFFLOAD_FAULTS"
TAG = "kvrepro-fault:"
DISTRIBUTIONS = ("fixed", "uniform", "geometric")
KINDS = ("load", "store")


class FaultSetupError(Exception):
    """The fault settings the engine was given cannot be used: a message for a person."""


@dataclass(frozen=True)
class Latency:
    """Engine steps a job takes. fixed: ``steps``; uniform: an integer in [steps, max_steps];
    geometric: 1 + a geometric count with mean ``steps`` (a slow tier's long tail), at most
    ``max_steps``. ``jobs``: which kind of job it applies to (the other keeps its default)."""

    distribution: str = "fixed"
    steps: int = 1
    max_steps: int | None = None
    jobs: str = "load"  # "load" | "store" | "both"

    def applies(self, kind: str) -> bool:
        return self.jobs in (kind, "both")

    def draw(self, rng: random.Random) -> int:
        if self.distribution == "uniform":
            return rng.randint(self.steps, self.max_steps or self.steps)
        if self.distribution == "geometric":
            # P(extra = k) = (1 - p)^k p with mean extra (steps - 1): inverse transform of one uniform
            extra_mean = self.steps - 1
            extra = 0
            if extra_mean > 0:
                p = 1.0 / (1.0 + extra_mean)
                extra = int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
            drawn = 1 + extra
            return min(drawn, self.max_steps) if self.max_steps else drawn
        return self.steps


@dataclass(frozen=True)
class FaultSettings:
    load_fail_rate: float = 0.0
    load_fail_at: tuple[int, ...] = ()
    store_fail_rate: float = 0.0
    store_fail_at: tuple[int, ...] = ()
    latency: Latency | None = None
    seed: int = 0
    policy: str = "fail"  # vLLM's kv_load_failure_policy the engine was started with (for the log lines)

    def fails_any(self, kind: str) -> bool:
        rate, at = (self.load_fail_rate, self.load_fail_at) if kind == "load" else (self.store_fail_rate,
                                                                                     self.store_fail_at)
        return rate > 0 or bool(at)

    @classmethod
    def from_env(cls, environ=None) -> "FaultSettings | None":
        env = os.environ if environ is None else environ
        raw = env.get(ENV, "").strip()
        if not raw:
            return None
        try:
            value = json.loads(raw)
            latency = value.pop("latency", None)
            settings = cls(**{k: (tuple(v) if k.endswith("_at") else v) for k, v in value.items()},
                           latency=Latency(**latency) if latency else None)
        except (ValueError, TypeError) as exc:
            raise FaultSetupError(f"{ENV}={raw[:200]!r}: {exc}") from None
        if settings.latency is not None and settings.latency.distribution not in DISTRIBUTIONS:
            raise FaultSetupError(f"{ENV}: latency.distribution {settings.latency.distribution!r}: "
                                  f"use one of {', '.join(DISTRIBUTIONS)}")
        return settings


@dataclass
class FaultPlan:
    """Decides, job by job in submission order, whether it fails and how many steps it takes.

    One seeded generator, drawn a fixed number of times per job, so a run with the same seed and
    the same jobs fails the same jobs."""

    settings: FaultSettings
    load_steps: int = 1
    jobs: dict[str, int] = field(default_factory=lambda: {"load": 0, "store": 0})
    faults: dict[str, int] = field(default_factory=lambda: {"load": 0, "store": 0})
    failed_requests: set = field(default_factory=set)
    steps: dict[str, int] = field(default_factory=lambda: {"load": 0, "store": 0})  # steps drawn, summed

    def __post_init__(self) -> None:
        self.rng = random.Random(self.settings.seed)

    def decide(self, kind: str) -> tuple[bool, int]:
        """(fail this job?, its steps) for the next job of ``kind``."""
        s = self.settings
        self.jobs[kind] += 1
        rate, at = (s.load_fail_rate, s.load_fail_at) if kind == "load" else (s.store_fail_rate, s.store_fail_at)
        draw = self.rng.random()
        fail = self.jobs[kind] in at or draw < rate
        default = self.load_steps if kind == "load" else 1
        steps = s.latency.draw(self.rng) if s.latency is not None and s.latency.applies(kind) else default
        steps = max(1, steps)
        self.steps[kind] += steps
        if fail:
            self.faults[kind] += 1
        return fail, steps

    def fault_line(self, kind: str, job_id, request: str | None, gpu_blocks: list[int]) -> str:
        whose = f"request {request}, " if request else ""
        what = "GPU blocks not filled" if kind == "load" else "GPU blocks not stored"
        shown = ",".join(str(b) for b in gpu_blocks[:32]) + (",..." if len(gpu_blocks) > 32 else "")
        policy = f"policy {self.settings.policy}, " if kind == "load" else ""
        return (f"{TAG} {kind} job {job_id} failed on purpose ({kind} #{self.jobs[kind]}, {whose}{policy}"
                f"{len(gpu_blocks)} {what}: {shown or '-'})")

    def counts_line(self) -> str:
        return (f"{TAG} counts load_jobs={self.jobs['load']} load_faults={self.faults['load']} "
                f"store_jobs={self.jobs['store']} store_faults={self.faults['store']} "
                f"failed_requests={len(self.failed_requests)} policy={self.settings.policy} "
                f"load_steps_total={self.steps['load']} store_steps_total={self.steps['store']} pid={os.getpid()}")
