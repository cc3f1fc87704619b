"""matrix.yaml: the experiment, validated.

A matrix names one vLLM base, a table of patches, the builds (ordered patch stacks), the engine
arguments every build is served with, the load and the run budget. Errors name ``file:line``,
the field and what is allowed, because a person fixes them by hand in an editor.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from .. import paths
from ..errors import SpecError
from ..records import BuildPlan, PatchRef, RequestEvents, cell_name
from ..versions import (API_SERVER_COUNT_FLAG, DEFAULT_BASE, FAILED_RECVING_FROM, OFFLOAD_CHUNK_EXTRA_KEY,
                        OUT_OF_TREE_CONNECTORS, PREFIX_MATCH_UNIT_FLAG, block_size_problem, divergent_hits_flag_problem,
                        offload_fault_problem, prefix_match_unit_problem, reports_failed_loads, unsupported)
from .yamltext import DuplicateKey, StrictLoader, TooBig, line_for, line_index

EXPECTABLE = ("CRASH(target)", "CRASH(other)", "CORRUPT", "SURVIVED", "UNREACHED", "VACUOUS", "STALL", "INFRA")
SHIPPED_MODELS = Path(__file__).resolve().parent.parent / "data" / "models"
_VERSION_RE = re.compile(r"^\d+\.\d+(\.\d+)?([.+-]?[A-Za-z0-9.]+)?$")
# names of builds, patches and hosts become folder names, container names and CI class names
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
NAME_RULE = "1-64 letters, digits, '_', '.', '-', starting with a letter or digit"

# Limits (README / docs/reliability.md "Limits"): what a matrix may ask for, checked by `validate`
# before anything is built, so that a typo (an extra three zeros) costs a line, not the host.
MAX_REPETITIONS = 1000
MAX_REQUESTS = 1_000_000
MAX_DURATION_S = 86_400.0  # a day per run
MAX_TIMEOUT_S = 3_600.0
MAX_PATCHES = 256
MAX_BUILDS = 256
MAX_STACK = 64  # patches in one build's stack (common: included)
MAX_BASES = 16
MAX_EXTRA_ARGS = 256
MAX_HOSTS = 64
MAX_MATRIX_BYTES = 1 << 20
# KV geometry: production hybrid models run attention blocks of a few thousand tokens (2,128 for
# Qwen3.5 with Mamba `align`); these bounds refuse what no deployment has (a block of 2^40 tokens)
MAX_BLOCK_SIZE = 1 << 16
MAX_OFFLOAD_CHUNK_TOKENS = 1 << 20


_NAMED_CORRUPT = re.compile(r"^CORRUPT\((?P<names>[^()]*)\)$")
_DEFECT_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")


def expected_labels(expect: str) -> tuple[str, ...]:
    """An ``expect:`` value as the verdicts it accepts: ``SURVIVED|UNREACHED`` is either; a
    ``CORRUPT(defect, ...)`` alternative is the verdict CORRUPT (see :func:`expected_defects`)."""
    return tuple(_NAMED_CORRUPT.sub("CORRUPT", part.strip()) for part in expect.split("|") if part.strip())


def expected_defects(alternative: str) -> tuple[str, ...]:
    """The corruption defects a ``CORRUPT(a, b)`` alternative requires (each must be among the
    run's); () for any other alternative."""
    m = _NAMED_CORRUPT.match(alternative.strip())
    return tuple(n.strip() for n in m["names"].split(",") if n.strip()) if m else ()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PatchSpec(_Strict):
    file: str = Field(description="patch file, relative to the builds/ folder")
    upstream: str = Field(description="the upstream PR or commit this patch stands for")
    sha256: str | None = Field(default=None, description="sha256 of the patch file; checked when given")
    reverse: bool = Field(False, description="apply the file with `patch --reverse`: the build reverts the "
                          "upstream change it holds (recorded as such in the build manifest)")
    outside_matrix_folder: bool = Field(
        False, description="opt-in: `file` may lie outside the folder that holds matrix.yaml (it is read and "
                           "hashed, and its sha256 recorded in results)")

    @field_validator("file")
    @classmethod
    def _file(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("is empty; give the patch file's path relative to the builds/ folder, "
                             "e.g. pr-52771.patch")
        return v

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-f]{64}", v):
            raise ValueError("must be 64 lowercase hex digits (the output of `sha256sum FILE`)")
        if v is not None and set(v) == {"0"}:
            raise ValueError("all zeros is a placeholder, not a sha256; put the output of `sha256sum FILE` "
                             "or leave sha256 out")
        return v


class TargetSignature(_Strict):
    """The crash the matrix is about; matched against the classifier's signature."""

    exception: str = "AssertionError"
    function: str = "update_state_after_alloc"
    file: str = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
    expression: str | None = Field(
        None,
        description="optional: text the failing statement must contain (whitespace-insensitive), to tell "
                    "one assert in the function from another",
    )


class LatencySpec(_Strict):
    """How many engine steps an offload job takes (``engine.sim.offload_faults.latency``): a
    distribution that generalises ``engine.sim.load_steps`` (docs/faults.md)."""

    distribution: Literal["fixed", "uniform", "geometric"] = Field(
        "fixed", description="fixed: `steps`; uniform: an integer in [steps, max_steps]; geometric: 1 + a "
                             "geometric count with mean `steps` (a slow tier's long tail), at most max_steps")
    steps: int = Field(1, ge=1, le=10_000)
    max_steps: int | None = Field(None, ge=1, le=10_000)
    jobs: Literal["load", "store", "both"] = Field("load", description="which jobs take this latency")

    @model_validator(mode="after")
    def _bounds(self) -> "LatencySpec":
        if self.distribution == "uniform" and self.max_steps is None:
            raise FieldError("engine.sim.offload_faults.latency.max_steps", "uniform needs max_steps (the largest number of steps)")
        if self.max_steps is not None and self.max_steps < self.steps:
            raise FieldError("engine.sim.offload_faults.latency.max_steps", f"{self.max_steps} is below steps ({self.steps})")
        if self.distribution == "fixed" and self.max_steps is not None:
            raise FieldError("engine.sim.offload_faults.latency.max_steps", "fixed takes `steps` only; use uniform or geometric for a range")
        return self


class OffloadFaultsSpec(_Strict):
    """Offload-tier faults the GPU-free data movement injects (``engine.sim.offload_faults``): per
    job, a failure at a rate or at the k-th job of its kind (counted from 1), and a latency. A
    failed job is reported as a failed copy (``TransferResult(success=False)``) and does what the
    release's connector (``engine.connector``) does with one: the OffloadingConnector asserts before
    0.34.0; connectors with a failure report hand the failed load to vLLM's scheduler, which applies
    ``engine.kv_load_failure_policy``. Each injected fault is one ``kvrepro-fault:`` line in the
    engine log. Which connector and release produce which fault: kvrepro/versions.py (docs/faults.md)."""

    load_fail_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of load jobs that fail")
    load_fail_at: list[int] = Field(default_factory=list, max_length=1024,
                                    description="the k-th load jobs (from 1) that fail")
    store_fail_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of store jobs that fail")
    store_fail_at: list[int] = Field(default_factory=list, max_length=1024,
                                     description="the k-th store jobs (from 1) that fail")
    latency: LatencySpec | None = None
    seed: int = Field(0, ge=0, description="the fault draws' seed (each repetition adds its number)")

    @field_validator("load_fail_at", "store_fail_at")
    @classmethod
    def _ordinals(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):
            raise ValueError("job numbers count from 1 (the first job of its kind is 1)")
        if len(set(v)) != len(v):
            raise ValueError("a job number is listed twice")
        return v

    def fails(self, kind: str) -> bool:
        return bool(getattr(self, f"{kind}_fail_rate") or getattr(self, f"{kind}_fail_at"))

    def engine_json(self, rep: int) -> str:
        """What the engine reads back (kvrepro.engine.faults.FaultSettings.from_env)."""
        return json.dumps({"load_fail_rate": self.load_fail_rate, "load_fail_at": self.load_fail_at,
                           "store_fail_rate": self.store_fail_rate, "store_fail_at": self.store_fail_at,
                           "latency": self.latency.model_dump() if self.latency is not None else None,
                           "seed": self.seed + rep}, sort_keys=True)


class SimSettings(_Strict):
    """Knobs of the GPU-free engine that have no `vllm serve` flag."""

    num_gpu_blocks: int = Field(96, ge=4, description="GPU KV blocks in the simulated pool (--num-gpu-blocks-override)")
    draft_acceptance_rate: float = Field(0.7, ge=0.0, le=1.0)
    seed: int = 0
    step_delay_ms: float = Field(0.0, ge=0.0, description="sleep per engine step, to mimic GPU time")
    load_steps: int = Field(1, ge=1, description="engine steps an offload load job takes: it is reported "
                            "finished by the worker's get_finished() this many steps after it was submitted "
                            "(stores always take one step)")
    offload_faults: OffloadFaultsSpec | None = Field(
        None, description="injected offload-tier faults and latency (docs/faults.md)")

    @model_validator(mode="after")
    def _one_load_latency(self) -> "SimSettings":
        latency = self.offload_faults.latency if self.offload_faults is not None else None
        if latency is not None and latency.jobs != "store" and self.load_steps != 1:
            raise FieldError("engine.sim.offload_faults.latency", f"load_steps is {self.load_steps} and "
                              "latency applies to loads too: give a load's steps in one place (latency: "
                              "{distribution: fixed, steps: N} is load_steps: N)")
        return self

    def engine_env(self, rep: int) -> dict[str, str]:
        """The engine's environment for these knobs in repetition ``rep`` (each repetition its own
        seed); every target that runs the GPU-free engine passes exactly this, and
        ``kvrepro.engine.config.SimKnobs.from_env`` reads it back."""
        return {"KVREPRO_SIM_ACCEPTANCE_RATE": repr(self.draft_acceptance_rate),
                "KVREPRO_SIM_SEED": str(self.seed + rep),
                "KVREPRO_SIM_STEP_DELAY_MS": repr(self.step_delay_ms),
                "KVREPRO_SIM_LOAD_STEPS": str(self.load_steps),
                # vLLM's dev API: POST /reset_prefix_cache, which load.events' reset_prefix_cache sends
                "VLLM_SERVER_DEV_MODE": "1",
                **({"KVREPRO_SIM_OFFLOAD_FAULTS": self.offload_faults.engine_json(rep)}
                   if self.offload_faults is not None else {})}


class GeometrySpec(_Strict):
    """The KV geometry of the engine, as production had it (``engine.geometry``).

    kvrepro writes the model's config.json from ``engine.model``'s (``layer_types`` with as many
    linear- and full-attention layers as make vLLM form these KV-cache groups; see
    kvrepro/geometry.py) and adds the `vllm serve` flags: ``--block-size``, the offload chunk
    (``--kv-transfer-config`` extra config), the MTP tokens and ``--data-parallel-size``.
    """

    block_size: int | None = Field(None, ge=1, le=MAX_BLOCK_SIZE, description="GPU KV block in tokens "
                                   "(--block-size); default: engine.block_size")
    offload_chunk_tokens: int | None = Field(
        None, ge=1, le=MAX_OFFLOAD_CHUNK_TOKENS,
        description="the OffloadingConnector's offload chunk in tokens, a multiple of block_size; default: one block")
    mamba_groups: int = Field(2, ge=0, le=64, description="KV-cache groups of Gated-DeltaNet (Mamba `align`) layers")
    full_attention_groups: int = Field(1, ge=1, le=64, description="KV-cache groups of full-attention layers "
                                       "(the MTP draft layer joins them)")
    num_speculative_tokens: int | None = Field(None, ge=0, le=8, description="MTP draft tokens per step; "
                                               "default: engine.num_speculative_tokens")
    data_parallel_size: int = Field(1, ge=1, le=16, description="EngineCores (DP ranks) behind one API "
                                    "(--data-parallel-size); every rank is a GPU-free engine with its own pool")
    hash_block_size: int | None = Field(
        None, ge=1, description="the prefix-match unit in tokens (vLLM's hash_block_size, `--prefix-match-unit`, "
                                "vLLM 0.26.0+): a prefix-cache hit may end every this many tokens, inside a KV "
                                "block; the block size must be a multiple of it. Default: one block")

    @model_validator(mode="after")
    def _groups(self) -> "GeometrySpec":
        # vLLM groups each kind of layer in groups of the smaller kind's layer count (see
        # versions.hybrid_kv_groups): the smaller kind always forms exactly one group
        if self.mamba_groups == 0 and self.full_attention_groups != 1:
            raise FieldError("engine.geometry.full_attention_groups",
                              "an attention-only model (mamba_groups: 0) has one KV-cache group; use 1")
        if self.mamba_groups > 1 and self.full_attention_groups > 1:
            raise FieldError("engine.geometry.full_attention_groups",
                              f"{self.full_attention_groups} with mamba_groups {self.mamba_groups}: vLLM groups "
                              "layers in groups of the smaller kind's layer count, so one kind forms exactly one "
                              "group; set mamba_groups or full_attention_groups to 1")
        return self


# `vllm serve` flags that engine.geometry writes; giving them in extra_args as well is an error
GEOMETRY_FLAGS = ("--data-parallel-size", "-dp", "--kv-transfer-config", "--block-size", "--prefix-match-unit")


class EngineSpec(_Strict):
    """How every build is served. Turned into `vllm serve` arguments for every target."""

    model: str = Field(
        "qwen3-next-tiny",
        description="a model directory with config.json, or the name of a config shipped in kvrepro/data/models",
    )
    served_model_name: str | None = None
    block_size: int = Field(16, ge=1, le=MAX_BLOCK_SIZE)
    enable_prefix_caching: bool = True
    mamba_cache_mode: Literal["align", "all", "none"] = "align"
    speculative_method: Literal["mtp", "eagle", "eagle3", "none"] = "mtp"
    num_speculative_tokens: int = Field(1, ge=0)
    kv_offloading_size_gib: float = Field(1.0, gt=0, description="--kv-offloading-size (GiB of host memory)")
    kv_offloading_backend: Literal["native"] = "native"
    connector: Literal["offloading", "capable", "mooncake-store-like", "nixl-like"] = Field(
        "offloading", description="offloading: vLLM's OffloadingConnector (--kv-offloading-size); capable: the same "
        "connector declaring supports_divergent_local_hybrid_hits (kvrepro/engine/capable.py, test-only; vLLM "
        "0.28.0+ or a stack with pr-50344); mooncake-store-like / nixl-like: the same connector reporting a failed "
        "offload load as Mooncake store / NIXL do, with their retry (kvrepro/engine/load_failures.py; vLLM 0.30.0+; "
        "docs/faults.md)")
    max_num_seqs: int = Field(4, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    max_model_len: int = Field(1024, ge=64)
    extra_args: list[str] = Field(default_factory=list, max_length=MAX_EXTRA_ARGS,
                                  description="passed verbatim to `vllm serve`")
    geometry: GeometrySpec | None = Field(
        None, description="KV geometry (block, offload chunk, KV groups, MTP tokens, DP ranks); when given, "
                          "kvrepro generates the model config.json from engine.model's")
    sim: SimSettings = Field(default_factory=SimSettings)
    kv_load_failure_policy: Literal["fail", "recompute"] | None = Field(
        None, description="vLLM's KVTransferConfig.kv_load_failure_policy (what a failed offload load does: fail "
                          "the request, or recompute its KV); default: vLLM's own (fail)")
    async_scheduling: Literal["auto", "on", "off"] = Field(
        "auto", description="vLLM's asynchronous scheduling: auto = what vLLM decides for the release and this "
                            "engine on a GPU (on with MTP in every supported release; the GPU-free engine keeps "
                            "that decision, docs/engine.md), on = --async-scheduling, off = --no-async-scheduling")

    @model_validator(mode="before")
    @classmethod
    def _geometry_values(cls, data: Any) -> Any:
        """engine.geometry's block_size and num_speculative_tokens are the engine's: one value, one place."""
        if not isinstance(data, dict) or not isinstance(data.get("geometry"), dict):
            return data
        data = dict(data)
        for name in ("block_size", "num_speculative_tokens"):
            value = data["geometry"].get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (name == "block_size"):
                continue  # absent, or wrong: GeometrySpec names it (once)
            if name in data and data[name] != value:
                raise FieldError(f"engine.geometry.{name}", f"{value!r}, but engine.{name} says {data[name]!r}; "
                                  f"give it in one place (engine.geometry wins when engine.{name} is left out)")
            data[name] = value
        return data

    @model_validator(mode="after")
    def _geometry_checks(self) -> "EngineSpec":
        g = self.geometry
        if g is None:
            return self
        problem = block_size_problem(self.block_size, self.mamba_cache_mode, self.max_num_batched_tokens)
        if problem:
            field, msg = problem
            raise FieldError("engine.geometry.block_size" if field == "block_size" else f"engine.{field}", msg)
        chunk = self.offload_chunk_tokens
        if chunk % self.block_size:
            raise FieldError("engine.geometry.offload_chunk_tokens",
                              f"{chunk} is not a multiple of the block size {self.block_size}; vLLM's offloading "
                              f"connector moves whole blocks (e.g. {self.block_size * max(1, round(chunk / self.block_size))})")
        if self.num_speculative_tokens > 0 and self.speculative_method != "mtp":
            raise FieldError("engine.speculative_method", f"{self.speculative_method!r}: engine.geometry builds "
                              "MTP models only; use mtp, or num_speculative_tokens: 0")
        unit = g.hash_block_size
        if unit is not None and self.block_size % unit:
            raise FieldError("engine.geometry.hash_block_size",
                              f"{unit} does not divide the block size {self.block_size}; vLLM merges hashes of "
                              f"{unit}-token units into blocks, so use a divisor such as {self.block_size // 2}")
        for i, arg in enumerate(self.extra_args):
            if arg.split("=", 1)[0] in GEOMETRY_FLAGS:
                raise FieldError(f"engine.extra_args.{i}", f"{arg.split('=', 1)[0]} is set by engine.geometry; "
                                  "remove it here and say it there")
        return self

    @field_validator("async_scheduling", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare on/off as a boolean
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _async_in_one_place(self) -> "EngineSpec":
        for i, arg in enumerate(self.extra_args):
            if self.async_scheduling != "auto" and arg.split("=", 1)[0] in ("--async-scheduling", "--no-async-scheduling"):
                raise FieldError(f"engine.extra_args.{i}", f"{arg} and engine.async_scheduling: {self.async_scheduling} "
                                  "both set asynchronous scheduling; say it in engine.async_scheduling only")
        return self

    @model_validator(mode="after")
    def _fs_tiers_readable(self) -> "EngineSpec":
        # each run's engine gets its fs tiers in folders of its own (kvrepro/spec/fs_tier.py): a
        # --kv-transfer-config kvrepro cannot read as JSON is refused here, not at the engine's start
        from .fs_tier import FsTierError, fs_tiers

        try:
            fs_tiers(self.extra_args)
        except FsTierError as exc:
            raise FieldError(f"engine.extra_args.{exc.arg}", str(exc)) from None
        return self

    def fs_tiers(self) -> list[Any]:
        """The ``fs`` secondary offload tiers engine.extra_args configure (kvrepro.spec.fs_tier.FsTier)."""
        from .fs_tier import fs_tiers

        return list(fs_tiers(self.extra_args))

    @property
    def offload_chunk_tokens(self) -> int:
        """The offload chunk in tokens: engine.geometry's, else one block (vLLM's default)."""
        if self.geometry is not None and self.geometry.offload_chunk_tokens:
            return self.geometry.offload_chunk_tokens
        return self.block_size

    @property
    def data_parallel_size(self) -> int:
        return self.geometry.data_parallel_size if self.geometry is not None else 1

    def serve_args(self, model_path: str, include_sim: bool, fs_tier_root: str | None = None) -> list[str]:
        """The `vllm serve` argument list (model first). The sim engine parses the same list.

        ``fs_tier_root``: the run's folder as the engine sees it; every ``fs`` offload tier's
        root_dir then points to a folder of that run (kvrepro/spec/fs_tier.py). None: as the matrix
        wrote it (what a manifest records next to the mapping, and `kvrepro engine serve` runs)."""
        # an out-of-tree connector is named in --kv-transfer-config: --kv-offloading-size would make vLLM
        # name the OffloadingConnector over it (VllmConfig._post_init_kv_transfer_config)
        offloading = [] if self.connector != "offloading" else [
            "--kv-offloading-size", repr(self.kv_offloading_size_gib),
            "--kv-offloading-backend", self.kv_offloading_backend]
        args = [
            model_path,
            "--block-size", str(self.block_size),
            "--mamba-cache-mode", self.mamba_cache_mode,
            *offloading,
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-model-len", str(self.max_model_len),
            "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching",
        ]
        # a shipped config is served under its short name, not the folder it was copied to
        served = self.served_model_name or (self.model if "/" not in self.model else None)
        if served:
            args += ["--served-model-name", served]
        if self.speculative_method != "none" and self.num_speculative_tokens > 0:
            args += [
                "--speculative-config",
                json.dumps({"method": self.speculative_method,
                            "num_speculative_tokens": self.num_speculative_tokens}),
            ]
        transfer: dict[str, Any] = {}
        if self.connector != "offloading":
            # what --kv-offloading-size N would set, with the subclass named instead
            name, module = OUT_OF_TREE_CONNECTORS[self.connector]
            transfer = {"kv_connector": name, "kv_connector_module_path": module, "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": int(self.kv_offloading_size_gib * (1 << 30))}}
        if self.geometry is not None:
            # merged by vLLM with what --kv-offloading-size sets (the connector, cpu_bytes_to_use)
            transfer.setdefault("kv_connector_extra_config", {})[OFFLOAD_CHUNK_EXTRA_KEY] = self.offload_chunk_tokens
        if self.kv_load_failure_policy is not None:
            transfer["kv_load_failure_policy"] = self.kv_load_failure_policy
        if transfer:
            args += ["--kv-transfer-config", json.dumps(transfer)]
        if self.geometry is not None:
            if self.geometry.data_parallel_size > 1:
                args += ["--data-parallel-size", str(self.geometry.data_parallel_size)]
                if not any(a.split("=")[0] == API_SERVER_COUNT_FLAG for a in self.extra_args):
                    args += [API_SERVER_COUNT_FLAG, "1"]  # one API server for every rank (versions.py says why)
            if self.geometry.hash_block_size is not None:
                args += [PREFIX_MATCH_UNIT_FLAG, str(self.geometry.hash_block_size)]
        if self.async_scheduling != "auto":
            args += ["--async-scheduling" if self.async_scheduling == "on" else "--no-async-scheduling"]
        if include_sim:
            args += ["--num-gpu-blocks-override", str(self.sim.num_gpu_blocks)]
        if fs_tier_root is not None:
            from .fs_tier import redirected

            return args + redirected(self.extra_args, fs_tier_root)
        return args + list(self.extra_args)


class LoadEventSpec(_Strict):
    """One entry of ``load.events``: something the load does at request ``at`` (and, with ``every``,
    at ``at + every``, ``at + 2*every``, ...). Exactly one action per entry; docs/load.md lists them.

    Per request: ``abort`` (``queued``: sent while the request before it is in flight and dropped
    ``abort_after_s`` later; ``first_token``; ``tokens`` with ``after_tokens``), ``priority`` (vLLM's
    ``priority`` field: lower runs first; the engine gets ``--scheduling-policy priority``). Before
    the request (a phase boundary): ``pause_s``, ``reset_prefix_cache`` (``local``: the GPU prefix
    cache; ``external``: the offload tier's too, where the release supports it).
    """

    at: int = Field(ge=0, description="request index (0-based) the event applies to")
    every: int | None = Field(None, ge=1, description="repeat every this many requests after `at`")
    abort: Literal["queued", "first_token", "tokens"] | None = None
    after_tokens: int | None = Field(None, ge=1, description="abort: tokens: streamed tokens before the abort")
    abort_after_s: float = Field(0.1, gt=0, le=60, description="abort: queued: how long the client waits")
    priority: int | None = Field(None, ge=-1_000_000, le=1_000_000)
    pause_s: float | None = Field(None, gt=0, le=3600)
    reset_prefix_cache: Literal["local", "external"] | None = None
    burst: int | None = Field(None, ge=2, le=64, description="requests at..at+burst-1 send the prompts of "
                              "replay_from..replay_from+burst-1 again, all at once")
    replay_from: int | None = Field(None, ge=0, description="burst: the first earlier request it sends again")

    @model_validator(mode="after")
    def _one_action(self) -> "LoadEventSpec":
        actions = [n for n in ("abort", "priority", "pause_s", "reset_prefix_cache", "burst")
                   if getattr(self, n) is not None]
        if len(actions) != 1:
            raise ValueError("an event needs exactly one of abort, priority, pause_s, reset_prefix_cache, burst "
                             f"(found {', '.join(actions) or 'none'}); give two events for two actions")
        if (self.burst is None) != (self.replay_from is None):
            raise ValueError("burst needs replay_from (and replay_from is only for burst)")
        if self.burst is not None and self.replay_from is not None and self.replay_from + self.burst > self.at:
            raise ValueError(f"burst replays requests {self.replay_from}..{self.replay_from + self.burst - 1}: "
                             f"they must all come before request {self.at}")
        if self.burst is not None and self.every is not None and self.every < self.burst:
            raise ValueError(f"every {self.every} is shorter than the burst ({self.burst}): bursts would overlap")
        if (self.abort == "tokens") != (self.after_tokens is not None):
            raise ValueError("abort: tokens needs after_tokens (and after_tokens is only for abort: tokens)")
        if self.abort == "queued" and self.at == 0 and self.every is None:
            raise ValueError("abort: queued rides along with the request before it; it cannot be request 0")
        return self

    def applies(self, index: int) -> bool:
        if index < self.at:
            return False
        return index == self.at if self.every is None else (index - self.at) % self.every == 0

    def burst_offset(self, index: int) -> int | None:
        """Where request ``index`` sits in one of this event's bursts (0 = the first), else None."""
        if self.burst is None or index < self.at:
            return None
        start = index - (index - self.at) % self.every if self.every is not None else self.at
        offset = index - start
        return offset if offset < self.burst else None

    def events(self) -> RequestEvents:
        return RequestEvents(
            abort=self.abort, abort_after_tokens=self.after_tokens if self.abort == "tokens" else
            (1 if self.abort == "first_token" else None),
            abort_after_s=self.abort_after_s if self.abort == "queued" else None,
            priority=self.priority, pause_s=self.pause_s, reset_prefix_cache=self.reset_prefix_cache)


class LoadSpec(_Strict):
    """The traffic: which profile makes the prompts, how they arrive, how they are sent.

    Fields not listed here belong to the profile (``load.profile``) and are validated by its
    ``Settings`` (kvrepro/loadgen/profiles/<profile>.py), with the same file:line errors.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    profile: str = Field("partial-prefix", description="a file in kvrepro/loadgen/profiles/ (by its name)")
    concurrency: int = Field(4, ge=1, le=1024, description="closed loop: requests in flight at once; "
                             "poisson: the most in flight. 1 = sequential, deterministic on the sim engine")
    arrival: Literal["closed", "poisson"] = Field(
        "closed", description="closed: a new request as soon as one finishes; poisson: at rate_rps on average")
    rate_rps: float | None = Field(None, gt=0, description="poisson arrival: mean requests per second")
    max_tokens: int = Field(8, ge=1)
    vocab_size: int = Field(1000, ge=2)
    prompt_format: Literal["tokens", "text"] = Field(
        "tokens", description="tokens: prompts as token-id lists; text: words (for engines with a tokenizer)")
    stream: bool = Field(False, description="ask for server-sent events, as chat clients do")
    gpu_kv_tokens: int | None = Field(None, ge=16, description="GPU prefix-cache size in tokens; "
                                      "default: read from the engine's log (`GPU KV cache size: N tokens`)")
    offload_kv_tokens: int | None = Field(None, ge=16, description="offload tier size in tokens; default: unbounded")
    chunk_tokens: int | None = Field(None, ge=1, description="offload chunk in tokens; default: what the engine "
                                      "log says (GPU-free engine), else engine.geometry's, else the block size")
    dp_routing: Literal["engine", "affinity"] = Field(
        "engine", description="with data-parallel ranks: engine = vLLM's own load balancer picks the rank; "
        "affinity = all requests of a family (session) go to one rank (X-data-parallel-rank), "
        "as a prefix-aware router sends them")
    seed: int = 0
    events: list[LoadEventSpec] = Field(default_factory=list, max_length=1024, description="aborts, priorities, "
                                        "prefix-cache resets and pauses at given requests (docs/load.md)")

    def events_for(self, index: int) -> RequestEvents:
        """Every event of ``events`` that applies to request ``index``, merged (later entries win)."""
        merged = RequestEvents()
        for event in self.events:
            offset = event.burst_offset(index)
            if offset is not None:
                start = index - offset
                replay = event.replay_from + offset + (start - event.at)  # with every: the same distance back
                merged = merged.merged(RequestEvents(burst=event.burst if offset == 0 else None, replay_of=replay))
            elif event.burst is None and event.applies(index):
                merged = merged.merged(event.events())
        # a queued abort on request 1 with every: 1 from 0 has nothing to ride along with
        if index == 0 and merged.abort == "queued":
            merged = RequestEvents(**{**merged.to_json(), "abort": None, "abort_after_s": None})
        return merged

    def has_priorities(self) -> bool:
        return any(e.priority is not None for e in self.events)

    @model_validator(mode="after")
    def _profile_settings(self, info: ValidationInfo) -> "LoadSpec":
        if self.arrival == "poisson" and self.rate_rps is None:
            raise FieldError("load.arrival", "poisson needs rate_rps (mean requests per second) in load:")
        # The profile's own fields are checked by the load generator's stage, handed in by whoever
        # loads the matrix (kvrepro.matrix.load_matrix): spec/ imports no later stage.
        check = (info.context or {}).get(LOAD_SETTINGS_CHECK)
        if check is not None:
            check(self)
        return self


class RunsSpec(_Strict):
    repetitions: int = Field(3, ge=1, le=MAX_REPETITIONS)
    requests: int | None = Field(600, ge=1, le=MAX_REQUESTS, description="request budget per run")
    duration_s: float | None = Field(120.0, gt=0, le=MAX_DURATION_S, description="time budget per run")
    start_timeout_s: float = Field(120.0, gt=0, le=MAX_TIMEOUT_S)
    request_timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S)
    stall_timeout_s: float = Field(30.0, gt=0, le=MAX_TIMEOUT_S,
                                   description="no request finishing for this long = STALL")

    @model_validator(mode="after")
    def _some_budget(self) -> "RunsSpec":
        if self.requests is None and self.duration_s is None:
            raise ValueError("give `requests`, `duration_s` or both: a run needs a budget")
        return self

    def count(self, reps: int | None = None, adaptive_max: int | None = None) -> int:
        """Runs of each build: ``--adaptive MAX`` at most, else ``--reps``, else ``runs.repetitions``
        (the one place this rule is worked out: matrix run, suite run and the runner ask here)."""
        return adaptive_max or reps or self.repetitions


class Matrix(_Strict):
    """matrix.yaml. The top-level keys below are the spec's; any other top-level key is a deploy
    target's own section (the docker target's ``hosts:``, ``docker:``, ``base_image:``; the ray
    target's ``ray:``), kept here as the JSON value written (:meth:`section`). The target that owns
    it types and checks it (its ``SECTIONS`` and ``check_settings``, applied by
    kvrepro.deploy.check_settings, which also refuses a key no target owns) with file:line errors
    when kvrepro.matrix loads the matrix; spec/ imports no later stage and names no target."""

    model_config = ConfigDict(extra="allow", frozen=True)

    base: str | list[str] = Field(
        DEFAULT_BASE,
        description="the vLLM release every build is based on, or a list: each build then runs on each release",
    )
    target: str = "sim"
    patches: dict[str, PatchSpec] = Field(default_factory=dict, max_length=MAX_PATCHES)
    common: list[str] = Field(default_factory=list, max_length=MAX_STACK)
    builds: dict[str, list[str]] = Field(max_length=MAX_BUILDS)
    target_signature: TargetSignature = Field(default_factory=TargetSignature)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    load: LoadSpec = Field(default_factory=LoadSpec)
    runs: RunsSpec = Field(default_factory=RunsSpec)
    expect: dict[str, str] = Field(
        default_factory=dict,
        description="build -> the verdict every repetition must have; `matrix run` exits 1 otherwise",
    )

    @field_validator("base")
    @classmethod
    def _version(cls, v: str | list[str]) -> str | list[str]:
        values = [v] if isinstance(v, str) else v
        if not values:
            raise ValueError("list at least one vLLM release, e.g. [0.26.0, 0.30.0]")
        if len(values) > MAX_BASES:
            raise ValueError(f"{len(values)} releases; at most {MAX_BASES}")
        for value in values:
            if not _VERSION_RE.match(value):
                raise ValueError(f"{value!r} must be a vLLM release version such as 0.26.0")
            if (problem := unsupported(value)) is not None:
                raise ValueError(problem)
        if len(set(values)) != len(values):
            raise ValueError("a release is listed twice")
        return v

    @property
    def bases(self) -> list[str]:
        """``base`` as a list (one entry when the matrix names one release)."""
        return [self.base] if isinstance(self.base, str) else list(self.base)

    @field_validator("builds")
    @classmethod
    def _nonempty(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        if not v:
            raise ValueError("name at least one build, e.g. `A: []` for the base alone")
        for name, stack in v.items():
            if not isinstance(name, str) or not NAME_RE.fullmatch(name):
                raise FieldError(("builds", name), f"build name {str(name)[:80]!r}: use {NAME_RULE}")
            if len(stack) > MAX_STACK:
                raise FieldError(("builds", name), f"{len(stack)} patches in one stack; at most {MAX_STACK}")
        return v

    @field_validator("patches")
    @classmethod
    def _patch_names(cls, v: dict[str, PatchSpec]) -> dict[str, PatchSpec]:
        for name in v:
            if not isinstance(name, str) or not NAME_RE.fullmatch(name):
                raise FieldError(("patches", name), f"patch name {str(name)[:80]!r}: use {NAME_RULE} "
                                  "(it names folders and builds)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _priority_policy(cls, data: Any) -> Any:
        """A load that sends priorities needs vLLM's priority scheduler (without it the server answers
        400 to every request with a priority): add ``--scheduling-policy priority`` unless given."""
        if not isinstance(data, dict) or not isinstance(data.get("load"), dict):
            return data
        events = data["load"].get("events")
        if not (isinstance(events, list) and any(isinstance(e, dict) and e.get("priority") is not None
                                                 for e in events)):
            return data
        engine = dict(data.get("engine") or {}) if isinstance(data.get("engine") or {}, dict) else None
        if engine is None:
            return data
        extra = engine.get("extra_args") or []
        if isinstance(extra, list) and not any(str(a).split("=")[0] == "--scheduling-policy" for a in extra):
            engine["extra_args"] = [*extra, "--scheduling-policy", "priority"]
            data = {**data, "engine": engine}
        return data

    @model_validator(mode="after")
    def _known_patches(self) -> "Matrix":
        for where, names in [(("common",), self.common)] + [(("builds", b), p) for b, p in self.builds.items()]:
            for i, name in enumerate(names):
                if name not in self.patches:
                    known = ", ".join(sorted(self.patches)) or "(none declared)"
                    raise FieldError(where + (i,), f"unknown patch {name[:80]!r}; declared patches: {known}")
        for b, stack in self.builds.items():
            whole = [*self.common, *stack]
            twice = next((name for i, name in enumerate(whole) if name in whole[:i]), None)
            if twice is not None:
                where = "common: and the build" if twice in self.common and twice in stack else "the stack"
                raise FieldError(("builds", b), f"patch {twice[:80]!r} twice in {where}; a patch applies once "
                                  "(the second would fail, or revert the first): list it once")
            if len(self.common) + len(stack) > MAX_STACK:
                raise FieldError(("builds", b), f"common: + this build make {len(self.common) + len(stack)} "
                                  f"patches in one stack; at most {MAX_STACK}")
        return self

    @model_validator(mode="after")
    def _capable_connector(self) -> "Matrix":
        if self.engine.connector != "capable":
            return self
        for base in self.bases:
            for build, stack in self.builds.items():
                if (problem := divergent_hits_flag_problem(base, [*self.common, *stack])) is not None:
                    raise FieldError("engine.connector", f"capable, but build {build} on {base}: {problem}; use "
                                      "base 0.28.0 or later, or add the patch to the build")
        return self

    @model_validator(mode="after")
    def _failure_reporting_connector(self) -> "Matrix":
        if self.engine.connector not in ("mooncake-store-like", "nixl-like"):
            return self
        for base in self.bases:
            if not reports_failed_loads(base):
                raise FieldError("engine.connector", f"{self.engine.connector} models a connector's per-request "
                                  f"report of a failed load, which vLLM {base}'s scheduler does not take (from "
                                  f"{FAILED_RECVING_FROM}); use base {FAILED_RECVING_FROM} or later")
        return self

    @model_validator(mode="after")
    def _known_expectations(self) -> "Matrix":
        for name, label in self.expect.items():
            if name not in self.builds:
                raise FieldError(f"expect.{name}", f"no build {name!r}; builds: {', '.join(self.builds)}")
            for alternative, raw in zip(expected_labels(label), (p.strip() for p in label.split("|") if p.strip())):
                if alternative not in EXPECTABLE:
                    raise FieldError(f"expect.{name}", f"{alternative!r} is not a verdict; use one of "
                                      f"{', '.join(EXPECTABLE)}, or several joined by '|' (any of them)")
                if _NAMED_CORRUPT.match(raw) and not expected_defects(raw):
                    raise FieldError(f"expect.{name}", f"{raw!r} names no defect: write CORRUPT, or "
                                      "CORRUPT(<defect>) with a name from `kvrepro signatures`")
                for defect in expected_defects(raw):
                    if not _DEFECT_NAME.match(defect):
                        raise FieldError(f"expect.{name}", f"{defect!r} is not a defect name (lower-case "
                                          "letters, digits and '-', as `kvrepro signatures` lists them)")
        return self

    def section(self, name: str) -> Any:
        """A target's own top-level section as written (a JSON value), or None when absent."""
        return (self.model_extra or {}).get(name)

    @property
    def sections(self) -> dict[str, Any]:
        """Every top-level key that is not the spec's own: the targets' sections, as written."""
        return dict(self.model_extra or {})

    def with_section(self, name: str, value: Any) -> "Matrix":
        """A copy with a target's section set (``matrix run --base-image``: the docker target's base_image)."""
        return self.model_copy(update={name: value})  # extra="allow": an unknown name lands in model_extra

    @model_validator(mode="after")
    def _offload_faults_releases(self) -> "Matrix":
        """A fault kind that the release's connector (engine.connector) cannot produce is refused here
        (kvrepro/versions.py says which and why); one it can produce does what that connector does."""
        faults = self.engine.sim.offload_faults
        if faults is None:
            return self
        for kind in ("store", "load"):
            if not faults.fails(kind):
                continue
            for base in self.bases:
                if (problem := offload_fault_problem(base, kind, self.engine.connector)) is not None:
                    field = f"{kind}_fail_rate" if getattr(faults, f"{kind}_fail_rate") else f"{kind}_fail_at"
                    raise FieldError(f"engine.sim.offload_faults.{field}", problem)
        return self

    @model_validator(mode="after")
    def _target_settings(self, info: ValidationInfo) -> "Matrix":
        # The targets' own sections (docker:, hosts:) are checked by the deploy stage, handed in
        # by whoever loads the matrix (kvrepro.matrix.load_matrix): spec/ imports no later stage.
        check = (info.context or {}).get(TARGET_SETTINGS_CHECK)
        if check is not None:
            check(self)
        return self


# the validation-context keys under which parse_matrix passes the later stages' settings checks
LOAD_SETTINGS_CHECK = "load_settings_check"
TARGET_SETTINGS_CHECK = "target_settings_check"


class FieldError(ValueError):
    """A cross-field error that knows which field (dotted path, or a tuple of keys when a key may
    hold dots) it is about."""

    def __init__(self, path: str | tuple[Any, ...], message: str):
        super().__init__(message)
        self.path = path

    @property
    def loc(self) -> tuple[Any, ...]:
        return tuple(self.path.split(".")) if isinstance(self.path, str) else tuple(self.path)


class _Lazy:
    def __init__(self, make):
        self.make = make

    def __str__(self) -> str:
        return self.make()

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class LoadedMatrix:
    """A validated matrix plus where it came from (to resolve patch files and report lines)."""

    def __init__(self, matrix: Matrix, path: Path, text: str):
        self.matrix = matrix
        self.path = path
        self.text = text
        self.builds_dir = path.parent / "builds"
        self.own_text = True  # False for a matrix derived from this file (its lines are not the file's)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def model_dir(self) -> Path:
        """engine.model as a directory with config.json: a path (relative to matrix.yaml) or a shipped name."""
        name = self.matrix.engine.model
        for candidate in (self.path.parent / name, SHIPPED_MODELS / name):
            if (candidate / "config.json").is_file():
                if self.matrix.engine.geometry is not None:
                    from .geometry import materialize  # engine.geometry: the config generated from it

                    try:
                        return materialize(candidate.resolve(), self.matrix.engine)
                    except SpecError as exc:
                        raise SpecError(f"{self.path}: {exc}") from None
                return candidate.resolve()
        shipped = ", ".join(sorted(p.name for p in SHIPPED_MODELS.glob("*") if (p / "config.json").is_file()))
        raise SpecError(
            f"{self.path}: engine.model: {name!r} is neither a directory with config.json nor a shipped "
            f"config (shipped: {shipped or 'none'})"
        )

    def _at(self, *loc: Any) -> str:
        """``file:line`` of a field (the file alone when the line is unknown, e.g. a derived matrix)."""
        if not self.own_text:
            return str(self.path)
        try:
            line = line_for(line_index(self.text), loc)
        except yaml.YAMLError:
            line = None
        return f"{self.path}:{line}" if line else str(self.path)

    def patch_ref(self, name: str) -> PatchRef:
        spec = self.matrix.patches[name]
        where = _Lazy(lambda: f"{self._at('patches', name, 'file')}: patches.{name}.file")  # on error paths only
        # where the file is, as written (a symlink placed in the folder is the user's own doing);
        # `..` and absolute paths must not reach outside the matrix's folder unless the patch says so
        given = Path(os.path.normpath(self.builds_dir / os.path.expanduser(spec.file)))
        folder = Path(os.path.normpath(self.path.parent))
        if not spec.outside_matrix_folder and not given.is_relative_to(folder):
            raise SpecError(f"{where}: {spec.file!r} is outside the matrix's folder {folder}; copy the patch under "
                            f"{self.builds_dir}, or set `outside_matrix_folder: true` on patches.{name} to read it "
                            "from there")
        path = given.resolve()
        if path.is_dir():
            raise SpecError(f"{where}: {path} is a folder, not a patch file; name the .patch file in it")
        if not path.exists():
            raise SpecError(f"{where}: {path} does not exist; put the patch under {self.builds_dir}")
        if not path.is_file():
            raise SpecError(f"{where}: {path} is not a regular file; give a .patch file")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise SpecError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None
        digest = hashlib.sha256(data).hexdigest()
        if spec.sha256 and spec.sha256 != digest:
            raise SpecError(
                f"{self._at('patches', name, 'sha256')}: patches.{name}.sha256: {spec.file} has sha256 {digest}, "
                f"matrix.yaml says {spec.sha256}; "
                "update the sha256 if the patch changed on purpose"
            )
        return PatchRef(name=name, path=path, upstream=spec.upstream, sha256=digest, reverse=spec.reverse)

    def plans(self, only: list[str] | None = None, bases: list[str] | None = None) -> list[BuildPlan]:
        """One plan per (base, build) cell, base-major; ``bases`` overrides the matrix's ``base``."""
        names = list(self.matrix.builds)
        if only:
            unknown = [b for b in only if b not in self.matrix.builds]
            if unknown:
                raise SpecError(f"unknown build(s) {', '.join(unknown)}; {self.path} defines {', '.join(names)}")
            names = [b for b in names if b in only]
        releases = list(bases or self.matrix.bases)
        for release in releases:
            if not _VERSION_RE.match(release):
                raise SpecError(f"--base {release!r}: must be a vLLM release version such as 0.26.0")
            if (problem := unsupported(release)) is not None:
                raise SpecError(f"--base {problem}")
        geometry = self.matrix.engine.geometry
        # a matrix of one's own: a base without the flag is bad input here. A suite's derived matrix runs
        # it, and the row says NOT TESTABLE from vLLM's own refusal, as for other flags a release lacks.
        if self.own_text and geometry is not None and geometry.hash_block_size is not None:
            for release in releases:
                if (problem := prefix_match_unit_problem(release)) is not None:
                    raise SpecError(f"{self._at('engine', 'geometry', 'hash_block_size')}: "
                                    f"engine.geometry.hash_block_size: {problem}")
        several = len(releases) > 1
        plans = []
        for release in releases:
            for name in names:
                stack = list(self.matrix.common) + list(self.matrix.builds[name])
                plans.append(BuildPlan(name=cell_name(name, release, several), base=release,
                                       patches=tuple(self.patch_ref(p) for p in stack), build=name))
        return plans


def parse_matrix(text: str, path: Path, check_load_settings: Callable[[LoadSpec], None] | None = None,
                 check_target_settings: Callable[["Matrix"], None] | None = None,
                 data: dict[str, Any] | None = None) -> LoadedMatrix:
    """Validate matrix text; raise SpecError naming file:line, field and what is allowed.

    ``check_load_settings`` checks the load profile's own fields (``load:`` keys LoadSpec does
    not know); ``check_target_settings`` the targets' sections (``docker:``, ``hosts:``); both
    raise :class:`FieldError`. kvrepro.matrix passes the load generator's and the targets'
    checks; without them those fields are kept unchecked (a later stage validates them when it
    uses them).

    ``data``: what ``text`` parses to, when the caller wrote ``text`` from it (``yaml.safe_dump``, as
    the suite does for each catalogue entry's matrix): not parsed again (pure-Python YAML, ~20 ms).
    """
    if len(text) > MAX_MATRIX_BYTES:
        raise SpecError(f"{path}: {len(text):,} characters; a matrix is at most {MAX_MATRIX_BYTES:,} (is this the "
                        "right file?)")
    try:
        if data is None:
            data = yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except DuplicateKey as exc:
        raise SpecError(f"{path}:{exc.line}: {exc}; each key may appear once, remove or rename one") from None
    except TooBig as exc:
        raise SpecError(f"{path}:{exc.line}: {exc}") from None
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply to read; a matrix is a few levels deep") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise SpecError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{path}:1: the top level must be a mapping (base:, patches:, builds:, ...)")
    try:
        context = {key: check for key, check in ((LOAD_SETTINGS_CHECK, check_load_settings),
                                                 (TARGET_SETTINGS_CHECK, check_target_settings)) if check}
        matrix = Matrix.model_validate(data, context=context or None)
    except ValidationError as exc:
        lines = line_index(text)  # only a problem needs line numbers: a second parse of the text
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            ctx_err = (err.get("ctx") or {}).get("error")
            if isinstance(ctx_err, FieldError):
                loc = ctx_err.loc
                msg = str(ctx_err)
            elif err["type"] == "extra_forbidden":
                parent = _model_at(loc[:-1])
                allowed = ", ".join(parent.model_fields) if parent else "see the README"
                msg = f"unknown field; allowed here: {allowed}"
            else:
                msg = err["msg"].removeprefix("Value error, ")
                if err["type"] in ("less_than_equal", "too_long"):
                    msg += " (a limit of kvrepro's, see docs/reliability.md)"
            line = line_for(lines, loc)
            field = ".".join(str(p)[:80] for p in loc) or "(top level)"
            problems.append(f"{path}:{line}: {field}: {msg}" if line else f"{path}: {field}: {msg}")
        raise SpecError("invalid matrix:\n  " + "\n  ".join(problems)) from None
    # the values of --hf-token & co. are masked from here on in everything kvrepro writes
    from ..secrets import remember, secret_arg_values

    remember(secret_arg_values(list(matrix.engine.extra_args)))
    return LoadedMatrix(matrix, path, text)


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that a location points into (for listing allowed fields)."""
    model: Any = Matrix
    for part in loc:
        if isinstance(part, int) or (isinstance(part, str) and part.isdigit()):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        for candidate in getattr(ann, "__args__", ()) + (ann,):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                model = candidate
                break
        else:
            return None
    return model if isinstance(model, type) else None


def load_matrix(path: str | Path, check_load_settings: Callable[[LoadSpec], None] | None = None,
                check_target_settings: Callable[["Matrix"], None] | None = None) -> LoadedMatrix:
    """Read and validate a matrix file (see :func:`parse_matrix`)."""
    path = Path(path)
    if path.is_dir():
        hint = f"; did you mean {path / 'matrix.yaml'}?" if (path / "matrix.yaml").is_file() else ""
        raise SpecError(f"{path}: is a folder, not a matrix file; pass --matrix PATH/TO/matrix.yaml{hint}")
    try:
        if path.is_file() and path.stat().st_size > MAX_MATRIX_BYTES:
            raise SpecError(f"{path}: {path.stat().st_size:,} bytes; a matrix is at most {MAX_MATRIX_BYTES:,} "
                            "(is this the right file?)")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file; `kvrepro init` writes a starter project here "
                        "(or pass --matrix PATH, or run from the project's folder)") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SpecError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                        "save the file as UTF-8") from None
    return parse_matrix(text, path.resolve(), check_load_settings, check_target_settings)


# the experiment kvrepro ships; `kvrepro classify LOG` without --matrix judges logs against its target
DEFAULT_MATRIX = paths.shipped_matrix()  # a checkout's top-level matrix.yaml, or the wheel's copy
_DEFAULT_EXPRESSION = "num_locally_computed_tokens <= num_locally_computed_gpu_blocks * tokens_per_block"


def default_target_signature() -> TargetSignature:
    """The default matrix's target signature, expression included, so that another assertion in
    the same function is not taken for the target. Falls back to the same values when the package
    is installed without its matrix.yaml."""
    try:
        return load_matrix(DEFAULT_MATRIX).matrix.target_signature
    except SpecError:
        return TargetSignature(expression=_DEFAULT_EXPRESSION)
