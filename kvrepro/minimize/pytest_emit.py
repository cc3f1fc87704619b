"""Write a minimized trace as a standalone pytest that drives vLLM's scheduler with it.

The emitted file is meant to be attached to an upstream pull request, in the style of vLLM's
``tests/v1/kv_connector/unit/offloading_connector/`` tests: it imports only vLLM, torch and
pytest (no kvrepro), builds vLLM's ``Scheduler`` from a hand-made ``VllmConfig`` and
``KVCacheConfig``, and steps it with fake model-runner outputs. What runs for real is all of
vLLM above the model runner: the scheduler, the KV-cache manager with its hybrid groups, the
spec-decode bookkeeping, the ``OffloadingConnector``'s scheduler side (with its CPU offloading
manager; it holds the assertion) and its worker side. Faked, exactly as kvrepro's GPU-free
executor fakes them, so the scheduling is step for step the engine's:

* the model: token values are a function of request and position; each scheduled MTP draft is
  accepted with the matrix's rate from a ``random.Random(seed)`` (the engine's seed for that
  repetition); a prefill chunk samples nothing; drafts are proposed after each sampled step;
* the offload data movement: an ``OffloadingWorker`` that moves no bytes and reports each job
  finished at the next step (the sim executor's ``SimTransferWorker``).

The test steps the scheduler in the engine mode the finding's run used (``async_scheduling`` as
vLLM resolved it for that run, :func:`kvrepro.engine.offline.describe`): synchronous, as
``EngineCore.step`` does; or asynchronous, as a GPU node runs this engine by default: the
scheduler class the release picks (``AsyncScheduler``), a batch queue of the release's
``max_concurrent_batches`` driven in ``EngineCore.step_with_batch_queue``'s order (a step is
scheduled and executed before the previous step's output is processed), and the fake runner one
step behind the scheduler as kvrepro's ``SimRunner`` (and vLLM's V1 GPU runner) is: the ``-1``
draft placeholders replaced by its own drafts, ``num_computed_tokens`` lowered by the previous
step's rejected drafts. Driving an asynchronous finding synchronously ran another sequence of
scheduler states: the minimizer's 4-request cut of 0.26.0's crash reached no offload hit at all.

The geometry is not re-derived: the minimizer's offline engine reports the settings vLLM
resolved from the matrix's ``vllm serve`` arguments and the KV-cache groups it built
(:func:`kvrepro.engine.offline.describe`), and they are written into the test as literals.

The test has no assertion about the bug: on a build with it, vLLM's own assertion fails inside
``Scheduler.schedule()``. It does assert that the sequence reached the bug's state (an offload
hit behind a local prefix hit), so a fixed build passes only by going through that state.

For a **corruption** (``violation=``: the engine served, but a forward read wrong KV), the test
also carries kvrepro's shadow KV: the source of :mod:`kvrepro.engine.shadow` (stdlib only) is
inlined verbatim at emit time, so the test and the engine check with the same code. It is
hooked where the GPU-free executor hooks it: the runner's request table and each request's
forward (``FakeModel``), the sampled tokens, and the offload stores and loads
(``InstantOffloadingWorker``). The test fails with an assertion that names, for the first
violation of each kind, the request, KV group, block index, GPU block, positions and what the
block holds instead; it passes when every checked context was right (and an offload hit
happened).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pprint
import re
import signal
import subprocess
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..loadgen.trace import Trace
from ..spec.matrix import LoadedMatrix

_TEMPLATE = '''"""Regression test: vLLM {base}, {exception} in {function}.

{expression_line}A KV-offloading request whose offload hit sits behind a partial local (GPU prefix-cache) hit,
on a hybrid model (Gated-DeltaNet Mamba groups + a full-attention group, Mamba cache mode
{mamba_cache_mode!r}, MTP with {num_spec} speculative {token_word}). The sequence below is {requests} requests
({tokens} prompt tokens), sent one at a time, each run to completion before the next; kvrepro
minimized it from a load run that crashed the engine ({source}).

{mode_doc}

It drives vLLM's Scheduler, KV-cache manager and OffloadingConnector (scheduler side with the
real CPU offloading manager, and worker side) directly. Faked: the model (sampled and draft
tokens are deterministic; drafts are accepted with probability {acceptance} from a seeded RNG)
and the offload data movement (a job is reported finished one step after it is submitted). The
test has no assertion about the bug: with it, vLLM's assertion fails inside schedule(); with a
fix the sequence runs through, and the test checks it did reach the offload-hit-behind-a-local-
hit state.

