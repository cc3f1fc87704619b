"""The sim engine's process: vLLM's EngineCore behind an OpenAI-compatible HTTP API.

``main(argv)`` builds the VllmConfig from `vllm serve` arguments (``config``), constructs
vLLM's ``EngineCore`` with the sim executor (``executor``), starts the engine loop
(``loop``) and serves, on a stdlib ``ThreadingHTTPServer``:

* ``POST /v1/completions`` (``prompt`` str or token ids, ``max_tokens``, optional ``stream``)
* ``GET /v1/models``, ``GET /health`` (200 alive, 503 once the engine died)
* ``GET /metrics``: vLLM's metric names (from the SchedulerStats EngineCore returns), the
  probe's counts and the sim's own counters.

The API server stack of vLLM (FastAPI, uvicorn, the frontend processes) is deliberately not
imported: start-up stays at vLLM's import time. Logs go to stdout/stderr through vLLM's logger,
so lines look like vLLM's. SIGTERM / SIGINT stop the process cleanly (exit 0).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from vllm.logger import init_logger

logger = init_logger("vllm.kvrepro_engine.server")

REQUEST_TIMEOUT_S = 600.0


def load_probe():
    """The build's probe (next to its vllm/), imported before vLLM's scheduler module.

    A kvrepro overlay carries ``kvrepro_probe.py``; outside one (a bare vLLM on the path) the
    copy in this checkout is loaded under the same module name, so it wraps just the same.
    """
    try:
        import kvrepro_probe  # noqa: PLC0415

        return kvrepro_probe
    except ImportError:
        path = Path(__file__).resolve().parent.parent / "probe" / "kvrepro_probe.py"
        logger.warning("kvrepro_probe is not on the path (not a kvrepro overlay?); loading %s", path)
        spec = importlib.util.spec_from_file_location("kvrepro_probe", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["kvrepro_probe"] = module
        spec.loader.exec_module(module)
        return module


class SimApp:
    """What the HTTP handlers need: the loop, the names, and the metrics sources."""

    def __init__(self, loop, executor, probe, served_model_name: str, model_dir: str, max_model_len: int, vocab_size: int):
        self.loop = loop
        self.executor = executor
        self.probe = probe
        self.served_model_name = served_model_name
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.created = int(time.time())

    def metrics_text(self) -> str:
        m = self.loop.metrics
        sim = self.executor.sim_stats()
        probe_counts = self.probe.counts() if self.probe is not None else {}
        labels = f'{{engine="0",model_name="{self.served_model_name}"}}'
        rows = [
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", m.num_requests_running),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", m.num_requests_waiting),
            ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", m.prefix_cache_queries),
            ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", m.prefix_cache_hits),
            ("vllm:external_prefix_cache_queries_total", "counter", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.", m.external_prefix_cache_queries),
            ("vllm:external_prefix_cache_hits_total", "counter", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.", m.external_prefix_cache_hits),
            ("kvrepro_probe_external_hit_calls_total", "counter", "update_state_after_alloc calls with num_external_tokens > 0 (kvrepro probe).", probe_counts.get("external_hit_calls", 0)),
            ("kvrepro_probe_trigger_calls_total", "counter", "update_state_after_alloc calls with an offload hit AND a local prefix hit (kvrepro probe).", probe_counts.get("trigger_calls", 0)),
            ("kvrepro_offload_load_jobs_total", "counter", "Offload load jobs the sim worker completed.", sim["load_jobs"]),
            ("kvrepro_offload_store_jobs_total", "counter", "Offload store jobs the sim worker completed.", sim["store_jobs"]),
            ("kvrepro_engine_steps_total", "counter", "Model steps the sim executor ran.", sim["steps"]),
        ]
        out = []
        for name, kind, doc, value in rows:
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            out.append(f"{name}{labels} {float(value)}")
        out.append("# HELP kvrepro_engine_dead 1 once EngineCore died.")
        out.append("# TYPE kvrepro_engine_dead gauge")
        out.append(f"kvrepro_engine_dead{labels} {1.0 if self.loop.dead else 0.0}")
        return "\n".join(out) + "\n"


class SimHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that hangs up mid-response is routine (a load generator timing out); the
        # stdlib would print a traceback into the engine log, where it looks like a crash.
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)):
            return
        logger.warning("HTTP handler error for %s: %r", client_address, exc)


def _engine_error(exc: BaseException) -> tuple[int, dict]:
    """The HTTP status and body for a completion the engine could not finish, as vLLM answers:
    a dead engine is 500 EngineDeadError, a stopping one 503, no progress in time 504."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from .loop import EngineStopping

    if isinstance(exc, EngineDeadError):
        return 500, _error_body(str(exc), "EngineDeadError", 500)
    if isinstance(exc, EngineStopping):
        return 503, _error_body(str(exc), "ServiceUnavailableError", 503)
    return 504, _error_body("no output from the engine in time", "TimeoutError", 504)


