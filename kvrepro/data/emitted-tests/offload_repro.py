"""The skeleton of the test `kvrepro minimize --emit-pytest` writes (kvrepro/minimize/pytest_emit.py).

A Python module that linters and tests read like any other: the emitter parses it, replaces this
docstring and the module-level constants in the tree with a finding's values, binds each
``_NAME`` below (an emit-time setting, never in the written test) where it is used and folds
what it decides (``if _SHADOW_KV:`` keeps its body or its ``else``; ``a if _FLAG else b`` keeps
one side; ``**{...}`` of a literal dict becomes keywords), adds the release's KV-cache spec
imports, kvrepro/engine/device_pointers.py (``device_blocks``, ``block_index_caches``: the KV
caches 0.34.0+'s connector worker turns blocks into pointers with) and, for a corruption,
kvrepro's shadow KV (kvrepro/engine/shadow.py: ``ShadowKV``), each inlined as its syntax tree,
and writes the tree with ``ast.unparse``; what is written is parsed and compiled
again before it is kept. Comments here are not carried into the written test: what a reader
of the written test needs is in docstrings.
"""

import dataclasses
import json
import random
import tempfile
import zlib
from collections import deque
from pathlib import Path

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

# emit-time settings: each use is replaced by the finding's value, the assignments are dropped
_SHADOW_KV = False  # a corruption test: the shadow KV hooked in, test_no_wrong_kv_read
_OFFLOAD_HIT_TARGET = True  # the crash is the offload-hit one: check the sequence reached its state
_REQUIRE_OFFLOAD_HIT = False  # a corruption of a `+offload` kind: a clean run must have had an offload hit
_DTYPE = "auto"
_ENABLE_PREFIX_CACHING = True
_HASH_ALGO = "sha256"
_MAMBA_CACHE_KW: dict = {}  # {"mamba_cache_mode": ...} when the release has one
_MAX_NUM_SEQS = 1
_MAX_NUM_BATCHED_TOKENS = 1
_ENABLE_CHUNKED_PREFILL = True
_LONG_PREFILL_TOKEN_THRESHOLD = 0
_SPECULATIVE = False
_SPEC_METHOD = "mtp"
_NUM_SPECULATIVE_TOKENS = 1
_KV_CONNECTOR = "OffloadingConnector"
_KV_ROLE = "kv_both"
_KV_EXTRA: dict = {}
_DISABLE_HYBRID = False
_SCHEDULER_BLOCK_SIZE = 16
_HASH_BLOCK_SIZE = 16

# the finding's values, written as literals
MODEL_CONFIG: dict = {}
MAX_MODEL_LEN = 0
BLOCK_SIZE = 0
NUM_GPU_BLOCKS = 0
SEED = 0
DRAFT_ACCEPTANCE_RATE = 0.0
ASYNC_SCHEDULING = False
KV_CACHE_GROUPS: list = []
KV_CACHE_TENSORS: list = []
P: list[list[int]] = []
REQUESTS: list = []


def make_vllm_config(model_dir: str) -> VllmConfig:
    """The settings vLLM resolved for the run's `vllm serve` arguments. A GPU platform keeps the
    hybrid KV-cache manager on (without a platform vLLM turns it off, which here would only change
    how layers are grouped: the groups are given). vLLM's platform may overrule the engine mode
    (its CPU platform turns asynchronous scheduling off); run in another mode the sequence would
    not go through the run's scheduler states, hence the check."""
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype=_DTYPE)
    parallel_config = ParallelConfig()
    vllm_config = VllmConfig(
        model_config=model_config,
        parallel_config=parallel_config,
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=_ENABLE_PREFIX_CACHING,
                                 prefix_caching_hash_algo=_HASH_ALGO, **_MAMBA_CACHE_KW),
        scheduler_config=SchedulerConfig(
            max_num_seqs=_MAX_NUM_SEQS, max_num_batched_tokens=_MAX_NUM_BATCHED_TOKENS,
            max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False,
            enable_chunked_prefill=_ENABLE_CHUNKED_PREFILL,
            long_prefill_token_threshold=_LONG_PREFILL_TOKEN_THRESHOLD,
            async_scheduling=ASYNC_SCHEDULING),
        speculative_config=(SpeculativeConfig(method=_SPEC_METHOD, num_speculative_tokens=_NUM_SPECULATIVE_TOKENS,
                                              target_model_config=model_config,
                                              target_parallel_config=parallel_config)
                            if _SPECULATIVE else None),
        kv_transfer_config=KVTransferConfig(
            kv_connector=_KV_CONNECTOR, kv_role=_KV_ROLE, kv_connector_extra_config=_KV_EXTRA),
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = _DISABLE_HYBRID
    assert vllm_config.scheduler_config.async_scheduling == ASYNC_SCHEDULING, (
        f"vLLM resolved async_scheduling={vllm_config.scheduler_config.async_scheduling}, the run had "
        f"{ASYNC_SCHEDULING}: run the test without a platform plugin (VLLM_PLUGINS=) or on a GPU")
    return vllm_config


