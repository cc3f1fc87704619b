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
  proposed: through ``take_draft_token_ids`` with synchronous scheduling; with asynchronous
  scheduling kept by the runner for the next step (below).
* **Asynchronous scheduling** (vLLM's default on a GPU with MTP, ``engine.async_scheduling``):
  the executor supports it as vLLM's GPU executors do (``supports_async_scheduling``; EngineCore
  then runs its batch queue of ``max_concurrent_batches`` = 2 and the ``AsyncScheduler``), and the
  runner does what the V1 GPU model runner does with the scheduler's lag of one step
  (``gpu_model_runner._update_states`` / ``_prepare_input_ids``, 0.26.0 :1340-1380, :1511-1541,
  :1787-1890): the scheduler sends ``-1`` placeholders for draft tokens and a
  ``num_computed_tokens`` that counts the previous step's drafts as accepted; for a request that
  ran in the previous step, the runner takes its own drafts of that step and lowers
  ``num_computed_tokens`` by that step's rejected drafts (``prev_num_draft_len`` minus accepted);
  a request that was not in the previous step takes its tokens from the scheduler
  (``all_token_ids``). The executor answers at once (a done Future): a GPU's stream runs a step's
  kernels after the previous step's, so every read and write happens in call order, as here.
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
* **Device memory for the offloading worker** (0.34.0+): vLLM's connector worker turns each
  transfer's GPU blocks into device pointers before it submits the job
  (``resolve_device_pointers``, ``offloading/worker.py`` 0.34.0:242-272). The sim gives it KV caches
  whose pointer for block ``b`` is ``b`` (:class:`kvrepro.engine.device_pointers.BlockIndexMemory`), so the transfer worker
  reads the block ids back from the pointers (:func:`kvrepro.engine.device_pointers.device_blocks`).
* **Memory**: ``determine_available_memory`` reports enough for ``max_num_seqs`` requests of
  ``max_model_len``; ``--num-gpu-blocks-override`` then sets the pool, as on a GPU.