def _error_body(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kvrepro-sim-vllm"
    app: SimApp  # set on the subclass made in main()

    def setup(self):
        super().setup()
        # Headers and body go out in separate writes; without TCP_NODELAY, Nagle's algorithm
        # and the client's delayed ACK add ~40 ms to every response.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):  # access logs would drown the engine log
        return

    def _send_json(self, code: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_text(self, code: int, text: str, content_type: str = "text/plain; charset=utf-8") -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        path = self.path.split("?", 1)[0]
        app = self.app
        if path == "/health":
            self._send_text(200 if app.loop.alive() else 503, "")
        elif path == "/metrics":
            self._send_text(200, app.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [{
                "id": app.served_model_name, "object": "model", "created": app.created,
                "owned_by": "vllm", "root": app.model_dir, "parent": None,
                "max_model_len": app.max_model_len,
            }]})
        else:
            self._send_json(404, _error_body(f"no route {path}", "NotFoundError", 404))

    def do_POST(self):  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path != "/v1/completions":
            self._send_json(404, _error_body(f"no route {path}", "NotFoundError", 404))
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except (ValueError, json.JSONDecodeError) as exc:
            self._send_json(400, _error_body(f"invalid JSON body: {exc}", "BadRequestError", 400))
            return
        self._completions(body)

    def _completions(self, body: dict) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        from .loop import EngineStopping
        from .prompts import PromptError, detokenize, prompt_to_token_ids

        app = self.app
        model = body.get("model")
        if model is not None and model not in (app.served_model_name, app.model_dir):
            self._send_json(404, _error_body(f"The model `{model}` does not exist.", "NotFoundError", 404))
            return
        try:
            prompt_ids = prompt_to_token_ids(body.get("prompt"), app.vocab_size)
            max_tokens = body.get("max_tokens", 16)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise PromptError("max_tokens must be a positive integer")
            if len(prompt_ids) + max_tokens > app.max_model_len:
                raise PromptError(
                    f"This model's maximum context length is {app.max_model_len} tokens. However, "
                    f"you requested {len(prompt_ids) + max_tokens} tokens "
                    f"({len(prompt_ids)} in the messages, {max_tokens} in the completion)."
                )
        except PromptError as exc:
            self._send_json(400, _error_body(str(exc), "BadRequestError", 400))
            return
        stream = bool(body.get("stream", False))
        try:
            completion = app.loop.submit(prompt_ids, max_tokens)
        except (EngineDeadError, EngineStopping) as exc:
            self._send_json(*_engine_error(exc))
            return
        created = int(time.time())
        head = {"id": completion.request_id, "object": "text_completion", "created": created,
                "model": app.served_model_name}
        if stream:
            self._stream(completion, head, detokenize)
            return
        tokens: list[int] = []
        finish_reason = None
        try:
            while finish_reason is None:
                delta = completion.next_event(timeout=REQUEST_TIMEOUT_S)
                tokens.extend(delta.token_ids)
                finish_reason = delta.finish_reason
        except Exception as exc:  # dead, stopping, or queue.Empty: no progress for this request
            self._send_json(*_engine_error(exc))
            return
        self._send_json(200, {
            **head,
            "choices": [{"index": 0, "text": detokenize(tokens), "logprobs": None,
                         "finish_reason": finish_reason, "stop_reason": None}],
            "usage": {"prompt_tokens": completion.num_prompt_tokens, "completion_tokens": len(tokens),
                      "total_tokens": completion.num_prompt_tokens + len(tokens)},
        })

    def _stream(self, completion, head, detokenize) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def event(payload) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        num_tokens = 0
        try:
            while True:
                delta = completion.next_event(timeout=REQUEST_TIMEOUT_S)
                num_tokens += len(delta.token_ids)
                event({**head, "choices": [{"index": 0, "text": detokenize(delta.token_ids), "logprobs": None,
                                            "finish_reason": delta.finish_reason, "stop_reason": None}]})
                if delta.finish_reason is not None:
                    break
            event({**head, "choices": [], "usage": {
                "prompt_tokens": completion.num_prompt_tokens, "completion_tokens": num_tokens,
                "total_tokens": completion.num_prompt_tokens + num_tokens}})
        except Exception as exc:
            event(_engine_error(exc)[1])
        event("[DONE]")


def _process_age() -> str:
    """Seconds since this process started (fork time under a zygote), from /proc."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return f"{uptime - start_ticks / os.sysconf('SC_CLK_TCK'):.2f} s"
    except (OSError, ValueError, IndexError):
        return "unknown"


def main(argv: list[str] | None = None, on_ready=None) -> int:
    """Run the engine until SIGTERM/SIGINT; the exit code. ``on_ready()`` runs once serving."""
    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    # The probe first: it must be in place before vLLM imports the offloading scheduler.
    probe = load_probe()
    from . import config

    try:
        config.install_sim_platform()
        version = config.check_vllm_api()
        knobs = config.SimKnobs.from_env()
        engine_args, options = config.parse_args(argv)
        logger.info("kvrepro sim engine: vLLM %s from %s; args: %s", version,
                    Path(sys.modules["vllm"].__file__).parent, " ".join(config.redact(argv)))
        if version not in config.TESTED_VLLM_VERSIONS:
            logger.warning("kvrepro sim engine was written against vLLM %s; this is %s",
                           ", ".join(config.TESTED_VLLM_VERSIONS), version)
        from .executor import SimExecutor

        vllm_config = config.build_vllm_config(engine_args, SimExecutor)
        from vllm.v1.engine.core import EngineCore

        core = EngineCore(vllm_config, executor_class=SimExecutor, log_stats=True)
    except config.EngineSetupError as exc:
        logger.error("%s", exc)
        return 2
    except Exception:
        logger.exception("EngineCore failed to start.")
        return 1

    from .loop import EngineLoop

    cache = vllm_config.cache_config
    logger.info("KV cache: %d GPU blocks (override), block size %d, mamba block size %s, groups: %s; sim knobs %s",
                cache.num_gpu_blocks, cache.block_size, cache.mamba_block_size,
                ", ".join(type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups),
                knobs)
    vocab_size = int(vllm_config.model_config.get_vocab_size())
    max_model_len = int(vllm_config.model_config.max_model_len)
    loop = EngineLoop(core)
    app = SimApp(loop, core.model_executor, probe, options.served_model_name, str(options.model_dir),
                 max_model_len, vocab_size)
    handler = type("SimHandler", (Handler,), {"app": app})
    try:
        httpd = SimHTTPServer((options.host, options.port), handler)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", options.host, options.port, exc)
        return 2

    stop = threading.Event()

    def on_signal(signum, frame):
        logger.info("Received %s, shutting down.", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    loop.start()
    server_thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="http",
                                     daemon=True)
    server_thread.start()
    logger.info("Starting vLLM API server (kvrepro sim engine) on http://%s:%d", options.host, options.port)
    logger.info("Engine ready in %.2f s (process start to serving: %s).", time.monotonic() - started,
                _process_age())
    logger.info("Application startup complete.")
    if on_ready is not None:
        threading.Thread(target=on_ready, name="on-ready", daemon=True).start()
    while not stop.wait(0.1):
        pass
    httpd.shutdown()
    loop.stop()
    # EngineCore.shutdown() would end with a full gc.collect() (0.6 s with torch loaded) that a
    # process about to exit has no use for; the executor and scheduler (connector) shut down.
    for part in (core.model_executor.shutdown, core.scheduler.shutdown):
        try:
            part()
        except Exception:
            logger.exception("EngineCore shutdown failed.")
    httpd.server_close()
    logger.info("Shutdown complete.")
    import logging

    logging.shutdown()
    return 0
