"""Run request sequences through the GPU-free engine in-process, one request at a time.

``python -m kvrepro.engine.offline JOBS.json|- <vllm serve args>`` (in the runtime env, with a
build's overlay on PYTHONPATH) builds the same EngineCore as the served engine -- vLLM's
scheduler, KV-cache manager and OffloadingConnector over the sim executor -- and for each job
(a list of ``{"tokens": [...], "max_tokens": N}``) starts a fresh EngineCore, adds the requests
one by one and steps until each has finished before adding the next: exactly what the engine
loop does when a client sends one request at a time (``load.concurrency: 1``, every replay).
It prints one JSON line per job: ``{"job", "crashed", "crash_at", "exception", "function",
"file", "statement", "requests_done", "trigger_calls", "seconds"}``. With ``-`` it reads one job
per line from stdin and answers each at once (the minimizer keeps one such process per build).

Why: minimizing a trace runs hundreds of candidate sequences. Over HTTP each one costs an engine
start; here a candidate costs one EngineCore construction and its steps. The minimizer confirms
its result over HTTP (``kvrepro load replay``) afterwards, so this path is a fast oracle, not
the proof.
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import time
import traceback


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


def run_job(build_core, job: list[dict]) -> dict:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    core = build_core()
    counts = {"trigger_calls": 0, "external_hit_calls": 0}
    sched_conn = core.scheduler.connector
    original = None
    if sched_conn is not None:
        # count the bug's precondition the way the probe does (local hit AND offload hit)
        inner = getattr(sched_conn, "connector_scheduler", None)
        target = inner if inner is not None and hasattr(inner, "update_state_after_alloc") else None
        if target is not None:
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
    started = time.monotonic()
    result = {"crashed": False, "crash_at": None, "requests_done": 0}
    try:
        for i, item in enumerate(job):
            request = EngineCoreRequest(
                request_id=f"req-{i}", prompt_token_ids=list(item["tokens"]), mm_features=None,
                # what kvrepro's client asks for (temperature 0, exactly max_tokens tokens)
                sampling_params=SamplingParams(max_tokens=int(item["max_tokens"]), temperature=0.0, ignore_eos=True),
                pooling_params=None, arrival_time=float(i), lora_request=None, cache_salt=None,
                data_parallel_rank=None)
            try:
                core.add_request(*core.preprocess_add_request(request))
                steps = 0
                while core.scheduler.has_requests():
                    _, executed = core.step()
                    core.post_step(executed)
                    steps += 1
                    if steps > 100_000:
                        raise RuntimeError("request did not finish within 100000 steps (stall)")
            except Exception as exc:  # noqa: BLE001 -- the crash is the result
                result.update(crashed=True, crash_at=i, **_signature(exc))
                break
            result["requests_done"] = i + 1
    finally:
        for part in (core.model_executor.shutdown, core.scheduler.shutdown):
            try:
                part()
            except Exception:
                pass
    result.update(counts, seconds=round(time.monotonic() - started, 3))
    return result


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


def main(argv: list[str]) -> int:
    jobs_path, serve_args = argv[0], argv[1:]
    build_core = build_engine_factory(serve_args)
    out = sys.stdout
    if jobs_path == "-":
        out.write(json.dumps({"ready": True}) + "\n")
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
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
