"""Client capacity: requests per second per core of kvrepro's load generator (aiohttp), `vllm bench
serve` and guidellm against the same null HTTP server, side by side with what the GPU-free engine
serves.

Why: the load generator must never be what limits an experiment. Issue 17 moved it from a
hand-written HTTP/1.1 client onto aiohttp and asks that it still drive at least 10x what the
GPU-free engine can serve (``GOAL``). Each client is pinned to one core (with every process it
starts), the null server to another, so what is measured is the client's own cost per request.
The server answers every /v1/completions at once with a fixed body (JSON, or server-sent events
when the request asks to stream) over keep-alive HTTP/1.1.

The engine's served rate: the shipped matrix's build D (both fixes: it serves the default load
without the target crash) on the sim target, started as ``kvrepro matrix run`` starts it, given
the default load (``--engine-requests`` requests, not streamed) at concurrency 1 (the default)
and at the engine's ``max_num_seqs`` (the most it runs at once), on every core; the better rate
counts, so the ratio printed is the smallest the client has over the engine.

All three send the same shape: prompts of the default profile's mean length (token ids for
kvrepro, random tokens or synthetic text for the others) and 8 output tokens, at concurrency 4
and 64, streaming off and on. Each tool's rate is its own figure (completed requests over its
measured duration, start-up and data preparation not counted); kvrepro's is requests over the
wall time of ``run_load``. The machine may be shared: each setting is measured ``--repeat``
times, the tools interleaved, and each tool's best run counts (contention only ever slows a
client down, so the best run is the closest to its cost on a core of its own). kvrepro's
requests per CPU-second are printed too: what its client costs whatever the server's core was
doing (the other tools' CPU time includes preparing their data, so it is not comparable), and
their ratio to the engine's rate: on a shared machine, where other processes take the client's
core, the wall rate falls and this ratio shows what the client itself costs.

    python benchmarks/client_capacity.py [--requests 5000] [--guidellm-requests 1000] [--repeat 3]
                                         [--engine-requests 300] [--skip vllm|guidellm|engine]

`vllm bench serve` runs in kvrepro's runtime env with build A's overlay of the shipped matrix
(made on first use, as `kvrepro matrix run` would); guidellm is installed on first use into its
own venv under ~/.cache/kvrepro/tools/guidellm (its dependencies conflict with ours). A tool
that cannot run is reported with the reason and the others are still measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GOAL = 10.0  # the client's rate against the null server over the engine's served rate (issue 17)
ENGINE_BUILD = "D"
OUTPUT_TOKENS = 8
SETTINGS = [(4, False), (4, True), (64, False), (64, True)]
TOOLS_DIR = Path(os.environ.get("KVREPRO_HOME", Path.home() / ".cache" / "kvrepro")) / "tools"
GUIDELLM_SPEC = "guidellm>=0.8,<0.9"  # its CLI changes between minor releases

# ------------------------------------------------------------------------------ the null server

_JSON = json.dumps({"id": "x", "object": "text_completion", "model": "m",
                    "choices": [{"index": 0, "text": " t" * OUTPUT_TOKENS, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": OUTPUT_TOKENS,
                              "total_tokens": 1 + OUTPUT_TOKENS}}).encode()
_SSE = (b'data: {"id":"x","object":"text_completion","model":"m","choices":[{"index":0,"text":" t"}]}\n\n'
        b'data: {"id":"x","object":"text_completion","model":"m","choices":[{"index":0,"text":" t",'
        b'"finish_reason":"length"}]}\n\n'
        b'data: {"id":"x","object":"text_completion","model":"m","choices":[],"usage":{"prompt_tokens":1,'
        b'"completion_tokens":8,"total_tokens":9}}\n\n'
        b"data: [DONE]\n\n")
_MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()


def _response(payload: bytes, kind: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nContent-Length: " + str(len(payload)).encode()
            + b"\r\n\r\n" + payload)


_ANSWERS = {"json": _response(_JSON, b"application/json"), "sse": _response(_SSE, b"text/event-stream"),
            "models": _response(_MODELS, b"application/json"), "other": _response(b"{}", b"application/json")}


class _NullServer(asyncio.Protocol):
    """Reads whole requests (head + Content-Length body) and answers each at once."""

    def connection_made(self, transport):
        self.transport = transport
        self.buf = b""

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None]) if at >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            if head.startswith(b"post"):
                streamed = b'"stream": true' in body or b'"stream":true' in body
                self.transport.write(_ANSWERS["sse" if streamed else "json"])
            elif b"/v1/models" in head[:40]:
                self.transport.write(_ANSWERS["models"])
            else:
                self.transport.write(_ANSWERS["other"])


def _serve(sock: socket.socket, core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()

    async def main():
        server = await loop.create_server(_NullServer, sock=sock, backlog=1024)
        await server.serve_forever()

    loop.run_until_complete(main())


# ------------------------------------------------------------------------------ the clients

def _pin(core: int):
    return lambda: os.sched_setaffinity(0, {core})


def _ours_in_child(url: str, concurrency: int, requests: int, stream: bool, core: int, out) -> None:
    os.sched_setaffinity(0, {core})
    from kvrepro.loadgen import run_load
    from kvrepro.spec.matrix import LoadSpec, RunsSpec

    load = LoadSpec(profile="partial-prefix", concurrency=concurrency, stream=stream)
    runs = RunsSpec(requests=requests, duration_s=None)
    with tempfile.TemporaryDirectory() as tmp:
        started, cpu = time.perf_counter(), time.process_time()
        summary = run_load(url, load, runs, Path(tmp) / "load.jsonl", seed=0, alive=lambda: True,
                           trace_path=Path(tmp) / "trace.jsonl")
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    out.put((summary.requests_ok, summary.requests_sent, wall, cpu))


def measure_ours(url: str, concurrency: int, stream: bool, requests: int, core: int) -> tuple[float, float] | str:
    """(requests per second, requests per CPU-second of the client), or why not."""
    queue: mp.Queue = mp.Queue()
    proc = mp.Process(target=_ours_in_child, args=(url, concurrency, requests, stream, core, queue))
    proc.start()
    try:
        ok, sent, wall, cpu = queue.get(timeout=600)
    finally:
        proc.join()
    if ok != sent:
        return f"{sent - ok} of {sent} requests failed"
    return ok / wall, ok / max(cpu, 1e-9)


def mean_prompt_tokens() -> int:
    """The default profile's mean prompt length: what the other tools are asked to send."""
    from kvrepro.loadgen import get_profile
    from kvrepro.spec.matrix import LoadSpec

    profile = get_profile("partial-prefix")(LoadSpec(profile="partial-prefix"), 0)
    return round(statistics.mean(len(profile.prompt(i).tokens) for i in range(1000)))


