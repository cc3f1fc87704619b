"""The sim executor: a vLLM ``Executor`` with no GPU behind it.

``EngineCore`` is constructed with this class as its executor, so everything above the
executor is vLLM's own code: ``Scheduler``, ``KVCacheManager``, the hybrid KV-cache groups,
spec-decode bookkeeping, and the ``OffloadingConnector``'s scheduler side. Below it, the
worker-side KV-connector lifecycle is vLLM's too: the real GPU model runner's
``KVConnectorModelRunnerMixin`` binds the connector metadata, starts transfers and collects
``get_finished()`` / ``build_connector_worker_meta()`` from a real ``OffloadingConnector``
created with role WORKER, exactly as ``gpu_model_runner.execute_model`` does.

Faked, because this machine has no GPU:

* **The model** (``SimRunner``): which tokens come out. A request samples once its whole
  known sequence has been computed (chunked prefill steps sample nothing, as on a GPU); the
  token values are a deterministic function of request and position. With MTP, each
  scheduled draft token is accepted with probability ``KVREPRO_SIM_ACCEPTANCE_RATE`` (seeded
  by ``KVREPRO_SIM_SEED``); accepted drafts plus one new token are returned, so the scheduler
  rolls back rejected drafts itself. After sampling, one draft per speculative slot is
  proposed through ``take_draft_token_ids`` (the synchronous-scheduling path).
* **The offload data movement** (``SimTransferWorker``, vLLM's ``OffloadingWorker``
  interface): no bytes move; every store job the connector submits is reported finished by
  the next step's ``get_finished()``, every load job ``KVREPRO_SIM_LOAD_STEPS`` steps after it
  was submitted (default 1: the next step; more stands for a slow tier or a large load and
  keeps a load in flight across that many scheduler steps). ``wait()`` on a flush finishes the
  named jobs at once. The real connector worker turns those reports into ``finished_recving`` and
  ``completed_jobs`` for the scheduler, as it would for CUDA copies.
* **KV-cache specs**: built per layer the way the model's layers would report them
  (``FullAttentionSpec`` for full attention, including the MTP draft layer; ``MambaSpec`` with
  the model class's own GDN state shapes for linear attention), after vLLM's
  ``update_block_size_for_backend`` has aligned the hybrid block size. Supported: configs with
  ``layer_types`` of ``full_attention`` / ``linear_attention`` (Qwen3-Next style).
* **Memory**: ``determine_available_memory`` reports enough for ``max_num_seqs`` requests of
  ``max_model_len``; ``--num-gpu-blocks-override`` then sets the pool, as on a GPU.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

from kvrepro import versions

from . import arcs, faults
from . import shadow as shadow_kv
from .config import SimKnobs

logger = init_logger("vllm.kvrepro_engine.executor")
COUNTS_INTERVAL_S = 2.0
FLUSH_INTERVAL_S = 0.5  # the runner waits a little longer than this before stopping an engine



def _answer(call, arg, non_block: bool):
    """Run ``call(arg)`` now and answer as vLLM's executors do: a Future when ``non_block``
    (EngineCore waits on it), else the value; an exception travels inside the Future."""
    future: Future = Future()
    try:
        future.set_result(call(arg))
    except Exception as exc:
        future.set_exception(exc)
    return future if non_block else future.result()

@dataclass(slots=True)
class _InFlight:
    """A transfer job the connector submitted and no ``get_finished()`` has reported yet."""

    kind: str  # "load" | "store"
    steps_left: int
    failed: bool = False  # an injected fault (engine.sim.offload_faults)
    request: str | None = None  # a failed load's request (the connector worker's record), for the counts


class SimTransferWorker(OffloadingWorker):
    """vLLM's OffloadingWorker interface without data movement: a store finishes one step later,
    a load ``load_steps`` steps later (``engine.sim.load_steps``, default 1); with
    ``engine.sim.offload_faults`` a :class:`~kvrepro.engine.faults.FaultPlan` draws each job's steps
    and fails some jobs on purpose (one ``kvrepro-fault:`` line each).

    A failed job is reported as a real copy would report it, ``TransferResult(success=False)``, and
    the connector decides what that does: vLLM's OffloadingConnector asserts before 0.34.0 and reports
    it from 0.34.0; kvrepro/engine/load_failures.py's connectors report it as Mooncake store or NIXL
    do (kvrepro/versions.py). A failed load fills none of its GPU blocks (the shadow KV marks them
    unfilled)."""

    def __init__(self, shadow: "shadow_kv.ShadowKV | None" = None, load_steps: int = 1,
                 plan: "faults.FaultPlan | None" = None, owner_of=None) -> None:
        self.shadow = shadow  # shadow KV: copies block contents as the real transfers would
        self.load_steps = max(1, int(load_steps))
        self.plan = plan
        self.owner_of = owner_of or (lambda job_id: None)  # the request a load job is for (connector worker)
        self._lock = threading.Lock()
        self._submitted: dict[int, _InFlight] = {}
        self._done: dict[int, _InFlight] = {}  # finished, not yet reported
        self.completed = {"load": 0, "store": 0}

    def begin_step(self) -> None:
        """Called at the start of each model step: one more step has passed for every job in
        flight; those whose steps are used up are now complete."""
        with self._lock:
            for job_id, job in list(self._submitted.items()):
                job.steps_left -= 1
                if job.steps_left <= 0:
                    self._done[job_id] = job
                    del self._submitted[job_id]

    def _plan(self, kind: str, job_id, gpu_spec) -> tuple[bool, int]:
        """(fail?, steps) for a new job; a failure is logged here, where it is decided."""
        if self.plan is None:
            return False, self.load_steps if kind == "load" else 1
        fail, steps = self.plan.decide(kind)
        if fail:
            request = self.owner_of(job_id) if kind == "load" else None
            ids = getattr(gpu_spec, "block_ids", None)  # a numpy array in vLLM's specs
            blocks = [int(b) for b in ids] if ids is not None else []
            logger.info("%s", self.plan.fault_line(kind, job_id, request, blocks))
        return fail, steps

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        fail, steps = self._plan("store", job_id, src_spec)
        if self.shadow is not None and not fail:  # shadow KV (kvrepro/engine/shadow.py)
            self.shadow.store(job_id, src_spec, dst_spec)
        with self._lock:
            self._submitted[job_id] = _InFlight("store", steps, fail)
        return True

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        fail, steps = self._plan("load", job_id, dst_spec)
        if self.shadow is not None:  # shadow KV (kvrepro/engine/shadow.py)
            (self.shadow.load_failed if fail else self.shadow.load)(job_id, src_spec, dst_spec)
        request = self.owner_of(job_id) if fail else None
        with self._lock:
            self._submitted[job_id] = _InFlight("load", steps, fail, request)
        return True

    def wait(self, job_ids) -> None:
        # A flush blocks until the named transfers are done; here they are done at once.
        with self._lock:
            for job_id in job_ids:
                job = self._submitted.pop(job_id, None)
                if job is not None:
                    self._done[job_id] = job

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            done, self._done = self._done, {}
            for job in done.values():
                self.completed[job.kind] += 1
                if job.failed and job.kind == "load" and job.request is not None and self.plan is not None:
                    self.plan.failed_requests.add(job.request)
        return [TransferResult(job_id=job_id, success=not done[job_id].failed) for job_id in sorted(done)]

    def in_flight(self) -> int:
        with self._lock:
            return len(self._submitted) + len(self._done)


@dataclass
class _ReqState:
    key: int  # stable per-request number for token values
    tokens: list[int]  # the request's real tokens: prompt + accepted output (rejected drafts never enter)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class SimRunner:
    """Stands where GPUModelRunner stands: tracks requests, runs the connector, samples."""

    def __init__(self, vllm_config: VllmConfig, knobs: SimKnobs, connector, transfers, shadow=None):
        self.vllm_config = vllm_config
        self.shadow = shadow  # shadow KV: checks each forward's context (kvrepro/engine/shadow.py)
        self.connector = connector
        self.transfers = transfers
        self.vocab_size = max(2, int(vllm_config.model_config.get_vocab_size()))
        spec = vllm_config.speculative_config
        self.num_spec = spec.num_speculative_tokens if spec is not None else 0
        self.acceptance_rate = knobs.acceptance_rate
        self.rng = random.Random(knobs.seed)
        self.requests: dict[str, _ReqState] = {}
        self._pending: tuple | None = None  # (req ids, sampled, kv connector output)
        self._drafts: dict[str, list[int]] = {}

    def _token(self, state: _ReqState, position: int) -> int:
        return (state.key * 1_000_003 + position * 7_919) % self.vocab_size

    def _update_states(self, so) -> dict[str, int]:
        """Like GPUModelRunner._update_states: forget finished requests, learn new ones."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        num_computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            if new.req_id not in self.requests:
                self.requests[new.req_id] = _ReqState(
                    key=zlib.crc32(new.req_id.encode()), tokens=list(new.prompt_token_ids or ())
                )
            num_computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            num_computed[req_id] = computed
        if self.shadow is not None:
            self.shadow.update_requests(so)
        return num_computed

    def execute_model(self, so):
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as Mixin

        if self.transfers is not None:
            self.transfers.begin_step()
        if self.connector is not None:
            self.connector.handle_preemptions(so.kv_connector_metadata)
        num_computed = self._update_states(so)
        if not so.total_num_scheduled_tokens:
            if self.connector is None:
                from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

                return EMPTY_MODEL_RUNNER_OUTPUT
            return Mixin.kv_connector_no_forward(so, self.vllm_config)
        with set_forward_context(None, self.vllm_config), Mixin.maybe_get_kv_connector_output(so) as kv_out:
            req_ids, sampled = self._forward(so, num_computed)
        self._pending = (req_ids, sampled, kv_out)
        return None

    def _forward(self, so, num_computed: dict[str, int]):
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        self._drafts = {}
        for req_id in req_ids:
            state = self.requests[req_id]
            spec = so.scheduled_spec_decode_tokens.get(req_id) or []
            seq_end = num_computed[req_id] + so.num_scheduled_tokens[req_id] - len(spec)
            if self.shadow is not None:  # before the forward: is its context really in the KV cache?
                self.shadow.forward(req_id, num_computed[req_id], so.num_scheduled_tokens[req_id], spec)
            if seq_end < state.num_tokens:
                sampled.append([])  # a chunk of a longer prefill: nothing is sampled
                continue
            accepted = 0
            for draft in spec:
                if draft < 0 or self.rng.random() >= self.acceptance_rate:
                    break
                accepted += 1
            tokens = list(spec[:accepted])
            new = self._token(state, state.num_tokens + accepted)
            if accepted < len(spec) and new == spec[accepted]:
                new = (new + 1) % self.vocab_size  # a rejected draft is replaced by another token
            tokens.append(new)
            state.tokens.extend(tokens)
            if self.shadow is not None:
                self.shadow.sampled(req_id, tokens, seq_end)
            sampled.append(tokens)
            if self.num_spec:
                self._drafts[req_id] = [self._token(state, state.num_tokens + i) for i in range(self.num_spec)]
        return req_ids, sampled

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        assert self._pending is not None, "sample_tokens() without a preceding execute_model()"
        req_ids, sampled, kv_out = self._pending
        self._pending = None
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        if not self._drafts:
            return None
        drafts, self._drafts = self._drafts, {}
        return DraftTokenIds(req_ids=list(drafts), draft_token_ids=list(drafts.values()))