def make_tensor(size, layers, placement=None) -> KVCacheTensor:
    """The release's KVCacheTensor: up to 0.29 the layers sharing an allocation (shared_by); from
    0.30 the layers placed by strides and offset (the placement the engine built)."""
    if placement is None:
        return KVCacheTensor(size=size, shared_by=list(layers))
    return KVCacheTensor(size=size, layers=list(layers), **placement)


def make_kv_cache_config() -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_tensors=[make_tensor(*tensor) for tensor in KV_CACHE_TENSORS],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec) for layers, spec in KV_CACHE_GROUPS],
    )


class InstantOffloadingWorker(OffloadingWorker):
    """Moves no bytes: a load or store submitted in one step is reported done in the next. The
    shadow KV, when there is one, copies what the blocks hold at submission, as the real transfer
    would move it."""

    def __init__(self):
        self.submitted: list[int] = []
        self.done: list[int] = []

    def begin_step(self) -> None:
        self.done += self.submitted
        self.submitted = []

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        if _SHADOW_KV:
            self.shadow.store(job_id, device_blocks(src_spec), dst_spec)
        self.submitted.append(job_id)
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        """expedited (0.34.0+): a sync load the connector waits for within the step; all are instant here."""
        if _SHADOW_KV:
            self.shadow.load(job_id, src_spec, device_blocks(dst_spec))
        self.submitted.append(job_id)
        return True

    def wait(self, job_ids) -> None:
        """A flush: the named jobs finish now."""
        for job_id in job_ids:
            if job_id in self.submitted:
                self.submitted.remove(job_id)
                self.done.append(job_id)

    def get_finished(self) -> list[TransferResult]:
        done, self.done = sorted(set(self.done)), []
        return [TransferResult(job_id=job_id, success=True) for job_id in done]


