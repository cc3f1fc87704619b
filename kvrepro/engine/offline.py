"""Run request sequences through the GPU-free engine in-process, one request at a time.

``python -m kvrepro.engine.offline JOBS.json|- <vllm serve args>`` (in the runtime env, with a
build's overlay on PYTHONPATH) builds the same EngineCore as the served engine -- vLLM's
scheduler, KV-cache manager and OffloadingConnector over the sim executor -- and for each job
(a list of ``{"tokens": [...], "max_tokens": N, "events": {...}}``; events as the trace records
them: a queued abort is aborted before the first step, a token abort once it has its tokens) starts a fresh EngineCore, adds the requests
one by one and steps until each has finished before adding the next: exactly what the engine
loop does when a client sends one request at a time (``load.concurrency: 1``, every replay).
It prints one JSON line per job: ``{"job", "crashed", "crash_at", "exception", "function",
"file", "statement", "requests_done", "trigger_calls", "kv_checks", "kv_violations",
"kv_violations_by", "kv_records", "kv_copied", "seconds"}`` (``kv_*``: the shadow KV's check of the job, each
violation with the index of its request; see ``_shadow_result``). With ``-`` it reads one job
per line from stdin and answers each at once (the minimizer keeps one such process per build);
its first line, ``{"ready": true, "engine": {...}}``, describes the engine it builds (settings
and KV-cache groups, see ``describe``) for the scheduler-level test the minimizer emits.

Why: minimizing a trace runs hundreds of candidate sequences. Over HTTP each one costs an engine
start; here a candidate costs one EngineCore construction and its steps. The minimizer confirms
its result over HTTP (``kvrepro load replay``) afterwards, so this path is a fast oracle, not
the proof.
"""

from __future__ import annotations

import dataclasses

import json
import linecache
import os
import sys
import time
import traceback

from kvrepro import scratch
from kvrepro.engine import shm_region



def _shutdown(core) -> None:
    """Stop an EngineCore's executor and scheduler; a part that fails to stop is not the result."""
    for part in (core.model_executor.shutdown, core.scheduler.shutdown):
        try:
            part()
        except Exception:  # noqa: BLE001
            pass
    # this EngineCore is over (it may have crashed, leaving vLLM's /dev/shm region): kvrepro/engine/shm_region.py
    scratch.release_claimed(os.environ.get(shm_region.ENV), only_pid=os.getpid())

def _statement(frame) -> str | None:
    """The failing statement, all of its lines (an assert often spans several)."""
    if frame is None or not frame.lineno:
        return None
    end = getattr(frame, "end_lineno", None) or frame.lineno
    return " ".join(linecache.getline(frame.filename, n).strip() for n in range(frame.lineno, end + 1))


def _signature(exc: BaseException) -> dict:
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    return {
        "exception": type(exc).__name__,
        "function": last.name if last else None,
        "file": last.filename if last else None,
        "statement": _statement(last),
        "message": str(exc)[:300],
    }


def _count_hits(core, counts: dict) -> None:
    """Count the bug's precondition the way the probe does (local hit AND offload hit), around the
    offloading connector's update_state_after_alloc (KVREPRO_OFFLINE_DEBUG: each hit and match on stderr)."""
    sched_conn = core.scheduler.connector
    if sched_conn is None:
        return
    inner = getattr(sched_conn, "connector_scheduler", None)
    target = inner if inner is not None and hasattr(inner, "update_state_after_alloc") else None
    if target is None:
        return
    original = target.update_state_after_alloc

    def counted(request, blocks, num_external_tokens, _orig=original, _t=target):
        if num_external_tokens > 0:
            counts["external_hit_calls"] += 1
            status = getattr(_t, "_req_status", {}).get(request.request_id)
            local = getattr(status, "num_locally_computed_tokens", 0) if status is not None else 0
            if local > 0:
                counts["trigger_calls"] += 1
            if os.environ.get("KVREPRO_OFFLINE_DEBUG"):
                groups = [sum(1 for b in g if not b.is_null and b.block_hash is not None) for g in blocks.blocks]
                print(f"hit req={request.request_id} local={local} external={num_external_tokens} "
                      f"prompt={request.num_prompt_tokens} hashed_blocks={groups}", file=sys.stderr)
        return _orig(request, blocks, num_external_tokens)

    target.update_state_after_alloc = counted
    if os.environ.get("KVREPRO_OFFLINE_DEBUG"):
        orig_match = target.get_num_new_matched_tokens

        def matched(request, num_computed_tokens, _orig=orig_match):
            out = _orig(request, num_computed_tokens)
            print(f"match req={request.request_id} prompt={request.num_prompt_tokens} "
                  f"local={num_computed_tokens} external={out[0]}", file=sys.stderr)
            return out

        target.get_num_new_matched_tokens = matched