class SimExecutor(Executor):
    """One fake worker in-process; see the module docstring for what is real and what is not."""

    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        from vllm.platforms import current_platform

        import vllm

        self._vllm_version = getattr(vllm, "__version__", "?")
        entry = versions.release(self._vllm_version) or versions.Release(self._vllm_version)
        self._rpc_answers = entry.worker_rpc_answers()
        self.knobs = SimKnobs.from_env()
        self.fault_settings = faults.FaultSettings.from_env()
        self.fault_plan: faults.FaultPlan | None = None
        self.steps = 0
        self._last_counts: tuple | None = None
        self._last_report = 0.0
        self.runner: SimRunner | None = None
        self.connector = None
        self.transfers: SimTransferWorker | None = None
        self.shadow: shadow_kv.ShadowKV | None = None
        self._start_flusher()
        if arcs.instrumented():  # explore's feedback: branches of the code under test (kvrepro/engine/branches.py)
            from .branches import BranchRecorder

            BranchRecorder().install()
        elif arcs.enabled():  # the same by sys.settrace: exact arcs, about 3x the engine's CPU
            arcs.ArcRecorder(always=arcs.always_from_env(os.environ.get(arcs.ALWAYS_ENV, ""))).install()
        # A GPU worker calls this after loading the model (UniProcExecutor._init_executor);
        # it aligns the attention block size with the Mamba page size for hybrid models.
        current_platform.update_block_size_for_backend(self.vllm_config)
        self._specs = self._build_kv_cache_specs()
        logger.info(
            "Sim executor: no GPU; fake model (draft acceptance rate %.2f, seed %d, step delay "
            "%.1f ms) and fake offload data movement (stores finish one step later, loads %d).",
            self.knobs.acceptance_rate, self.knobs.seed, self.knobs.step_delay_ms, self.knobs.load_steps,
        )

    # -- what a worker would report ------------------------------------------------------

    def _build_kv_cache_specs(self) -> dict:
        from vllm.model_executor.models import ModelRegistry
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, get_kv_quant_mode

        vc = self.vllm_config
        model_config = vc.model_config
        cache_config = vc.cache_config
        hf = model_config.hf_text_config
        layer_types = getattr(hf, "layer_types", None)
        if not layer_types or not set(layer_types) <= {"full_attention", "linear_attention"}:
            raise RuntimeError(
                f"{model_config.model}/config.json: the sim engine lays out KV caches for "
                "Qwen3-Next style configs only (layer_types made of 'full_attention' and "
                f"'linear_attention'); got layer_types={layer_types!r}"
            )
        model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)

        def attention_spec(mc) -> FullAttentionSpec:
            head_size = mc.get_head_size()
            return FullAttentionSpec(
                block_size=cache_config.block_size,
                num_kv_heads=mc.get_num_kv_heads(vc.parallel_config),
                head_size=head_size,
                head_size_v=head_size,
                dtype=kv_cache_dtype_str_to_dtype(cache_config.cache_dtype, mc),
                kv_quant_mode=get_kv_quant_mode(cache_config.cache_dtype),
            )

        num_spec = vc.speculative_config.num_speculative_tokens if vc.speculative_config else 0
        specs: dict = {}
        for i, kind in enumerate(layer_types):
            if kind == "full_attention":
                specs[f"model.layers.{i}.self_attn.attn"] = attention_spec(model_config)
            else:
                specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                    shapes=tuple(model_cls.get_mamba_state_shape_from_config(vc)),
                    dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vc)),
                    block_size=cache_config.mamba_block_size,
                    page_size_padded=cache_config.mamba_page_size_padded,
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                    mamba_cache_mode=cache_config.mamba_cache_mode,
                    num_speculative_blocks=num_spec,
                )
        spec_config = vc.speculative_config
        if spec_config is not None and spec_config.method == "mtp":
            # The MTP module's own decoder layers are full attention and register their KV
            # caches with the target model's (no separate drafter group).
            draft = spec_config.draft_model_config
            num_mtp = int(getattr(hf, "num_nextn_predict_layers", 1) or 1)
            for j in range(num_mtp):
                specs[f"mtp.layers.{len(layer_types) + j}.self_attn.attn"] = attention_spec(draft)
        elif spec_config is not None:
            raise RuntimeError(
                f"speculative method {spec_config.method!r}: the sim engine simulates 'mtp' only"
            )
        return specs

    def get_kv_cache_specs(self):
        return [self._specs]

    def determine_available_memory(self) -> list[int]:
        from vllm.utils.math_utils import cdiv

        vc = self.vllm_config
        per_block = sum(spec.page_size_bytes for spec in self._specs.values())
        blocks = vc.scheduler_config.max_num_seqs * (
            cdiv(vc.model_config.max_model_len, vc.cache_config.block_size) + 4
        )
        return [per_block * blocks]

    def initialize_from_config(self, kv_cache_configs) -> None:
        kv_cache_config = kv_cache_configs[0]
        self.shadow = None
        if shadow_kv.enabled():
            self.shadow = shadow_kv.ShadowKV(kv_cache_config, blocks_per_chunk=self._blocks_per_chunk())
        self._chunk_blocks = self._blocks_per_chunk()
        if self.vllm_config.kv_transfer_config is not None:
            self.connector, self.transfers = self._make_worker_connector(kv_cache_config)
        self.runner = SimRunner(self.vllm_config, self.knobs, self.connector, self.transfers, self.shadow)
        self._log_geometry(kv_cache_config)

    def _log_geometry(self, kv_cache_config) -> None:
        """The KV geometry vLLM built, as one line (kvrepro reads it: groups, block, chunk, DP rank)."""
        vc = self.vllm_config
        groups = ",".join(f"{g.index}:{g.kind}/{g.block_size}" for g in shadow_kv.describe_groups(kv_cache_config))
        block = vc.cache_config.block_size
        parallel = vc.parallel_config
        spec = vc.speculative_config
        logger.info(
            "kvrepro-sim: geometry kv_cache_groups=%s block_size=%d offload_chunk_tokens=%s num_gpu_blocks=%d "
            "num_speculative_tokens=%d data_parallel_rank=%d data_parallel_size=%d",
            groups, block, block * self._chunk_blocks if self.connector is not None else "-",
            kv_cache_config.num_blocks, spec.num_speculative_tokens if spec is not None else 0,
            getattr(parallel, "data_parallel_rank", 0), getattr(parallel, "data_parallel_size", 1),
        )

    def _blocks_per_chunk(self) -> int:
        """GPU blocks per offloaded block, for the shadow KV's view of CPU blocks: the offload
        block size (kv_connector_extra_config ``block_size``) over the GPU block size."""
        config = self.vllm_config.kv_transfer_config
        extra = (getattr(config, "kv_connector_extra_config", None) or {}) if config is not None else {}
        offload_block = int(extra.get(versions.OFFLOAD_CHUNK_EXTRA_KEY) or self.vllm_config.cache_config.block_size)
        return max(1, offload_block // self.vllm_config.cache_config.block_size)

    def _make_worker_connector(self, kv_cache_config):
        """vLLM's worker-side connector, installed as this process's KV transfer agent.

        ensure_kv_transfer_initialized() would do this after a torch.distributed TP sync that
        a single fake worker has no use for, so the factory call and the agent assignment are
        done here by hand. The offloading worker's transfer engine (which needs CUDA tensors)
        is the SimTransferWorker.
        """
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

        connector = KVConnectorFactory.create_connector(
            config=self.vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
        )
        transfers = None
        worker_side = getattr(connector, "connector_worker", None)
        if worker_side is not None and hasattr(worker_side, "worker"):
            transfers = SimTransferWorker(self.shadow, self.knobs.load_steps, self._make_fault_plan(),
                                          owner_of=lambda job_id: (getattr(worker_side, "_load_jobs", None) or {}).get(job_id))
            spec = getattr(worker_side, "spec", None)
            if getattr(spec, "blocks_per_chunk", None):
                self._chunk_blocks = int(spec.blocks_per_chunk)  # what the connector really uses
                if self.shadow is not None:
                    self.shadow.blocks_per_chunk = self._chunk_blocks
            if self.shadow is not None:
                # the connector worker notes each load job's request before submitting it
                self.shadow.load_owner = lambda job_id: (getattr(worker_side, "_load_jobs", None) or {}).get(job_id)
            worker_side.worker = transfers
        else:
            raise RuntimeError(
                f"KV connector {type(connector).__name__}: the sim engine simulates the "
                "OffloadingConnector's worker only (--kv-offloading-backend native)"
            )
        kv_transfer_state._KV_CONNECTOR_AGENT = connector
        return connector, transfers

    def _make_fault_plan(self) -> "faults.FaultPlan | None":
        """The injected offload faults (KVREPRO_SIM_OFFLOAD_FAULTS), with vLLM's own failure policy.

        A fault the connector cannot produce (kvrepro/versions.py) is refused here as in matrix.yaml;
        the log says what the connector does with the ones it can."""
        settings = self.fault_settings
        if settings is None:
            return None
        config = self.vllm_config.kv_transfer_config
        connector = versions.connector_of(getattr(config, "kv_connector", None)) or "offloading"
        for kind in faults.KINDS:
            problem = (versions.offload_fault_problem(self._vllm_version, kind, connector)
                       if settings.fails_any(kind) else None)
            if problem:
                raise RuntimeError(f"{faults.ENV}: {problem}")
        policy = str(getattr(config, "kv_load_failure_policy", None) or "fail")
        from dataclasses import replace

        self.fault_plan = faults.FaultPlan(replace(settings, policy=policy), load_steps=self.knobs.load_steps)
        effects = "; ".join(f"{kind}: {versions.offload_fault_effect(self._vllm_version, kind, connector)}"
                            for kind in faults.KINDS if settings.fails_any(kind))
        logger.info("%s installed %s (connector %s%s)", faults.TAG, os.environ.get(faults.ENV, ""), connector,
                    f"; {effects}" if effects else "")
        return self.fault_plan

    # -- the per-step calls EngineCore makes ------------------------------------------------

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        """What the one (absent) worker answers; the table is per release (kvrepro.versions)."""
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        if name not in self._rpc_answers:
            raise NotImplementedError(
                f"collective_rpc({name!r}): the sim executor has no answer for vLLM "
                f"{self._vllm_version}; add one to kvrepro/versions.py (porting checklist, step 3)"
            )
        answer = self._rpc_answers[name]
        if isinstance(answer, versions.Computed):
            answer = getattr(self, answer.name)()
        result = [answer]
        if non_block:
            future: Future = Future()
            future.set_result(result)
            return future
        return result

    def compile_or_warm_up_model(self) -> None:
        """No model to compile or warm up (0.27.1+ ask; what they do with worker answers varies)."""
        return None

    def gpu_kv_cache_layouts(self) -> list[str]:
        """The layouts a CUDA worker reports: FlashAttention's, by vLLM's own rule."""
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        return [layout.name for layout in get_supported_kv_cache_layouts([FlashAttentionBackend])]

    def get_kv_connector_handshake_metadata(self):
        # What GPUWorker returns: None when the connector needs no handshake (offloading).
        if self.connector is None:
            return [None]
        metadata = self.connector.get_handshake_metadata()
        return [None if metadata is None else {(0, 0): metadata}]

    def execute_model(self, scheduler_output, non_block: bool = False):
        assert self.runner is not None, "execute_model() before initialize_from_config()"
        self.steps += 1
        if time.monotonic() - self._last_report >= COUNTS_INTERVAL_S:
            self.report_counts()
        if self.knobs.step_delay_ms:
            time.sleep(self.knobs.step_delay_ms / 1000.0)
        return _answer(self.runner.execute_model, scheduler_output, non_block)

    def sample_tokens(self, grammar_output, non_block: bool = False):
        assert self.runner is not None
        return _answer(self.runner.sample_tokens, grammar_output, non_block)

    def take_draft_token_ids(self):
        return self.runner.take_draft_token_ids() if self.runner is not None else None

    def check_health(self) -> None:
        return

    def report_counts(self, force: bool = False) -> None:
        """The engine's own counters as one log line (the classifier reads the last one).

        They live in the EngineCore process, where vLLM's /metrics (served by the API server)
        cannot see them; the log reaches the results whatever happens to the server.
        """
        self._last_report = time.monotonic()
        stats = self.sim_stats()
        counts = (stats["steps"], stats["load_jobs"], stats["store_jobs"])
        if not force and counts == self._last_counts:
            return
        self._last_counts = counts
        logger.info("kvrepro-sim: counts steps=%d offload_load_jobs=%d offload_store_jobs=%d pid=%d",
                    *counts, os.getpid())
        if self.fault_plan is not None:
            logger.info("%s", self.fault_plan.counts_line())

    def _start_flusher(self) -> None:
        """Write changed counts (this executor's, the probe's, the shadow KV's) every
        FLUSH_INTERVAL_S, also while the engine is idle: vLLM may kill EngineCore at a stop without
        running shutdown() or exit handlers, and the last counts must be in the log by then."""

        def flush() -> None:
            while True:
                time.sleep(FLUSH_INTERVAL_S)
                try:
                    self.report_counts()
                    probe = sys.modules.get("kvrepro_probe")
                    if probe is not None and hasattr(probe, "report"):
                        probe.report()
                    if self.shadow is not None:
                        self.shadow.report()
                except Exception:  # counting must never take the engine down
                    pass

        threading.Thread(target=flush, name="kvrepro-sim-flush", daemon=True).start()

    def shutdown(self) -> None:
        self.report_counts(force=True)
        # EngineCore may end without running exit handlers: the probe's and the shadow KV's last
        # counts are written here, where a stop always passes
        probe = sys.modules.get("kvrepro_probe")
        if probe is not None and hasattr(probe, "report"):
            probe.report(force=True)
        if self.shadow is not None:
            self.shadow.report(force=True)
        if self.connector is not None:
            from vllm.distributed.kv_transfer import kv_transfer_state

            try:
                self.connector.shutdown()
            finally:
                if kv_transfer_state._KV_CONNECTOR_AGENT is self.connector:
                    kv_transfer_state._KV_CONNECTOR_AGENT = None
                self.connector = None

    def sim_stats(self) -> dict[str, int]:
        """Counters for /metrics: engine steps and completed offload jobs by kind."""
        completed = self.transfers.completed if self.transfers is not None else {"load": 0, "store": 0}
        return {"steps": self.steps, "load_jobs": completed["load"], "store_jobs": completed["store"]}