class FakeModel:
    """What the GPU model runner would return: sampled tokens and MTP drafts, deterministic. With
    asynchronous scheduling it is one step ahead of the scheduler, as vLLM's V1 GPU model runner
    is (gpu_model_runner.py 0.26.0 _update_states :1340-1380, :1511-1541, _prepare_input_ids
    :1787-1890): see follow_async_scheduler. The shadow KV, when there is one, checks each
    forward's context and records what it writes."""

    def __init__(self, vocab_size: int, num_spec: int):
        self.vocab_size = vocab_size
        self.num_spec = num_spec
        self.rng = random.Random(SEED)
        self.tokens: dict[str, list[int]] = {}  # prompt + accepted output, per request
        self.keys: dict[str, int] = {}
        self.drafts: dict[str, list[int]] = {}
        self.prev_drafts: dict[str, list[int]] = {}  # asynchronous: the drafts of the previous step
        self.prev_batch: set[str] = set()  # the requests the previous step ran
        self.rejected: dict[str, int] = {}  # drafts each of them had rejected in that step

    def token(self, req_id: str, position: int) -> int:
        return (self.keys[req_id] * 1_000_003 + position * 7_919) % self.vocab_size

    def update_states(self, so) -> dict[str, int]:
        """Every step: forget finished requests, learn new ones; tokens computed per request."""
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
        computed = {}
        for new in so.scheduled_new_reqs:
            if new.req_id not in self.tokens:
                self.tokens[new.req_id] = list(new.prompt_token_ids)
                self.keys[new.req_id] = zlib.crc32(new.req_id.encode())
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        if _SHADOW_KV:
            self.shadow.update_requests(so)
        return computed

    def follow_async_scheduler(self, so, computed: dict[str, int]) -> None:
        """Asynchronous scheduling: the scheduler counted the previous step's drafts as accepted and
        sends -1 placeholders for the drafts to verify. A request the previous step ran gets its
        computed count lowered by the drafts that step rejected (and verifies the drafts proposed
        there, in forward); one that was not in it takes its tokens from the scheduler."""
        cached = so.scheduled_cached_reqs
        all_tokens = getattr(cached, "all_token_ids", None) or {}
        for req_id in cached.req_ids:
            if req_id in self.prev_batch:
                computed[req_id] -= self.rejected.get(req_id, 0)
            elif req_id in self.tokens and req_id in all_tokens:
                tokens = list(all_tokens[req_id])
                if tokens != self.tokens[req_id]:
                    self.tokens[req_id] = tokens
                    if _SHADOW_KV:
                        self.shadow.resync(req_id, tokens)
        self.prev_drafts, self.drafts = self.drafts, {}

    def idle(self) -> None:
        """A step with nothing scheduled: no batch runs, no draft is kept."""
        self.prev_batch, self.rejected = set(), {}

    def forward(self, so, computed: dict[str, int]) -> tuple[list[str], list[list[int]]]:
        """One forward: with asynchronous scheduling the -1 placeholders are this runner's own drafts
        of the previous step; a chunk of a longer prefill samples nothing; a rejected draft is
        replaced by another token. The shadow KV, when there is one, checks the context before the
        model samples, as the GPU-free engine's runner does."""
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        rejected: dict[str, int] = {}
        self.drafts = {}
        for req_id in req_ids:
            tokens = self.tokens[req_id]
            spec = so.scheduled_spec_decode_tokens.get(req_id) or []
            if ASYNC_SCHEDULING and spec and req_id in self.prev_batch:
                proposed = self.prev_drafts.get(req_id) or []
                spec = [proposed[n] if n < len(proposed) else draft for n, draft in enumerate(spec)]
            seq_end = computed[req_id] + so.num_scheduled_tokens[req_id] - len(spec)
            if _SHADOW_KV:
                self.shadow.forward(req_id, computed[req_id], so.num_scheduled_tokens[req_id], spec)
            if seq_end < len(tokens):
                sampled.append([])
                continue
            accepted = 0
            for draft in spec:
                if draft < 0 or self.rng.random() >= DRAFT_ACCEPTANCE_RATE:
                    break
                accepted += 1
            out = list(spec[:accepted])
            new = self.token(req_id, len(tokens) + accepted)
            if accepted < len(spec) and new == spec[accepted]:
                new = (new + 1) % self.vocab_size
            out.append(new)
            tokens.extend(out)
            if _SHADOW_KV:
                self.shadow.sampled(req_id, out, seq_end)
            rejected[req_id] = len(spec) - accepted
            sampled.append(out)
            if self.num_spec:
                self.drafts[req_id] = [self.token(req_id, len(tokens) + i) for i in range(self.num_spec)]
        self.prev_batch, self.rejected = set(req_ids), rejected
        return req_ids, sampled