def _request(i: int, item: dict):
    """Job entry ``i`` as the EngineCoreRequest kvrepro's client would have made of it."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    events = item.get("events") or {}
    extra = {"priority": int(events["priority"])} if events.get("priority") is not None else {}
    return EngineCoreRequest(
        request_id=f"req-{i}", prompt_token_ids=list(item["tokens"]), mm_features=None,
        # what kvrepro's client asks for (temperature 0, exactly max_tokens tokens)
        sampling_params=SamplingParams(max_tokens=int(item["max_tokens"]), temperature=0.0, ignore_eos=True),
        pooling_params=None, arrival_time=float(i), lora_request=None, cache_salt=None,
        data_parallel_rank=None, **extra)


def _queued_abort(item: dict) -> bool:
    return (item.get("events") or {}).get("abort") == "queued"


def _add(core, i: int, item: dict) -> None:
    core.add_request(*core.preprocess_add_request(_request(i, item)))


class _Replay:
    """One job sent to one EngineCore, request by request, as kvrepro's HTTP load would have sent it."""

    def __init__(self, core, job: list[dict]):
        self.core = core
        self.job = job
        self.rider_done = -1  # the queued abort that rode along with the request before it
        self.sent_with = -1  # the last request of a burst sent together with an earlier one

    def send(self, i: int) -> None:
        """Request ``i`` with what the trace recorded the client did to it (kvrepro.spec.records.RequestEvents),
        done here to the EngineCore directly, as the HTTP load does it; then steps until the engine is idle."""
        core, job = self.core, self.job
        events = job[i].get("events") or {}
        rider = job[i + 1] if i + 1 < len(job) and _queued_abort(job[i + 1]) else None
        if events.get("reset_prefix_cache"):
            core.reset_prefix_cache(False, events["reset_prefix_cache"] == "external")
        _add(core, i, job[i])
        for j in range(i + 1, min(len(job), i + int(events.get("burst") or 1))):
            _add(core, j, job[j])  # a burst: all at once
            self.sent_with = j
        abort = events.get("abort")
        # a queued abort with no request before it to ride along with is scheduled at once on
        # an idle engine, as over HTTP: the client's abort comes after its first step
        abort_after = (int(events.get("abort_after_tokens") or 1) if abort in ("first_token", "tokens")
                       else 0 if abort == "queued" else None)
        self._step_until_idle(i, rider, abort_after)

    def _step_until_idle(self, i: int, rider: dict | None, abort_after: int | None) -> None:
        """EngineCore's own loop: its step function (the batch queue under asynchronous scheduling)
        while the scheduler has requests or a batch is still in flight."""
        core = self.core
        steps = 0
        while core.scheduler.has_requests() or getattr(core, "batch_queue", None):
            _, executed = core.step_fn()
            core.post_step(executed)
            steps += 1
            if rider is not None:
                # the next request, a queued abort, arrives while this one runs and is
                # dropped before the scheduler gets to it (over HTTP: max_num_seqs 1)
                _add(core, i + 1, rider)
                core.abort_requests([f"req-{i + 1}"])
                rider, self.rider_done = None, i + 1
            if abort_after is not None:
                live = core.scheduler.requests.get(f"req-{i}")
                if live is not None and live.num_output_tokens >= abort_after:
                    core.abort_requests([f"req-{i}"])
                    abort_after = None
            if steps > 100_000:
                raise RuntimeError("request did not finish within 100000 steps (stall)")