def vllm_setup() -> tuple[list[str], dict[str, str], str] | str:
    """(command prefix, environment, tokenizer path) of `vllm bench serve` in kvrepro's runtime
    env with build A's overlay, or why not."""
    try:
        from kvrepro.deploy.sim import SimTarget
        from kvrepro.spec.matrix import load_matrix

        loaded = load_matrix(ROOT / "matrix.yaml")
        plan = loaded.plans(["A"])[0]
        target = SimTarget(loaded)
        try:
            artifact = target.prepare(plan)  # cached after the first time
            if not artifact.ok:
                return f"build A failed: {artifact.error}"
            runtime = target.runtime(plan.base)
        finally:
            target.close()
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env.update(PYTHONPATH=runtime.pythonpath(artifact.ref or ""), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        return [str(runtime.python), "-m", "vllm.entrypoints.cli.main"], env, str(loaded.model_dir())
    except Exception as exc:  # noqa: BLE001 - any reason is printed and the others still run
        return f"{type(exc).__name__}: {exc}"


def measure_vllm(setup, url: str, concurrency: int, stream: bool, requests: int, prompt_tokens: int,
                 core: int) -> float | str:
    prefix, env, tokenizer = setup
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*prefix, "bench", "serve", "--backend", "openai", "--base-url", url, "--model", "m",
               "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(prompt_tokens),
               "--random-output-len", str(OUTPUT_TOKENS), "--num-prompts", str(requests),
               "--max-concurrency", str(concurrency), "--num-warmups", "0", "--disable-tqdm", "--ignore-eos",
               "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        if not stream:
            cmd.append("--no-stream")
        proc = subprocess.run(cmd, env=env, cwd=tmp, preexec_fn=_pin(core), capture_output=True, text=True,
                              timeout=900)
        result = Path(tmp) / "result.json"
        if proc.returncode != 0 or not result.exists():
            return f"exit {proc.returncode}: {_tail(proc.stderr or proc.stdout)}"
        data = json.loads(result.read_text())
    if data.get("completed") != requests:
        return f"{requests - int(data.get('completed') or 0)} of {requests} requests failed"
    return float(data["request_throughput"])


def guidellm_setup() -> Path | str:
    """The guidellm executable in its own venv (installed from PyPI on first use), or why not."""
    venv = TOOLS_DIR / "guidellm"
    exe = venv / "bin" / "guidellm"
    marker = venv / ".installed"
    if exe.exists() and marker.exists():
        return exe
    print(f"installing {GUIDELLM_SPEC} into {venv} (first use; a few minutes)", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, text=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", GUIDELLM_SPEC],
                       check=True, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        return f"cannot install guidellm: {type(exc).__name__}: {exc} {_tail(detail)}"
    marker.write_text(GUIDELLM_SPEC + "\n")
    return exe


def measure_guidellm(exe: Path, url: str, concurrency: int, stream: bool, requests: int, prompt_tokens: int,
                     tokenizer: str, core: int) -> float | str:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [str(exe), "run",
               "--backend", f"kind=openai_http,target={url},model=m,request_format=/v1/completions,"
                            f"stream={str(stream).lower()}",
               "--profile", f"kind=concurrent,streams={concurrency}",
               "--constraint", f"kind=max_requests,count={requests}",
               "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={OUTPUT_TOKENS}",
               "--tokenizer", f"kind=hf_auto,model={tokenizer}",
               "--output", f"kind=json,path={out}", "--disable-progress"]
        env = {**os.environ, "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "ERROR"}
        proc = subprocess.run(cmd, cwd=tmp, env=env, preexec_fn=_pin(core), capture_output=True, text=True,
                              timeout=900)
        if proc.returncode != 0 or not out.exists():
            return f"exit {proc.returncode}: {_tail(proc.stderr or proc.stdout)}"
        bench = json.loads(out.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    if totals["errored"] or not totals["successful"]:
        return f"{totals['errored']} of {totals['total']} requests failed"
    return totals["successful"] / bench["duration"]


def measure_engine(concurrency: int, requests: int) -> tuple[float, str] | str:
    """(requests per second the GPU-free engine served, why the load ended), or why not."""
    try:
        from kvrepro.deploy.sim import SimTarget
        from kvrepro.loadgen import run_load
        from kvrepro.loadgen.capacity import engine_capacity
        from kvrepro.spec.matrix import load_matrix

        loaded = load_matrix(ROOT / "matrix.yaml")
        matrix = loaded.matrix
        plan = loaded.plans([ENGINE_BUILD])[0]
        target = SimTarget(loaded)
        try:
            artifact = target.prepare(plan)  # cached after the first time
            if not artifact.ok:
                return f"build {ENGINE_BUILD} failed: {artifact.error}"
            with tempfile.TemporaryDirectory() as tmp:
                handle = target.start(artifact, Path(tmp), rep=0)
                try:
                    load = matrix.load.model_copy(update={"concurrency": concurrency, "stream": False})
                    capacity = engine_capacity(load, handle.log_path.read_text(errors="replace"),
                                               matrix.engine.block_size, matrix.engine.max_model_len,
                                               chunk_tokens=matrix.engine.offload_chunk_tokens,
                                               data_parallel_size=matrix.engine.data_parallel_size)
                    runs = matrix.runs.model_copy(update={"requests": requests, "duration_s": None})
                    summary = run_load(handle.base_url, load, runs, Path(tmp) / "load.jsonl", seed=load.seed,
                                       alive=handle.alive, capacity=capacity)
                finally:
                    handle.stop()
        finally:
            target.close()
    except Exception as exc:  # noqa: BLE001 - printed; the clients are still measured
        return f"{type(exc).__name__}: {exc}"
    if not summary.requests_ok:
        return f"no request served ({summary.stopped_because})"
    return summary.requests_ok / summary.seconds, summary.stopped_because


def _best(values: list[float | str]) -> float | str | None:
    """The best rate of a tool's runs; if none ran through, why the first did not."""
    rates = [v for v in values if isinstance(v, float)]
    return max(rates) if rates else (values[0] if values else None)


def _tail(text: str, chars: int = 300) -> str:
    return " ".join(text.strip().splitlines()[-3:])[-chars:]


# ------------------------------------------------------------------------------ the table

def _cell(value: float | str | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if isinstance(value, float) else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000, help="per setting, kvrepro and vllm bench serve")
    parser.add_argument("--guidellm-requests", type=int, default=1000, help="per setting (it is ~20x slower)")
    parser.add_argument("--engine-requests", type=int, default=300, help="per engine run (two runs)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per tool and setting; the best counts")
    parser.add_argument("--skip", action="append", default=[], choices=["vllm", "guidellm", "engine"],
                        help="leave a tool (or the engine) out (repeatable)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    client_core, server_core = cores[0], (cores[1] if len(cores) > 1 else None)
    prompt_tokens = mean_prompt_tokens()

    vllm = "skipped (--skip vllm)" if "vllm" in args.skip else vllm_setup()
    guidellm = "skipped (--skip guidellm)" if "guidellm" in args.skip else guidellm_setup()
    tokenizer = vllm[2] if isinstance(vllm, tuple) else str(ROOT / "kvrepro" / "data" / "models" / "qwen3-next-tiny")
    notes: dict[str, str] = {}

    # the engine first, on every core, before the null server runs
    engine: float | str = "skipped (--skip engine)"
    if "engine" not in args.skip:
        from kvrepro.spec.matrix import load_matrix

        max_seqs = load_matrix(ROOT / "matrix.yaml").matrix.engine.max_num_seqs or 1
        served: list[float | str] = []
        for concurrency in sorted({1, max_seqs}):
            result = measure_engine(concurrency, args.engine_requests)
            if isinstance(result, tuple):
                served.append(result[0])
                print(f"GPU-free engine (build {ENGINE_BUILD}, default load, concurrency {concurrency}): "
                      f"{result[0]:,.1f} requests/s served (load ended: {result[1]})", flush=True)
            else:
                served.append(result)
                print(f"GPU-free engine at concurrency {concurrency}: not measured: {result}", flush=True)
        engine = _best(served) or "not measured"
    if isinstance(engine, str):
        notes["GPU-free engine"] = engine

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = mp.Process(target=_serve, args=(sock, server_core), daemon=True)
    server.start()
    rows = []
    try:
        print(f"clients on core {client_core}, null server on core {server_core}; prompts of {prompt_tokens} "
              f"tokens (mean of the default profile), {OUTPUT_TOKENS} output tokens")
        for tool, state in (("vllm bench serve", vllm), ("guidellm", guidellm)):
            if isinstance(state, str):
                notes[tool] = state
                print(f"{tool}: not run: {state}")
        print(f"{'concurrency':>11} {'stream':>6} {'kvrepro':>8} {'vllm bench':>10} {'guidellm':>8} {'engine':>7} "
              f"{'ours/engine':>11}  goal {GOAL:g}x  (kvrepro per CPU-s, / engine)", flush=True)
        for concurrency, stream in SETTINGS:
            runs: dict[str, list[float | str]] = {"kvrepro": [], "vllm bench serve": [], "guidellm": []}
            for _ in range(max(1, args.repeat)):  # interleaved: a busy minute hits every tool alike
                runs["kvrepro"].append(measure_ours(url, concurrency, stream, args.requests, client_core))
                if isinstance(vllm, tuple):
                    runs["vllm bench serve"].append(measure_vllm(vllm, url, concurrency, stream, args.requests,
                                                                 prompt_tokens, client_core))
                if isinstance(guidellm, Path):
                    runs["guidellm"].append(measure_guidellm(guidellm, url, concurrency, stream,
                                                             args.guidellm_requests, prompt_tokens, tokenizer,
                                                             client_core))
            ours_runs = runs.pop("kvrepro")
            ours = _best([r[0] if isinstance(r, tuple) else r for r in ours_runs])
            ours_cpu = _best([r[1] if isinstance(r, tuple) else r for r in ours_runs])
            other = {tool: _best(values) for tool, values in runs.items()}
            for tool, value in (("kvrepro", ours), *other.items()):
                if isinstance(value, str):
                    notes.setdefault(f"{tool} c={concurrency} stream={stream}", value)
            ratio = ours / engine if isinstance(ours, float) and isinstance(engine, float) else None
            cpu_ratio = ours_cpu / engine if isinstance(ours_cpu, float) and isinstance(engine, float) else None
            verdict = "-" if ratio is None else ("met" if ratio >= GOAL else "NOT met")
            rows.append(ratio)
            print(f"{concurrency:>11} {str(stream):>6} {_cell(ours):>8} {_cell(other['vllm bench serve']):>10} "
                  f"{_cell(other['guidellm']):>8} {_cell(engine):>7} {('%.1f' % ratio) if ratio else '-':>11}  "
                  f"{verdict:<8}  ({_cell(ours_cpu)}, {('%.1fx' % cpu_ratio) if cpu_ratio else '-'})", flush=True)
    finally:
        server.terminate()
        server.join()
    for what, why in notes.items():
        print(f"note: {what}: {why}")
    measured = [r for r in rows if r is not None]
    if not measured:
        print(f"{GOAL:g}x goal: not measured (the engine or the client did not run)")
        return 1
    met = sum(r >= GOAL for r in measured)
    print(f"{GOAL:g}x goal: met in {met} of {len(measured)} settings (kvrepro's client against a null server / "
          f"the GPU-free engine's served rate: {min(measured):.1f}-{max(measured):.1f}x)")
    return 0 if met == len(measured) else 1


if __name__ == "__main__":
    raise SystemExit(main())