def run_sequence(model_dir: str) -> (tuple[list[tuple[str, int, int]], ShadowKV] if _SHADOW_KV
                                     else list[tuple[str, int, int]]):
    ("Send REQUESTS one at a time, each stepped to completion as EngineCore's loop does. Returns the offload\n"
     + ("    hits (request id, local prefix-hit tokens, offloaded tokens to load) and the shadow KV, which has\n"
        "    checked every forward.\n\n" if _SHADOW_KV else
        "    hits: (request id, local prefix-hit tokens, offloaded tokens to load).\n\n")
     + "    The scheduler is the class EngineCore builds, the release's choice for the mode (AsyncScheduler\n"
       "    when asynchronous, SchedulerConfig.get_scheduler_cls, config/scheduler.py 0.26.0:180-188); EngineCore\n"
       "    keeps a batch queue when the release allows more than one batch in flight\n"
       "    (VllmConfig.max_concurrent_batches: 2 with asynchronous scheduling, config/vllm.py 0.26.0:512-522).")
    vllm_config = make_vllm_config(model_dir)
    kv_cache_config = make_kv_cache_config()
    scheduler = vllm_config.scheduler_config.get_scheduler_cls()(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=_SCHEDULER_BLOCK_SIZE,
        hash_block_size=_HASH_BLOCK_SIZE,
        log_stats=True,
    )
    worker_connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    connector_worker = worker_connector.connector_worker
    transfers = InstantOffloadingWorker()
    connector_worker.worker = transfers
    if hasattr(type(connector_worker), "_init_worker"):  # 0.34.0+: transfers are submitted as device pointers
        connector_worker._kv_caches = block_index_caches(kv_cache_config)
    spec_config = vllm_config.speculative_config
    model = FakeModel(vllm_config.model_config.get_vocab_size(),
                      spec_config.num_speculative_tokens if spec_config is not None else 0)
    if _SHADOW_KV:
        # offloaded chunks of blocks_per_chunk GPU blocks, as the connector's offloading spec has them
        shadow = ShadowKV(kv_cache_config, blocks_per_chunk=connector_worker.spec.blocks_per_chunk)
        atexit.unregister(shadow.report)
        shadow.load_owner = lambda job_id: connector_worker._load_jobs.get(job_id)
        transfers.shadow = shadow
        model.shadow = shadow

    hits: list[tuple[str, int, int]] = []
    connector = scheduler.connector
    lookup = connector.get_num_new_matched_tokens

    def recorded_lookup(request, num_computed_tokens):
        num_external, is_async = lookup(request, num_computed_tokens)
        if num_external:
            hits.append((request.request_id, num_computed_tokens, num_external))
        return num_external, is_async

    connector.get_num_new_matched_tokens = recorded_lookup

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    block_hasher = get_request_block_hasher(_HASH_BLOCK_SIZE, hash_fn)

    def schedule(i: int):
        """The bug's AssertionError is raised in scheduler.schedule(): it is told which request."""
        try:
            return scheduler.schedule()
        except AssertionError as exc:
            exc.add_note(f"scheduling request {i} of {len(REQUESTS)} (req-{i})")
            raise

    def execute(so) -> tuple[ModelRunnerOutput, bool]:
        """The worker side of one step, in the order the GPU model runner drives it, and the
        model's output; whether a forward ran. It runs when the step is scheduled (a GPU queues
        a step's kernels behind the previous step's, so reads and writes happen in this order).
        req_id_to_index is gone from 0.34.0's ModelRunnerOutput (v1/outputs.py 0.34.0:268-306)."""
        transfers.begin_step()
        worker_connector.handle_preemptions(so.kv_connector_metadata)
        computed = model.update_states(so)
        if ASYNC_SCHEDULING:
            model.follow_async_scheduler(so, computed)
        worker_connector.bind_connector_metadata(so.kv_connector_metadata)
        worker_connector.start_load_kv(None)
        executed = so.total_num_scheduled_tokens > 0
        req_ids, sampled = model.forward(so, computed) if executed else ([], [])
        if executed:
            worker_connector.wait_for_save()
        else:
            model.idle()
        finished_sending, finished_recving = worker_connector.get_finished(so.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=finished_sending, finished_recving=finished_recving,
            invalid_block_ids=worker_connector.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=worker_connector.build_connector_worker_meta())
        worker_connector.clear_connector_metadata()
        if executed:
            index = ({"req_id_to_index": {r: n for n, r in enumerate(req_ids)}}
                     if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)} else {})
            output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_output,
                                       **index)
        else:
            output = ModelRunnerOutput.with_kv_conn_output_only(kv_output)
        return output, executed

    def step(i: int) -> None:
        """EngineCore.step then post_step (vllm/v1/engine/core.py 0.26.0:576-615): schedule,
        execute, process the output, hand the drafts to the scheduler."""
        so = schedule(i)
        output, executed = execute(so)
        scheduler.update_from_output(so, output)
        if executed and model.drafts:
            drafts, model.drafts = model.drafts, {}
            scheduler.update_draft_token_ids(DraftTokenIds(list(drafts), list(drafts.values())))

    batch_queue_size = vllm_config.max_concurrent_batches
    batch_queue: deque | None = deque(maxlen=batch_queue_size) if batch_queue_size > 1 else None

    def step_with_batch_queue(i: int) -> None:
        """EngineCore.step_with_batch_queue's order (vllm/v1/engine/core.py 0.26.0:617-731): a new
        step is scheduled and executed while the queue has room, before the output of the step in
        flight is processed; only a full queue (or nothing more to schedule) processes the oldest.
        post_step hands no drafts over: the runner keeps them (core.py 0.26.0:608-615)."""
        if scheduler.has_requests():
            so = schedule(i)
            output, executed = execute(so)
            batch_queue.appendleft((so, output))
            if len(batch_queue) < batch_queue_size and (executed or scheduler.has_requests()):
                return
        elif not batch_queue:
            return
        so, output = batch_queue.pop()
        scheduler.update_from_output(so, output)

    step_fn = step if batch_queue is None else step_with_batch_queue
    for i, (max_tokens, prompt, *event) in enumerate(REQUESTS):
        scheduler.add_request(Request(
            request_id=f"req-{i}", prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            pooling_params=None, arrival_time=float(i), block_hasher=block_hasher))
        if event == ["abort-queued"]:  # what the server does when the client's connection closes
            scheduler.finish_requests(f"req-{i}", RequestStatus.FINISHED_ABORTED)
        for _ in range(100_000):
            # EngineCore's loop: step while the scheduler has requests or a batch is in flight
            if not (scheduler.has_requests() or batch_queue):
                break
            step_fn(i)
        else:
            raise RuntimeError(f"request {i} did not finish within 100000 steps")
    return (hits, shadow) if _SHADOW_KV else hits