def run_job(build_core, job: list[dict]) -> dict:
    core = build_core()
    counts = {"trigger_calls": 0, "external_hit_calls": 0}
    _count_hits(core, counts)
    started = time.monotonic()
    result = {"crashed": False, "crash_at": None, "requests_done": 0}
    replay = _Replay(core, job)
    try:
        for i in range(len(job)):
            if i == replay.rider_done or i <= replay.sent_with:
                result["requests_done"] = i + 1
                continue
            try:
                replay.send(i)
            except Exception as exc:  # noqa: BLE001 -- the crash is the result
                # a rider dropped in this request's run is part of what crashed: a cut keeps it
                result.update(crashed=True, crash_at=replay.rider_done if replay.rider_done == i + 1 else i,
                              **_signature(exc))
                break
            result["requests_done"] = i + 1
    finally:
        _shutdown(core)
    result.update(counts, **_shadow_result(core), seconds=round(time.monotonic() - started, 3))
    return result


def _shadow_result(core) -> dict:
    """The shadow KV's verdict on the job (kvrepro/engine/shadow.py): contexts checked, violations
    by kind (``full_attention+offload``, ...), and each violation as data with the index of the
    request it was in (request ``req-<i>``). ``kv_checks`` None: the engine had no shadow KV."""
    import atexit

    shadow = getattr(core.model_executor, "shadow", None)
    if shadow is None:
        return {"kv_checks": None, "kv_violations": 0, "kv_violations_by": {}, "kv_records": [], "kv_copied": 0}
    atexit.unregister(shadow.report)  # one shadow per job: do not keep them all alive until exit
    records = []
    for record in shadow.records:
        index = str(record.get("request", "")).rpartition("-")[2]
        records.append({**record, "request_index": int(index) if index.isdigit() else None})
    return {"kv_checks": shadow.checks, "kv_violations": shadow.violations,
            "kv_violations_by": dict(shadow.by_kind), "kv_records": records,
            "kv_copied": getattr(shadow, "copied", 0)}