Needs only vLLM (no GPU) and torch; pytest is optional. Run it as a script, with a build's vLLM
first on PYTHONPATH (exit 1 with vLLM's traceback when the bug fires, 0 when it runs through):
{run_lines}
(VLLM_PLUGINS= keeps vLLM from loading the platform plugin kvrepro's overlays carry), or under
pytest, in an environment that has vLLM and pytest: `python -m pytest -q {name}`.
"""

import dataclasses
import json
import random
import tempfile
import zlib
from collections import deque
from pathlib import Path

{imports}

# A tiny Qwen3-Next: {layers}. No weights are loaded.
MODEL_CONFIG = {model_config}

MAX_MODEL_LEN = {max_model_len}
BLOCK_SIZE = {block_size}
NUM_GPU_BLOCKS = {num_gpu_blocks}
SEED = {seed}
DRAFT_ACCEPTANCE_RATE = {acceptance}
# the engine mode of the run this sequence comes from (see the docstring)
ASYNC_SCHEDULING = {async_scheduling}

# The KV-cache groups vLLM {vllm} builds for this model with these settings.
KV_CACHE_GROUPS = [
{groups}
]
KV_CACHE_TENSORS = [
{tensors}
]

# (max_tokens, prompt token ids[, "abort-queued"]), in the order they are sent; P[i] is request i's
# prompt; "abort-queued": the client gave up on it while it waited, before it was ever scheduled
P: list[list[int]] = []
{prompts}
REQUESTS = [{request_list}]


def make_vllm_config(model_dir: str) -> VllmConfig:
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True,
                               max_model_len=MAX_MODEL_LEN, dtype={dtype!r})
    parallel_config = ParallelConfig()
    vllm_config = VllmConfig(
        model_config=model_config,
        parallel_config=parallel_config,
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching={enable_prefix_caching},
                                 prefix_caching_hash_algo={hash_algo!r}{mamba_cache_kw}),
        scheduler_config=SchedulerConfig(
            max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens},
            max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False,
            enable_chunked_prefill={enable_chunked_prefill},
            long_prefill_token_threshold={long_prefill_token_threshold},
            async_scheduling=ASYNC_SCHEDULING),
        speculative_config={speculative_config},
        kv_transfer_config=KVTransferConfig(
            kv_connector={kv_connector!r}, kv_role={kv_role!r},
            kv_connector_extra_config={kv_extra!r}),
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    # a GPU platform keeps the hybrid KV-cache manager on; without a platform vLLM turns it off,
    # which here only changes how layers would be grouped (the groups are given below)
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = {disable_hybrid}
    # vLLM's platform may overrule the mode (its CPU platform turns asynchronous scheduling off);
    # run in another mode, the sequence would not go through the run's scheduler states
    assert vllm_config.scheduler_config.async_scheduling == ASYNC_SCHEDULING, (
        f"vLLM resolved async_scheduling={{vllm_config.scheduler_config.async_scheduling}}, the run had "
        f"{{ASYNC_SCHEDULING}}: run the test without a platform plugin (VLLM_PLUGINS=) or on a GPU")
    return vllm_config


def make_tensor(size, layers, placement=None) -> KVCacheTensor:
    # vLLM {vllm}'s KVCacheTensor: up to 0.29 the layers sharing an allocation (shared_by); from 0.30
    # the layers placed by strides and offset (the placement the engine built)
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
    """Moves no bytes: a load or store submitted in one step is reported done in the next."""

    def __init__(self):
        self.submitted: list[int] = []
        self.done: list[int] = []

    def begin_step(self) -> None:
        self.done += self.submitted
        self.submitted = []

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        self.submitted.append(job_id)
        return True

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        self.submitted.append(job_id)
        return True

    def wait(self, job_ids) -> None:  # a flush: the named jobs finish now
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
    :1787-1890): see follow_async_scheduler."""

    def __init__(self, vocab_size: int, num_spec: int):
        self.vocab_size = vocab_size
        self.num_spec = num_spec
        self.rng = random.Random(SEED)
        self.tokens: dict[str, list[int]] = {{}}  # prompt + accepted output, per request
        self.keys: dict[str, int] = {{}}
        self.drafts: dict[str, list[int]] = {{}}
        self.prev_drafts: dict[str, list[int]] = {{}}  # asynchronous: the drafts of the previous step
        self.prev_batch: set[str] = set()  # the requests the previous step ran
        self.rejected: dict[str, int] = {{}}  # drafts each of them had rejected in that step

    def token(self, req_id: str, position: int) -> int:
        return (self.keys[req_id] * 1_000_003 + position * 7_919) % self.vocab_size

    def update_states(self, so) -> dict[str, int]:
        """Every step: forget finished requests, learn new ones; tokens computed per request."""
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
        computed = {{}}
        for new in so.scheduled_new_reqs:
            if new.req_id not in self.tokens:
                self.tokens[new.req_id] = list(new.prompt_token_ids)
                self.keys[new.req_id] = zlib.crc32(new.req_id.encode())
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        return computed

    def follow_async_scheduler(self, so, computed: dict[str, int]) -> None:
        """Asynchronous scheduling: the scheduler counted the previous step's drafts as accepted and
        sends -1 placeholders for the drafts to verify. A request the previous step ran gets its
        computed count lowered by the drafts that step rejected (and verifies the drafts proposed
        there, in forward); one that was not in it takes its tokens from the scheduler."""
        cached = so.scheduled_cached_reqs
        all_tokens = getattr(cached, "all_token_ids", None) or {{}}
        for req_id in cached.req_ids:
            if req_id in self.prev_batch:
                computed[req_id] -= self.rejected.get(req_id, 0)
            elif req_id in self.tokens and req_id in all_tokens:
                tokens = list(all_tokens[req_id])
                if tokens != self.tokens[req_id]:
                    self.tokens[req_id] = tokens
        self.prev_drafts, self.drafts = self.drafts, {{}}

    def idle(self) -> None:
        """A step with nothing scheduled: no batch runs, no draft is kept."""
        self.prev_batch, self.rejected = set(), {{}}

    def forward(self, so, computed: dict[str, int]) -> tuple[list[str], list[list[int]]]:
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        rejected: dict[str, int] = {{}}
        self.drafts = {{}}
        for req_id in req_ids:
            tokens = self.tokens[req_id]
            spec = so.scheduled_spec_decode_tokens.get(req_id) or []
            if ASYNC_SCHEDULING and spec and req_id in self.prev_batch:
                # the -1 placeholders are this runner's own drafts of the previous step
                proposed = self.prev_drafts.get(req_id) or []
                spec = [proposed[n] if n < len(proposed) else draft for n, draft in enumerate(spec)]
            if computed[req_id] + so.num_scheduled_tokens[req_id] - len(spec) < len(tokens):
                sampled.append([])  # a chunk of a longer prefill samples nothing
                continue
            accepted = 0
            for draft in spec:
                if draft < 0 or self.rng.random() >= DRAFT_ACCEPTANCE_RATE:
                    break
                accepted += 1
            out = list(spec[:accepted])
            new = self.token(req_id, len(tokens) + accepted)
            if accepted < len(spec) and new == spec[accepted]:
                new = (new + 1) % self.vocab_size  # a rejected draft is replaced by another token
            out.append(new)
            tokens.extend(out)
            rejected[req_id] = len(spec) - accepted
            sampled.append(out)
            if self.num_spec:
                self.drafts[req_id] = [self.token(req_id, len(tokens) + i) for i in range(self.num_spec)]
        self.prev_batch, self.rejected = set(req_ids), rejected
        return req_ids, sampled


def run_sequence(model_dir: str) -> list[tuple[str, int, int]]:
    """Send REQUESTS one at a time, each stepped to completion as EngineCore's loop does.
    Returns the offload hits: (request id, local prefix-hit tokens, offloaded tokens to load)."""
    vllm_config = make_vllm_config(model_dir)
    kv_cache_config = make_kv_cache_config()
    # the class EngineCore builds: the release's choice for the mode (AsyncScheduler when
    # asynchronous, SchedulerConfig.get_scheduler_cls, config/scheduler.py 0.26.0:180-188)
    scheduler = vllm_config.scheduler_config.get_scheduler_cls()(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size={scheduler_block_size},
        hash_block_size={hash_block_size},
        log_stats=True,
    )
    worker_connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    transfers = InstantOffloadingWorker()
    worker_connector.connector_worker.worker = transfers
    spec_config = vllm_config.speculative_config
    model = FakeModel(vllm_config.model_config.get_vocab_size(),
                      spec_config.num_speculative_tokens if spec_config is not None else 0)

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
    block_hasher = get_request_block_hasher({hash_block_size}, hash_fn)

    def schedule(i: int):
        try:
            return scheduler.schedule()  # <- the bug's AssertionError is raised in here
        except AssertionError as exc:
            exc.add_note(f"scheduling request {{i}} of {{len(REQUESTS)}} (req-{{i}})")
            raise

    def execute(so) -> tuple[ModelRunnerOutput, bool]:
        """The worker side of one step, in the order the GPU model runner drives it, and the
        model's output; whether a forward ran. It runs when the step is scheduled (a GPU queues
        a step's kernels behind the previous step's, so reads and writes happen in this order)."""
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
            # req_id_to_index is gone from 0.34.0's ModelRunnerOutput (v1/outputs.py 0.34.0:268-306)
            index = ({{"req_id_to_index": {{r: n for n, r in enumerate(req_ids)}}}}
                     if "req_id_to_index" in {{f.name for f in dataclasses.fields(ModelRunnerOutput)}} else {{}})
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
            drafts, model.drafts = model.drafts, {{}}
            scheduler.update_draft_token_ids(DraftTokenIds(list(drafts), list(drafts.values())))

    # EngineCore keeps a batch queue when the release allows more than one batch in flight
    # (VllmConfig.max_concurrent_batches: 2 with asynchronous scheduling, config/vllm.py 0.26.0:512-522)
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
            request_id=f"req-{{i}}", prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            pooling_params=None, arrival_time=float(i), block_hasher=block_hasher))
        if event == ["abort-queued"]:  # what the server does when the client's connection closes
            scheduler.finish_requests(f"req-{{i}}", RequestStatus.FINISHED_ABORTED)
        for _ in range(100_000):
            # EngineCore's loop: step while the scheduler has requests or a batch is in flight
            if not (scheduler.has_requests() or batch_queue):
                break
            step_fn(i)
        else:
            raise RuntimeError(f"request {{i}} did not finish within 100000 steps")
    return hits