if _SHADOW_KV:
    def wrong_kv(shadow: ShadowKV) -> str:
        """The shadow KV's violations in words: the first of each kind (KV group kind, +offload
        when the request had an offload hit), with the step it was seen at."""
        first: dict[str, dict] = {}
        for record in shadow.records:
            first.setdefault(record["kind"], record)
        lines = [f"a forward read wrong KV: {shadow.violations} violation(s) in {shadow.checks} checked contexts; "
                 f"the first of each kind:"]
        lines += [f"[{kind}] step {r['step']}: {r['text']}" for kind, r in first.items()]
        return "\n".join(lines)

    def test_no_wrong_kv_read(tmp_path):
        """Fails when a forward reads KV its request's context does not have; a clean run of a
        `+offload` kind must also have gone through an offload hit."""
        (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
        hits, shadow = run_sequence(str(tmp_path))
        assert shadow.checks > 0, "the shadow KV checked no forward"
        assert not shadow.violations, wrong_kv(shadow)
        if _REQUIRE_OFFLOAD_HIT:
            assert hits, "no offload hit: the sequence did not exercise the OffloadingConnector's loads"
else:
    def test_offload_hit_behind_partial_local_hit(tmp_path):
        ("Without the bug the sequence runs through; it must still have reached the bug's state."
         if _OFFLOAD_HIT_TARGET else
         "Another target than the offload-hit path: running through is the pass.")
        (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
        hits = run_sequence(str(tmp_path))
        if _OFFLOAD_HIT_TARGET:
            assert any(local > 0 for _, local, _ in hits), f"no offload hit behind a local prefix hit: {hits}"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        if _SHADOW_KV:
            test_no_wrong_kv_read(Path(folder))
        else:
            test_offload_hit_behind_partial_local_hit(Path(folder))
    print("passed: every forward read the KV its request needs" if _SHADOW_KV else "passed: the sequence ran through")