def _literal(value, imports: set[str]) -> str:
    """Python source for a KV-cache spec field (``imports``: the names it needs)."""
    import enum

    import torch

    if isinstance(value, torch.dtype):
        imports.add("torch")
        return str(value)
    if isinstance(value, enum.Enum):
        imports.add(f"{type(value).__module__}.{type(value).__name__}")
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (tuple, list)):
        items = [_literal(v, imports) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    return repr(value)


def _spec_source(spec, imports: set[str]) -> str:
    """``FullAttentionSpec(block_size=16, ...)``: the spec as source, fields that differ from
    their defaults (a dataclass field without a default is always written)."""
    import dataclasses

    imports.add(f"{type(spec).__module__}.{type(spec).__name__}")
    parts = []
    for f in dataclasses.fields(spec):
        if not f.init:
            continue
        value = getattr(spec, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        if f.default_factory is not dataclasses.MISSING and value == f.default_factory():
            continue
        parts.append(f"{f.name}={_literal(value, imports)}")
    return f"{type(spec).__name__}({', '.join(parts)})"


def describe(core) -> dict:
    """What a scheduler-level test needs to rebuild this engine's scheduler (kvrepro.pytest_emit):
    the scheduler, cache, speculative and KV-transfer settings vLLM resolved from the command
    line, and the KV-cache groups it built (specs as source text)."""
    import vllm

    vc = core.vllm_config
    sched = core.scheduler
    kvc = sched.kv_cache_config
    imports: set[str] = set()
    groups = [{"layer_names": list(g.layer_names), "spec": _spec_source(g.kv_cache_spec, imports)}
              for g in kvc.kv_cache_groups]
    spec = vc.speculative_config
    transfer = vc.kv_transfer_config
    return {
        "vllm": getattr(vllm, "__version__", "?"),
        "max_model_len": vc.model_config.max_model_len,
        "dtype": str(vc.model_config.dtype).replace("torch.", ""),
        "vocab_size": vc.model_config.get_vocab_size(),
        "block_size": vc.cache_config.block_size,
        "mamba_cache_mode": getattr(vc.cache_config, "mamba_cache_mode", None),
        "enable_prefix_caching": bool(vc.cache_config.enable_prefix_caching),
        "prefix_caching_hash_algo": vc.cache_config.prefix_caching_hash_algo,
        "num_gpu_blocks": kvc.num_blocks,
        "max_num_seqs": vc.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
        "enable_chunked_prefill": bool(vc.scheduler_config.enable_chunked_prefill),
        "long_prefill_token_threshold": vc.scheduler_config.long_prefill_token_threshold,
        "async_scheduling": bool(vc.scheduler_config.async_scheduling),
        "disable_hybrid_kv_cache_manager": bool(vc.scheduler_config.disable_hybrid_kv_cache_manager),
        "speculative": None if spec is None else {"method": spec.method,
                                                  "num_speculative_tokens": spec.num_speculative_tokens},
        "kv_transfer": None if transfer is None else {
            "kv_connector": transfer.kv_connector, "kv_role": transfer.kv_role,
            "kv_connector_extra_config": dict(transfer.kv_connector_extra_config or {})},
        "scheduler_block_size": sched.block_size,
        "hash_block_size": getattr(sched, "hash_block_size", None) or sched.block_size,
        "kv_cache_groups": groups,
        # up to 0.29 a KVCacheTensor names the layers sharing its allocation (`shared_by`); from 0.30
        # it places `layers` by offsets and strides (kv_cache_interface.py 0.30.0:1377-1382): those
        # fields are kept as `placement`, so a test written from the build makes the release's own
        "kv_cache_tensors": [_tensor_record(t) for t in kvc.kv_cache_tensors],
        "spec_imports": sorted(imports),
    }


def _tensor_record(tensor) -> dict:
    """One KVCacheTensor as data, in its release's form (see describe())."""
    if hasattr(tensor, "shared_by"):
        return {"size": tensor.size, "shared_by": list(tensor.shared_by), "placement": None}
    placement = {f.name: getattr(tensor, f.name) for f in dataclasses.fields(tensor)
                 if f.name not in ("size", "layers")}
    return {"size": tensor.size, "shared_by": list(tensor.layers), "placement": placement}


def _fresh(build_core):
    """``build_core`` with the fs offload tiers emptied before each engine (see _fresh_fs_tiers)."""
    def fresh():
        _fresh_fs_tiers()
        return build_core()

    return fresh


def build_engine_factory(serve_args: list[str]):
    """A function making a fresh EngineCore configured exactly as ``vllm serve SERVE_ARGS`` is:
    vLLM's own argument parsing, the platform kvrepro's plugin names (KVREPRO_SIM=1), the
    executor that platform picks, statistics on as the server has them."""
    os.environ.setdefault("KVREPRO_SIM", "1")
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor import Executor

    model, rest = serve_args[0], list(serve_args[1:])
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--model", model, *rest]))

    def build_core():
        vllm_config = engine_args.create_engine_config()
        return EngineCore(vllm_config, executor_class=Executor.get_class(vllm_config), log_stats=True)

    return build_core


def _fresh_fs_tiers() -> None:
    """Empty the fs offload tiers' folders (KVREPRO_OFFLINE_FS_ROOT: the folder kvrepro made for this
    process, one sub-folder a tier) before an engine starts: each job is a fresh engine, and vLLM's fs
    tier would serve it the chunks an earlier job stored (kvrepro/spec/fs_tier.py)."""
    root = os.environ.get("KVREPRO_OFFLINE_FS_ROOT")
    if not root or not os.path.isdir(root):
        return
    import shutil

    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("fs-tier-") and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
            os.mkdir(path)


def main(argv: list[str]) -> int:
    jobs_path, serve_args = argv[0], argv[1:]
    build_core = _fresh(build_engine_factory(serve_args))
    out = sys.stdout
    if jobs_path == "-":
        core = build_core()  # what the engine looks like, for an emitted scheduler-level test
        try:
            geometry = describe(core)
        finally:
            _shutdown(core)
        out.write(json.dumps({"ready": True, "engine": geometry}) + "\n")
        out.flush()
        for n, line in enumerate(sys.stdin):
            if not line.strip():
                continue
            result = run_job(build_core, json.loads(line))
            out.write(json.dumps({"job": n, **result}) + "\n")
            out.flush()
        return 0
    with open(jobs_path, encoding="utf-8") as f:
        jobs = json.load(f)
    for n, job in enumerate(jobs):
        result = run_job(build_core, job)
        out.write(json.dumps({"job": n, **result}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    from kvrepro.engine.zygote import ENV_VAR, delegate  # stdlib only, like this module's imports

    zygote = os.environ.get(ENV_VAR)
    code = None
    if zygote:  # forked from a zygote that has torch & co. imported (kvrepro/minimize/shrink.py says when)
        code = delegate(zygote, sys.argv[1:], module="kvrepro.engine.offline")
    if code is None:
        code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
