"""Client capacity: requests per second per core that kvrepro's load generator sustains against a
null HTTP server (answers every /v1/completions at once with a fixed body), side by side for
concurrency 4 and 64 and streaming on/off. The client is pinned to one core, the server to another
(when the machine has two), so the number is the client's cost per request.

    python benchmarks/client_capacity.py [--requests 3000]

Goal (issue 11): 2x the better of `vllm bench serve` and guidellm on the same null server; those
two are not run here yet, so only kvrepro's own numbers are printed (and their ratio to the
issue's measured 2,021 / 2,585 req/s for `vllm bench serve` at concurrency 4 / 64).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VLLM_BENCH_REPORTED = {4: 2021.0, 64: 2585.0}  # req/s, issue 11 (one pinned core, uvloop null server)

_BODY = json.dumps({"id": "x", "object": "text_completion", "model": "m",
                    "choices": [{"index": 0, "text": " t1", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9}}).encode()
_MODELS = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()
_SSE = (b'data: {"choices":[{"index":0,"text":" t1"}]}\n\n'
        b'data: {"choices":[],"usage":{"completion_tokens":8}}\n\ndata: [DONE]\n\n')


async def _handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length) if length else b""
            if head.startswith(b"GET /v1/models"):
                payload, kind = _MODELS, b"application/json"
            elif b'"stream": true' in body:
                payload, kind = _SSE, b"text/event-stream"
            else:
                payload, kind = _BODY, b"application/json"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nContent-Length: "
                         + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _serve(sock: socket.socket, core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})

    async def main():
        server = await asyncio.start_server(_handle, sock=sock, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _client(url: str, concurrency: int, requests: int, stream: bool, core: int, out) -> None:
    os.sched_setaffinity(0, {core})
    import tempfile

    from kvrepro.loadgen import run_load
    from kvrepro.spec import LoadSpec, RunsSpec

    load = LoadSpec(profile="partial-prefix", concurrency=concurrency, stream=stream)
    runs = RunsSpec(requests=requests, duration_s=None)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        cpu0 = time.process_time()
        summary = run_load(url, load, runs, Path(tmp) / "load.jsonl", seed=0, alive=lambda: True,
                           trace_path=Path(tmp) / "trace.jsonl")
        out.put((summary.requests_ok, time.perf_counter() - started, time.process_time() - cpu0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    client_core, server_core = cores[0], (cores[1] if len(cores) > 1 else None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = mp.Process(target=_serve, args=(sock, server_core), daemon=True)
    server.start()
    try:
        print(f"client on core {client_core}, null server on core {server_core}; {args.requests} requests each")
        print(f"{'concurrency':>11} {'stream':>6} {'req/s':>8} {'req/s per CPU-s':>16} {'x vllm bench (issue)':>21}")
        for concurrency in (4, 64):
            for stream in (False, True):
                queue: mp.Queue = mp.Queue()
                proc = mp.Process(target=_client, args=(url, concurrency, args.requests, stream, client_core, queue))
                proc.start()
                ok, wall, cpu = queue.get(timeout=600)
                proc.join()
                rate = ok / wall
                print(f"{concurrency:>11} {str(stream):>6} {rate:>8.0f} {ok / max(cpu, 1e-9):>16.0f} "
                      f"{rate / VLLM_BENCH_REPORTED[concurrency]:>21.2f}")
    finally:
        server.terminate()
        server.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