"""

from __future__ import annotations

import dataclasses
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

from . import arcs, faults, shm_region, transfer_checks
from .device_pointers import block_index_caches, device_blocks
from . import shadow as shadow_kv
from .config import SimKnobs

logger = init_logger("vllm.kvrepro_engine.executor")
COUNTS_INTERVAL_S = 2.0
# ModelRunnerOutput.req_id_to_index: every release to 0.33.0; 0.34.0 dropped it (outputs.py 0.34.0:267-309)
_HAS_REQ_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
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
        self.blocks_per_chunk = 1  # GPU blocks per CPU block: the connector worker's (set by the executor)
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
        # what vLLM's CPU worker checks before it copies, failing in its form (transfer_checks.py)
        transfer_checks.check("store", src_spec, dst_spec, self.blocks_per_chunk)
        src_spec = device_blocks(src_spec)
        fail, steps = self._plan("store", job_id, src_spec)
        if self.shadow is not None and not fail:  # shadow KV (kvrepro/engine/shadow.py)
            self.shadow.store(job_id, src_spec, dst_spec)
        with self._lock:
            self._submitted[job_id] = _InFlight("store", steps, fail)
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        # expedited (0.34.0+): a sync load the connector waits for within the step (wait() below);
        # here every load is equally fast
        transfer_checks.check("load", src_spec, dst_spec, self.blocks_per_chunk)
        dst_spec = device_blocks(dst_spec)
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


def _v2_connector_steps(vllm_config, connector):
    """vLLM's own ``ActiveKVConnector`` (runner V2) around ``connector``, when the release has no
    runner-V1 mixin; None when it has one (or there is no connector: the V2 no-op connector then)."""
    import importlib.util

    if importlib.util.find_spec("vllm.v1.worker.kv_connector_model_runner_mixin") is not None:
        return None
    from vllm.v1.worker.gpu.kv_connector import NO_OP_KV_CONNECTOR, ActiveKVConnector

    if connector is None:
        return NO_OP_KV_CONNECTOR

    class SimActiveKVConnector(ActiveKVConnector):
        """ActiveKVConnector without ``register_kv_caches`` (a GPU worker's tensors; the sim installed
        its transfer worker and block-index memory on the connector already, _make_worker_connector)."""

        def __init__(self) -> None:  # noqa: D107 (the fields ActiveKVConnector.__init__ sets, 0.34.0)
            self.vllm_config = vllm_config
            self.kv_connector = connector
            self._pending_load_kwargs = None
            self._disabled = False

    return SimActiveKVConnector()


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
        # the connector's per-step calls: vLLM's runner-V1 mixin where the release has it (to 0.33.0),
        # else its runner V2's ActiveKVConnector (0.34.0+); None: the mixin's static methods are used
        self.kv_steps = _v2_connector_steps(vllm_config, connector)
        # asynchronous scheduling (module docstring): the scheduler runs one step behind the runner
        self.async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        self._prev_batch: set[str] = set()  # requests the last step ran (the runner's persistent batch)
        self._rejected: dict[str, int] = {}  # drafts each of them had rejected in that step
        self.async_stats = {"corrections": 0, "resyncs": 0, "draft_fills": 0, "mismatches": 0}

    def _token(self, state: _ReqState, position: int) -> int:
        return (state.key * 1_000_003 + position * 7_919) % self.vocab_size

    def _update_states(self, so) -> tuple[dict[str, int], dict[str, list[int]]]:
        """Like GPUModelRunner._update_states: forget finished requests, learn new ones. Returns
        each scheduled request's computed tokens (as the GPU will compute from them) and the drafts
        proposed in the previous step (what an asynchronous step verifies)."""
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
        if self.async_scheduling:
            self._async_update(so, num_computed)
        prev_drafts, self._drafts = self._drafts, {}
        return num_computed, prev_drafts

    def _async_update(self, so, num_computed: dict[str, int]) -> None:
        """What the V1 GPU model runner does with an asynchronous scheduler's output (module
        docstring): a request of the previous step gets ``num_computed_tokens`` lowered by the drafts
        that step rejected (the scheduler counted them as accepted); a cached request that was not
        in the previous step takes its tokens from the scheduler's ``all_token_ids``."""
        cached = so.scheduled_cached_reqs
        all_tokens = getattr(cached, "all_token_ids", None) or {}
        for req_id in cached.req_ids:
            state = self.requests.get(req_id)
            if req_id in self._prev_batch:
                rejected = self._rejected.get(req_id, 0)
                if rejected:
                    num_computed[req_id] -= rejected
                    self.async_stats["corrections"] += 1
            elif state is not None and req_id in all_tokens:
                tokens = list(all_tokens[req_id])
                if tokens != state.tokens:
                    state.tokens = tokens
                    self.async_stats["resyncs"] += 1
                    if self.shadow is not None:
                        self.shadow.resync(req_id, tokens)

    def execute_model(self, so):
        from vllm.forward_context import set_forward_context

        if self.transfers is not None:
            self.transfers.begin_step()
        if self.kv_steps is not None:
            return self._execute_v2(so)
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as Mixin

        if self.connector is not None:
            self.connector.handle_preemptions(so.kv_connector_metadata)
        num_computed, prev_drafts = self._update_states(so)
        if not so.total_num_scheduled_tokens:
            self._prev_batch, self._rejected = set(), {}
            if self.connector is None:
                from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

                return EMPTY_MODEL_RUNNER_OUTPUT
            return Mixin.kv_connector_no_forward(so, self.vllm_config)
        with set_forward_context(None, self.vllm_config), Mixin.maybe_get_kv_connector_output(so) as kv_out:
            req_ids, sampled = self._forward(so, num_computed, prev_drafts)
        self._pending = (req_ids, sampled, kv_out)
        return None

    def _execute_v2(self, so):
        """The connector lifecycle of vLLM's model runner V2 (``v1/worker/gpu/model_runner.py``, the
        only GPU runner from 0.34.0): ``pre_forward`` (preemptions, metadata, sync loads) and
        ``finish_forward`` around the forward here; ``post_forward`` (async loads, saves, transfer
        results) in :meth:`sample_tokens`, as the runner does (0.34.0:2124-2166, 2322-2325)."""
        from vllm.forward_context import set_forward_context

        num_computed, prev_drafts = self._update_states(so)
        if not so.total_num_scheduled_tokens:
            self._prev_batch, self._rejected = set(), {}
            return self.kv_steps.no_forward(so)
        with set_forward_context(None, self.vllm_config):
            self.kv_steps.pre_forward(so)
            req_ids, sampled = self._forward(so, num_computed, prev_drafts)
        self.kv_steps.finish_forward()
        self._pending = (req_ids, sampled, so.finished_req_ids)
        return None

    def _spec_tokens(self, so, req_id: str, prev_drafts: dict[str, list[int]]) -> list[int]:
        """The draft tokens this step verifies: the scheduler's; with asynchronous scheduling the
        scheduler sends ``-1`` placeholders and the runner puts in the drafts it proposed for the
        request in the previous step (a request that was not in it keeps the placeholders, which
        the rejection sampler rejects: ``_prepare_input_ids`` copies drafts for previous-step
        requests only)."""
        spec = list(so.scheduled_spec_decode_tokens.get(req_id) or [])
        if not self.async_scheduling or not spec or req_id not in self._prev_batch:
            return spec
        proposed = prev_drafts.get(req_id) or []
        if proposed:
            self.async_stats["draft_fills"] += 1
        return [proposed[i] if i < len(proposed) else draft for i, draft in enumerate(spec)]

    def _forward(self, so, num_computed: dict[str, int], prev_drafts: dict[str, list[int]] | None = None):
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        prev_drafts = prev_drafts or {}
        rejected: dict[str, int] = {}
        for req_id in req_ids:
            state = self.requests[req_id]
            spec = self._spec_tokens(so, req_id, prev_drafts)
            seq_end = num_computed[req_id] + so.num_scheduled_tokens[req_id] - len(spec)
            if self.async_scheduling and spec and seq_end != state.num_tokens:
                # a decode's first position is its last sampled token: anything else means the
                # runner's view of the request and the scheduler's disagree (a kvrepro bug)
                self.async_stats["mismatches"] += 1
                if self.async_stats["mismatches"] <= 3:
                    logger.warning("kvrepro-sim: async scheduling: request %s decodes from %d tokens but holds %d",
                                   req_id, seq_end, state.num_tokens)
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
            rejected[req_id] = len(spec) - accepted
            if self.shadow is not None:
                self.shadow.sampled(req_id, tokens, seq_end)
            sampled.append(tokens)
            if self.num_spec:
                self._drafts[req_id] = [self._token(state, state.num_tokens + i) for i in range(self.num_spec)]
        self._prev_batch, self._rejected = set(req_ids), rejected
        return req_ids, sampled

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        assert self._pending is not None, "sample_tokens() without a preceding execute_model()"
        req_ids, sampled, kv_out = self._pending
        self._pending = None
        if self.kv_steps is not None:  # runner V2: transfer results collected after the forward (see _execute_v2)
            kv_out = self.kv_steps.post_forward(kv_out, defer_finalize=bool(self.num_spec))
            if self.num_spec:
                self.kv_steps.finalize_step()  # after the drafter ran, as the runner does
        index = {"req_id_to_index": {req_id: i for i, req_id in enumerate(req_ids)}} if _HAS_REQ_INDEX else {}
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_out, **index)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        if not self._drafts:
            return None
        drafts = self._drafts
        if not self.async_scheduling:
            self._drafts = {}
        # with asynchronous scheduling the runner keeps them for its next step (the GPU's drafts
        # stay on the device; EngineCore asks only for structured output)
        return DraftTokenIds(req_ids=list(drafts), draft_token_ids=[list(d) for d in drafts.values()])