def test_offload_hit_behind_partial_local_hit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    hits = run_sequence(str(tmp_path))
    # without the bug the sequence runs through; it must still have reached the bug's state
    assert any(local > 0 for _, local, _ in hits), f"no offload hit behind a local prefix hit: {{hits}}"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        test_offload_hit_behind_partial_local_hit(Path(folder))
    print("passed: the sequence ran through")
'''


_CORRUPT_DOC = '''"""Regression test: vLLM {base} reads wrong KV ({violation}) under KV offloading.

{situation},
on a hybrid model (Gated-DeltaNet Mamba groups + a full-attention group, Mamba cache mode
{mamba_cache_mode!r}, MTP with {num_spec} speculative {token_word}). The sequence below is {requests} requests
({tokens} prompt tokens), sent one at a time, each run to completion before the next; kvrepro
minimized it from a load run in which the engine served every request, but a forward read KV
that its request's context does not have ({source}).

{mode_doc}

It drives vLLM's Scheduler, KV-cache manager and OffloadingConnector (scheduler side with the
real CPU offloading manager, and worker side) directly. Faked: the model (sampled and draft
tokens are deterministic; drafts are accepted with probability {acceptance} from a seeded RNG)
and the offload data movement (a job is reported finished one step after it is submitted).

Nothing computes KV here, so the test keeps a *shadow KV* (kvrepro's, inlined below): for every
GPU block and every offloaded block, which tokens' KV it would hold (a token's KV is named by a
hash of the token prefix it was computed from), written by each forward where vLLM's GPU model
runner writes it and copied by each offload store and load as the CPU offloading worker copies
it. Before every forward it checks that each scheduled request's context below its computed
count is there: every position of a full-attention group, and for a Mamba `align` group the
state after exactly the computed prefix, in the block the runner reads it from. The test fails
when a forward would read wrong KV, naming the request, group, block index, GPU block, positions
and what the block holds instead. Seen with vLLM {base} (kvrepro's offline engine, same code):

    {first_violation}

With a fix the sequence runs clean{reach_doc}.

Needs only vLLM (no GPU) and torch; pytest is optional. Run it as a script, with a build's vLLM
first on PYTHONPATH (exit 1 with the assertion when a forward reads wrong KV, 0 when clean):
{run_lines}
(VLLM_PLUGINS= keeps vLLM from loading the platform plugin kvrepro's overlays carry), or under
pytest, in an environment that has vLLM and pytest: `python -m pytest -q {name}`.
"""

from __future__ import annotations
'''

_STDLIB_IMPORTS = """import json
import random
import tempfile
import zlib
from collections import deque
from pathlib import Path
"""

_CORRUPT_EDITS = [
    (_STDLIB_IMPORTS, "{stdlib_imports}\n"),
    # the shadow KV, after the imports (its own stdlib imports join the test's)
    ("""{imports}
""", """{imports}

{shadow_source}
"""),
    ("""class InstantOffloadingWorker(OffloadingWorker):
    \"\"\"Moves no bytes: a load or store submitted in one step is reported done in the next.\"\"\"

    def __init__(self):
        self.submitted: list[int] = []""", """class InstantOffloadingWorker(OffloadingWorker):
    \"\"\"Moves no bytes: a load or store submitted in one step is reported done in the next. The
    shadow KV copies what the blocks hold at submission, as the real transfer would move it.\"\"\"

    def __init__(self, shadow: ShadowKV):
        self.shadow = shadow
        self.submitted: list[int] = []"""),
    ("""    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        self.submitted.append(job_id)""", """    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        self.shadow.store(job_id, src_spec, dst_spec)
        self.submitted.append(job_id)"""),
    ("""    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        self.submitted.append(job_id)""", """    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        self.shadow.load(job_id, src_spec, dst_spec)
        self.submitted.append(job_id)"""),
    ("""    def __init__(self, vocab_size: int, num_spec: int):
        self.vocab_size = vocab_size""", """    def __init__(self, vocab_size: int, num_spec: int, shadow: ShadowKV):
        self.shadow = shadow  # checks each forward's context, records what it writes
        self.vocab_size = vocab_size"""),
    ("""        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        return computed""", """        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        self.shadow.update_requests(so)
        return computed"""),
    ("""            if computed[req_id] + so.num_scheduled_tokens[req_id] - len(spec) < len(tokens):
                sampled.append([])""", """            seq_end = computed[req_id] + so.num_scheduled_tokens[req_id] - len(spec)
            # before the forward: is its context really in the KV cache?
            self.shadow.forward(req_id, computed[req_id], so.num_scheduled_tokens[req_id], spec)
            if seq_end < len(tokens):
                sampled.append([])"""),
    ("""            tokens.extend(out)
            rejected[req_id]""", """            tokens.extend(out)
            self.shadow.sampled(req_id, out, seq_end)
            rejected[req_id]"""),
    ("""                if tokens != self.tokens[req_id]:
                    self.tokens[req_id] = tokens""", """                if tokens != self.tokens[req_id]:
                    self.tokens[req_id] = tokens
                    self.shadow.resync(req_id, tokens)"""),
    ("""def run_sequence(model_dir: str) -> list[tuple[str, int, int]]:
    \"\"\"Send REQUESTS one at a time, each stepped to completion as EngineCore's loop does.
    Returns the offload hits: (request id, local prefix-hit tokens, offloaded tokens to load).\"\"\"""",
     """def run_sequence(model_dir: str) -> tuple[list[tuple[str, int, int]], ShadowKV]:
    \"\"\"Send REQUESTS one at a time, each stepped to completion as EngineCore's loop does.
    Returns the offload hits (request id, local prefix-hit tokens, offloaded tokens to load) and
    the shadow KV, which has checked every forward.\"\"\""""),
    ("""    transfers = InstantOffloadingWorker()
    worker_connector.connector_worker.worker = transfers
    spec_config = vllm_config.speculative_config
    model = FakeModel(vllm_config.model_config.get_vocab_size(),
                      spec_config.num_speculative_tokens if spec_config is not None else 0)""",
     """    connector_worker = worker_connector.connector_worker
    # offloaded chunks of blocks_per_chunk GPU blocks, as the connector's offloading spec has them
    shadow = ShadowKV(kv_cache_config, blocks_per_chunk=connector_worker.spec.blocks_per_chunk)
    atexit.unregister(shadow.report)  # the test reports through its assertion, not at exit
    shadow.load_owner = lambda job_id: connector_worker._load_jobs.get(job_id)  # the request a load is for
    transfers = InstantOffloadingWorker(shadow)
    connector_worker.worker = transfers
    spec_config = vllm_config.speculative_config
    model = FakeModel(vllm_config.model_config.get_vocab_size(),
                      spec_config.num_speculative_tokens if spec_config is not None else 0, shadow)"""),
    ("""            raise RuntimeError(f"request {{i}} did not finish within 100000 steps")
    return hits
""", """            raise RuntimeError(f"request {{i}} did not finish within 100000 steps")
    return hits, shadow
"""),
    ("""def test_offload_hit_behind_partial_local_hit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    hits = run_sequence(str(tmp_path))
    # without the bug the sequence runs through; it must still have reached the bug's state
    assert any(local > 0 for _, local, _ in hits), f"no offload hit behind a local prefix hit: {{hits}}"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        test_offload_hit_behind_partial_local_hit(Path(folder))
    print("passed: the sequence ran through")
""", """def wrong_kv(shadow: ShadowKV) -> str:
    \"\"\"The shadow KV's violations in words: the first of each kind (KV group kind, +offload
    when the request had an offload hit), with the step it was seen at.\"\"\"
    first: dict[str, dict] = {{}}
    for record in shadow.records:
        first.setdefault(record["kind"], record)
    lines = [f"a forward read wrong KV: {{shadow.violations}} violation(s) in {{shadow.checks}} checked contexts; "
             f"the first of each kind:"]
    lines += [f"[{{kind}}] step {{r['step']}}: {{r['text']}}" for kind, r in first.items()]
    return "\\n".join(lines)


def test_no_wrong_kv_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    hits, shadow = run_sequence(str(tmp_path))
    assert shadow.checks > 0, "the shadow KV checked no forward"
    assert not shadow.violations, wrong_kv(shadow)
{reach_assert}

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        test_no_wrong_kv_read(Path(folder))
    print("passed: every forward read the KV its request needs")
"""),
]


def corruption_marker(violation: str) -> str:
    """How the emitted corruption test's assertion message tags the first violation of a kind."""
    return f"[{violation}] "


def _template(violation: str | None) -> str:
    """The crash test's template, or (``violation``) the corruption test's: the crash template
    with the shadow KV hooked in (each edit applies to exactly one place)."""
    if not violation:
        return _TEMPLATE
    head, sep, code = _TEMPLATE.partition('"""\n\nimport dataclasses\nimport json\n')
    assert sep, "the template's docstring ends before its imports"
    text = _CORRUPT_DOC + "\nimport dataclasses\nimport json\n" + code
    for old, new in _CORRUPT_EDITS:
        assert text.count(old) == 1, f"template edit does not apply once: {old[:60]!r}"
        text = text.replace(old, new)
    return text


def shadow_source() -> tuple[str, list[str]]:
    """kvrepro/engine/shadow.py as inlined into a corruption test: its code without the module
    docstring and imports, under a header naming the file and its sha256; and its imports
    (stdlib), for the test's import block."""
    from ..engine import shadow

    path = Path(shadow.__file__)
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    lines = text.splitlines()
    imports, start, doc = [], 0, ""
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            start, doc = node.end_lineno, node.value.value
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                imports.append(ast.get_source_segment(text, node))
            start = node.end_lineno
            continue
        break
    body = "\n".join(lines[start:]).strip("\n")
    digest = hashlib.sha256(text.encode()).hexdigest()
    bar = "# " + "-" * 98
    # its docstring (what it models, per vLLM's runner and offloading worker) as a comment
    commented = "\n".join(("# " + line).rstrip() for line in doc.strip().splitlines())
    header = (f"{bar}\n# Shadow KV: kvrepro/engine/shadow.py (sha256 {digest[:16]}), inlined verbatim at emit time:\n"
              f"# the code kvrepro's GPU-free engine checks every forward with. Its docstring:\n#\n"
              f"{commented}\n{bar}")
    return f"{header}\n\n{body}\n\n{bar}", imports


def _prompts_source(prompts: list[list[int]], width: int = 100) -> list[str]:
    """``P.append(P[j][:n] + [...])`` per prompt: the longest prefix shared with an earlier
    prompt is written as a slice of it (shared prefixes are what the bug is about), the rest as
    literal token ids."""
    lines = []
    for i, tokens in enumerate(prompts):
        best_n, best_j = 0, None
        for j in range(i):
            other, n = prompts[j], 0
            limit = min(len(tokens), len(other))
            while n < limit and tokens[n] == other[n]:
                n += 1
            if n > best_n:
                best_n, best_j = n, j
        rest = tokens[best_n:]
        head = f"P[{best_j}][:{best_n}]" if best_j is not None and best_n >= 16 else None
        if head is None:
            rest = tokens
        literal = ", ".join(str(t) for t in rest)
        wrapped = _wrap(literal, width, indent="    ")
        count = f"{len(tokens)} token" + ("" if len(tokens) == 1 else "s")
        if head and not rest:
            lines.append(f"P.append({head})  # {i}: {count}")
        elif head:
            lines.append(f"P.append({head} + [  # {i}: {count}, {best_n} shared with {best_j}\n{wrapped}\n])")
        else:
            lines.append(f"P.append([  # {i}: {count}\n{wrapped}\n])")
    return lines


def _wrap(literal: str, width: int, indent: str) -> str:
    out, line = [], indent
    for part in literal.split(" "):
        if len(line) + len(part) + 1 > width and line.strip():
            out.append(line.rstrip())
            line = indent
        line += part + " "
    if line.strip():
        out.append(line.rstrip())
    return "\n".join(out)


def _wrap_call(source: str, indent: int, width: int = 100) -> str:
    """``Spec(a=1, b=2, ...)`` over several lines when it is wider than ``width``."""
    if indent + len(source) <= width:
        return source
    head, _, args = source.partition("(")
    parts = re.split(r",\s(?=\w+=)", args[:-1])
    pad = " " * (indent + 4)
    lines, line = [], pad
    for part in parts:
        piece = part + ", "
        if len(line) + len(piece) > width and line.strip():
            lines.append(line.rstrip())
            line = pad
        line += piece
    lines.append(line.rstrip().rstrip(","))
    return head + "(\n" + "\n".join(lines) + ")"


def _layers_summary(config: dict[str, Any]) -> str:
    kinds = config.get("layer_types") or []
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    parts = [f"{n} {kind.replace('_', ' ')}" for kind, n in counts.items()]
    mtp = config.get("num_nextn_predict_layers")
    if mtp:
        parts.append(f"{mtp} MTP")
    return " + ".join(parts) + " layers" if parts else "hybrid layers"


_BASE_IMPORTS = [
    "vllm.SamplingParams",
    *(f"vllm.config.{n}" for n in ("CacheConfig", "DeviceConfig", "KVTransferConfig", "ModelConfig",
                                     "ParallelConfig", "SchedulerConfig", "SpeculativeConfig", "VllmConfig")),
    "vllm.distributed.kv_transfer.kv_connector.v1.KVConnectorRole",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector.OffloadingConnector",
    "vllm.utils.hashing.get_hash_fn_by_name",
    "vllm.v1.core.kv_cache_utils.get_request_block_hasher",
    "vllm.v1.core.kv_cache_utils.init_none_hash",
    "vllm.v1.kv_cache_interface.KVCacheConfig",
    "vllm.v1.kv_cache_interface.KVCacheGroupSpec",
    "vllm.v1.kv_cache_interface.KVCacheTensor",
    "vllm.v1.kv_offload.base.OffloadingWorker",
    "vllm.v1.kv_offload.base.TransferResult",
    "vllm.v1.outputs.DraftTokenIds",
    "vllm.v1.outputs.KVConnectorOutput",
    "vllm.v1.outputs.ModelRunnerOutput",
    "vllm.v1.request.Request",
    "vllm.v1.request.RequestStatus",
    "vllm.v1.structured_output.StructuredOutputManager",
]


def _imports_source(spec_names: list[str]) -> str:
    """The test's third-party imports, grouped by module (isort's order)."""
    plain = sorted(n for n in spec_names if "." not in n)  # "torch"
    by_module: dict[str, set[str]] = {}
    for name in [*_BASE_IMPORTS, *(n for n in spec_names if "." in n)]:
        module, _, attr = name.rpartition(".")
        by_module.setdefault(module, set()).add(attr)
    lines = [f"import {n}" for n in plain]
    for module in sorted(by_module):
        names = sorted(by_module[module], key=lambda n: (not n[0].isupper(), n))
        one = f"from {module} import {', '.join(names)}"
        if len(one) <= 100:
            lines.append(one)
        else:
            lines.append(f"from {module} import (\n" + "".join(f"    {n},\n" for n in names) + ")")
    return "\n".join(lines)


def _qualified(function: str, file: str | None) -> str:
    """``OffloadingConnectorScheduler.update_state_after_alloc`` for the shipped signature."""
    known = {"update_state_after_alloc": "OffloadingConnectorScheduler"}
    if file and file.endswith("offloading/scheduler.py") and function in known:
        return f"{known[function]}.{function}"
    return function


def _merge_imports(ours: str, more: list[str]) -> str:
    """The stdlib import block with the inlined shadow KV's imports added (plain ``import``
    lines first, then ``from`` lines, each sorted; ``from m import a`` lines of one module merged)."""
    plain: set[str] = set()
    froms: dict[str, set[str]] = {}
    for line in ours.splitlines() + [x for imp in more for x in imp.splitlines()]:
        if line.startswith("import "):
            plain |= {n.strip() for n in line[len("import "):].split(",")}
        elif line.startswith("from "):
            module, _, names = line[len("from "):].partition(" import ")
            froms.setdefault(module.strip(), set()).update(n.strip() for n in names.split(","))
    return "\n".join([f"import {n}" for n in sorted(plain)]
                     + [f"from {m} import {', '.join(sorted(froms[m]))}" for m in sorted(froms)])


@dataclass(frozen=True)
class SpeculativeInfo:
    method: str | None
    num_speculative_tokens: int


@dataclass(frozen=True)
class KvTransferInfo:
    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class KvGroupInfo:
    layer_names: tuple[str, ...]
    spec: str  # the KV-cache spec as Python source


@dataclass(frozen=True)
class KvTensorInfo:
    size: int
    shared_by: tuple[str, ...]  # the layers of the allocation
    # 0.30+: the release's placement fields (layer_stride, block_stride, offset, ...); None: shared_by's form
    placement: dict[str, Any] | None = None


@dataclass(frozen=True)
class EngineInfo:
    """What the offline engine built for a build (:func:`kvrepro.engine.offline.describe`: its
    settings and KV-cache groups), parsed once from its ``ready`` line (:meth:`from_json`)."""

    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    async_scheduling: bool
    disable_hybrid_kv_cache_manager: bool
    scheduler_block_size: int
    hash_block_size: int
    kv_cache_groups: tuple[KvGroupInfo, ...]
    kv_cache_tensors: tuple[KvTensorInfo, ...]
    spec_imports: tuple[str, ...]
    vllm: str | None = None
    dtype: str = "auto"
    vocab_size: int | None = None
    mamba_cache_mode: str | None = None
    speculative: SpeculativeInfo | None = None
    kv_transfer: KvTransferInfo | None = None

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "EngineInfo":
        """Strict on the fields it has (RecordError names a wrong one), lenient on keys another
        version of the offline engine adds."""
        from ..records import from_jsonable

        names = {f.name for f in dataclasses.fields(cls)}
        return from_jsonable(cls, {k: v for k, v in value.items() if k in names}, "engine")


def render(trace: Trace, loaded: LoadedMatrix, engine: EngineInfo, name: str,
           runs: dict[str, tuple[str, str, str]], violation: str | None = None,
           first_violation: str | None = None) -> str:
    """The test file's text. ``engine``: :func:`kvrepro.engine.offline.describe` of the build;
    ``runs``: build -> (python, PYTHONPATH, what it shows) for the header. ``violation`` (a kind
    of shadow-KV violation, ``full_attention+offload``): the corruption test instead, with the
    shadow KV inlined; ``first_violation``: what the offline engine saw, for its docstring."""
    matrix = loaded.matrix
    sig = matrix.target_signature
    model_config = json.loads((Path(loaded.model_dir()) / "config.json").read_text())
    model_config = {k: v for k, v in model_config.items() if not k.startswith("_")}
    rep = trace.header.rep or 0
    spec = engine.speculative
    transfer = engine.kv_transfer or KvTransferInfo()
    prompts = [list(r.tokens) for r in trace.requests]
    extra: dict[str, Any] = {}
    if violation:
        source, shadow_imports = shadow_source()
        offload = violation.endswith("+offload")
        extra = dict(violation=violation, shadow_source=source,
                     situation=("A KV-offloading request whose offload hit sits behind a partial local (GPU "
                                "prefix-cache) hit" if offload else
                                "A request with a local (GPU prefix-cache) hit and no offload hit, KV offloading on"),
                     reach_doc="; the test also checks that it reached an offload hit" if offload else "",
                     reach_assert=('    # clean: it must still have gone through an offload hit\n'
                                   '    assert hits, "no offload hit: the sequence did not exercise the '
                                   'OffloadingConnector\'s loads"\n') if offload else "",
                     stdlib_imports=_merge_imports(_STDLIB_IMPORTS, shadow_imports),
                     first_violation=_wrap(first_violation or "(not recorded)", 96, "    ").strip())
    text = _template(violation).format(**extra,
        base=matrix.base, exception=sig.exception, function=_qualified(sig.function, sig.file),
        expression_line=(f"The assertion: `{sig.expression}`.\n\n" if sig.expression else ""),
        token_word="token" if spec and spec.num_speculative_tokens == 1 else "tokens",
        vllm=engine.vllm or matrix.base, imports=_imports_source(list(engine.spec_imports)),
        mamba_cache_mode=engine.mamba_cache_mode,
        num_spec=spec.num_speculative_tokens if spec else 0,
        requests=len(trace.requests), tokens=sum(len(p) for p in prompts),
        source=trace.header.minimized_from or trace.path,
        acceptance=repr(matrix.engine.sim.draft_acceptance_rate),
        name=name,
        run_lines="\n".join(f"    # {label}\n    VLLM_PLUGINS= PYTHONPATH={pythonpath} {python} {name}"
                            for python, pythonpath, label in runs.values()),
        layers=_layers_summary(model_config),
        model_config=pprint.pformat(model_config, width=100, sort_dicts=False, compact=True),
        max_model_len=engine.max_model_len, block_size=engine.block_size,
        num_gpu_blocks=engine.num_gpu_blocks, seed=matrix.engine.sim.seed + rep,
        groups="\n".join(f"    ({list(g.layer_names)!r},\n     {_wrap_call(g.spec, 5)})," for g in engine.kv_cache_groups),
        tensors="\n".join(f"    ({t.size}, {list(t.shared_by)!r}, {t.placement!r})," for t in engine.kv_cache_tensors),
        prompts="\n".join(_prompts_source(prompts)),
        request_list=", ".join(f"({r.max_tokens}, P[{i}]" + (', "abort-queued")' if r.events is not None
                                                              and r.events.abort == "queued" else ")")
                               for i, r in enumerate(trace.requests)),
        dtype=engine.dtype,
        enable_prefix_caching=engine.enable_prefix_caching, hash_algo=engine.prefix_caching_hash_algo,
        mamba_cache_kw=(f", mamba_cache_mode={engine.mamba_cache_mode!r}" if engine.mamba_cache_mode else ""),
        max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
        enable_chunked_prefill=engine.enable_chunked_prefill,
        long_prefill_token_threshold=engine.long_prefill_token_threshold,
        async_scheduling=engine.async_scheduling, disable_hybrid=engine.disable_hybrid_kv_cache_manager,
        mode_doc=_mode_doc(engine.async_scheduling, engine.vllm or matrix.base),
        speculative_config=("None" if not spec else
                            f"SpeculativeConfig(method={spec.method!r}, num_speculative_tokens="
                            f"{spec.num_speculative_tokens}, target_model_config=model_config,\n"
                            f"                                        target_parallel_config=parallel_config)"),
        kv_connector=transfer.kv_connector, kv_role=transfer.kv_role,
        kv_extra=dict(transfer.kv_connector_extra_config),
        scheduler_block_size=engine.scheduler_block_size, hash_block_size=engine.hash_block_size,
    )
    if not violation and sig.function != "update_state_after_alloc":
        # the reach check is the offload-hit crash's own; another target (a queued abort's
        # _build_store_jobs) passes by running through
        text = text.replace(_REACH_CHECK, "    # another target than the offload-hit path: running through is the pass\n")
        # ... and the docstring must not tell the offload-hit story either (it did, for #49118)
        queued = any(r.events is not None and r.events.abort == "queued" for r in trace.requests)
        text = text.replace(_OFFLOAD_HIT_SITUATION, _QUEUED_ABORT_SITUATION if queued else _OTHER_SITUATION, 1)
        text = text.replace(_OFFLOAD_HIT_REACH_DOC, "\nfix the sequence runs through, and that is the pass.", 1)
    return text


def _mode_doc(async_scheduling: bool, vllm: str) -> str:
    """The test docstring's paragraph on the engine mode it steps the scheduler in (the run's)."""
    if async_scheduling:
        text = (f"Engine mode: asynchronous scheduling, as the run had it (vLLM's default on a GPU for this "
                f"engine). The scheduler is the class vLLM {vllm} picks for it (AsyncScheduler), stepped in "
                "EngineCore.step_with_batch_queue's order: each step is scheduled and executed before the "
                "previous step's output is processed (a batch queue of max_concurrent_batches); the fake "
                "runner fills the -1 draft placeholders with its own drafts and lowers the computed count "
                "by the drafts the previous step rejected, as vLLM's GPU model runner does.")
    else:
        text = ("Engine mode: synchronous scheduling, as the run had it (async_scheduling off). The "
                "scheduler is stepped as EngineCore.step does: schedule, execute, process the output, "
                "then hand the drafts to the scheduler.")
    return _wrap(text, 96, "").strip()


_OFFLOAD_HIT_SITUATION = "A KV-offloading request whose offload hit sits behind a partial local (GPU prefix-cache) hit,"
_QUEUED_ABORT_SITUATION = ("KV offloading on, a request the client gives up on while it is still queued (never "
                           "scheduled; \"abort-queued\" below),")
_OTHER_SITUATION = "A sequence of KV-offloading requests,"
_OFFLOAD_HIT_REACH_DOC = """
fix the sequence runs through, and the test checks it did reach the offload-hit-behind-a-local-
hit state."""


_REACH_CHECK = """    # without the bug the sequence runs through; it must still have reached the bug's state
    assert any(local > 0 for _, local, _ in hits), f"no offload hit behind a local prefix hit: {hits}"
"""


def emit(path: Path, trace: Trace, loaded: LoadedMatrix, engine: EngineInfo,
         runs: dict[str, tuple[str, str, str]], violation: str | None = None,
         first_violation: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(trace, loaded, engine, path.name, runs, violation, first_violation))


@dataclass(frozen=True)
class EmittedRun:
    """One run of an emitted test with a build's vLLM: its exit status, the failing frame read from
    the traceback's last frame (``exception`` to ``statement``), ``tail`` (the output's last lines),
    ``message`` (the last exception's message, all its lines) and ``output`` (stderr's end)."""

    exit: int
    exception: str | None
    file: str | None
    function: str | None
    statement: str | None
    tail: str
    message: str
    output: str


def run_emitted(path: Path, python: str, pythonpath: str, timeout: float = 600) -> EmittedRun:
    """Run the emitted file as a script with a build's vLLM (see :class:`EmittedRun`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVREPRO_", "VLLM_"))}
    env.update(PYTHONPATH=pythonpath, VLLM_PLUGINS="", VLLM_LOGGING_LEVEL="ERROR")
    from .. import lifetime, paths, scratch

    paths.keep_byte_code(env)  # the build's byte code where its engines keep theirs (compiled once)

    env.update(scratch.engine_env())  # its temporary files go where kvrepro's go (removed on exit)
    path = path.resolve()  # it runs in its own folder: a path relative to ours would name the wrong file
    proc = subprocess.run([python, str(path)], env=env, cwd=str(path.parent), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          preexec_fn=lifetime.child_hook(signal.SIGKILL))  # never outlives kvrepro
    text = proc.stderr
    frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)\n\s+(.*)', text)
    last = re.findall(r"^(\w+(?:Error|Exception)|AssertionError)\b.*$", text, flags=re.M)
    return EmittedRun(exit=proc.returncode, exception=last[-1] if last else None,
                      file=frames[-1][0] if frames else None,
                      function=frames[-1][1] if frames else None,
                      statement=frames[-1][2].strip() if frames else None,
                      tail="\n".join((proc.stdout + text).strip().splitlines()[-6:]),
                      message=_last_exception_message(text), output=text[-20000:])


def _last_exception_message(text: str) -> str:
    """The message of the traceback's final exception, with its continuation lines."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r"^(\w+(?:Error|Exception))(?::\s?(.*))?$", lines[i])
        if m:
            return "\n".join([m[2] or ""] + [x for x in lines[i + 1:] if x.strip()]).strip()
    return ""