class SimExecutor(Executor):
    """One fake worker in-process; see the module docstring for what is real and what is not."""

    uses_ray = False
    supports_pp = False

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        """As vLLM's GPU executors (UniProcExecutor, MultiprocExecutor) answer in every supported
        release: vLLM then enables asynchronous scheduling where a GPU would (config/vllm.py
        0.26.0:1059-1107) and the platform keeps that decision (kvrepro/engine/platform.py)."""
        return True

    def _init_executor(self) -> None:
        from vllm.platforms import current_platform

        import vllm

        self._vllm_version = getattr(vllm, "__version__", "?")
        try:
            entry = versions.settings_for(self._vllm_version)  # an unported release: the newest entry's settings
        except versions.UnsupportedRelease:
            entry = versions.Release(self._vllm_version)
        if entry.unported_from:
            logger.warning("kvrepro-sim: %s", versions.unported_note(self._vllm_version))
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
        # the offload tier's /dev/shm region, claimed before vLLM makes it so that kvrepro removes it
        # once this engine is gone, however it ends (kvrepro/engine/shm_region.py)
        shm_region.claim(getattr(self.vllm_config.kv_transfer_config, "engine_id", None))
        self._specs = self._build_kv_cache_specs()
        logger.info(
            "Sim executor: no GPU; fake model (draft acceptance rate %.2f, seed %d, step delay "
            "%.1f ms) and fake offload data movement (stores finish one step later, loads %d); "
            "asynchronous scheduling %s.",
            self.knobs.acceptance_rate, self.knobs.seed, self.knobs.step_delay_ms, self.knobs.load_steps,
            "on (batch queue of %d)" % self.vllm_config.max_concurrent_batches if self.async_scheduling else "off",
        )

    @property
    def async_scheduling(self) -> bool:
        return bool(getattr(self.vllm_config.scheduler_config, "async_scheduling", False))

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
            "num_speculative_tokens=%d data_parallel_rank=%d data_parallel_size=%d async_scheduling=%s",
            groups, block, block * self._chunk_blocks if self.connector is not None else "-",
            kv_cache_config.num_blocks, spec.num_speculative_tokens if spec is not None else 0,
            getattr(parallel, "data_parallel_rank", 0), getattr(parallel, "data_parallel_size", 1),
            "on" if self.async_scheduling else "off",
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
            transfers.blocks_per_chunk = self._chunk_blocks
            # multi-tier offloading: the CPU tier is the scheduler's shared region, whose rows vLLM's
            # secondary tiers copy to and from their storage (shadow.CpuRegion says why the sim writes
            # there); TieringOffloadingSpec names it by engine id (0.26.0-0.34.0 tiering/spec.py)
            engine_id, row_bytes = getattr(spec, "_engine_id", None), getattr(spec, "kv_bytes_per_chunk", None)
            if engine_id and engine_id != getattr(self.vllm_config.kv_transfer_config, "engine_id", None):
                shm_region.claim(engine_id)
            if self.shadow is not None and engine_id and row_bytes:
                self.shadow.region = shadow_kv.CpuRegion(f"/dev/shm/vllm_offload_{engine_id}.mmap", row_bytes)
            if self.shadow is not None:
                # the connector worker notes each load job's request before submitting it
                self.shadow.load_owner = lambda job_id: (getattr(worker_side, "_load_jobs", None) or {}).get(job_id)
            worker_side.worker = transfers
            if hasattr(type(worker_side), "_init_worker"):  # 0.34.0+: transfers are submitted as device pointers
                worker_side._kv_caches = block_index_caches(kv_cache_config)
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
        if self.runner is not None and self.runner.async_scheduling:
            stats = self.runner.async_stats
            logger.info("kvrepro-sim: async counts corrections=%d draft_fills=%d resyncs=%d mismatches=%d pid=%d",
                        stats["corrections"], stats["draft_fills"], stats["resyncs"], stats["mismatches"],
                        os.getpid())

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
            if self.shadow.region is not None:
                self.shadow.region.close()
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
