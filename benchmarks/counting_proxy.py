"""A counting reverse proxy: how many generation requests an external client got to the engine.

Put in front of an engine (``CountingProxy(engine_url).start()``) and point a load tool that
kvrepro does not control (``vllm bench serve``, guidellm) at ``proxy.url``. Every request is
passed through unchanged but for its ``X-Request-Id`` header, which the proxy sets to
kvrepro's own naming (``kvrepro-<number - 1>``, as kvrepro's load names its requests; vLLM builds
its request id from it, so the engine log's lines about a request carry its number) (streamed responses are relayed chunk by chunk as they arrive); the
proxy counts *generation* requests (``POST`` to ``/v1/completions``, ``/v1/chat/completions``
or ``/v1/responses``) in the order they arrive, numbers each before it is sent on, and records
how it ended.

A generation request *failed* when the engine answered 5xx, the connection to it broke, or a
streamed (server-sent events) answer carried an ``error`` object or ended without
``data: [DONE]``. A failure alone does not mean the engine is gone: the proxy then asks the
engine's ``/health``; unless it answers 200, the engine is *dead*: the proxy closes, and every
later generation request is refused by the proxy itself (503) without reaching the engine.

So ``forwarded`` is exact: the number of generation requests the engine received, the one it
died on and any that were in flight with it included. With one request at a time (a client at
concurrency 1), that is the number of the request the engine died on.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvrepro.loadgen import request_id  # noqa: E402

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length"}
_UPSTREAM_TIMEOUT_S = 600.0


@dataclass
class Forwarded:
    """One generation request the engine received: its number (1-based, arrival order) and end."""

    index: int
    path: str
    arrived: float = 0.0  # time.monotonic() when the proxy got it
    status: int | None = None  # the engine's HTTP status; None: no answer (connection failed)
    failed: bool = False
    error: str | None = None
    finished: bool = False


@dataclass
class ProxyCounts:
    forwarded: int  # generation requests the engine received
    finished: int  # of those, answered to the end (failed or not)
    failed: int
    client_errors: int  # 4xx answers (a refused prompt: the load did not test the engine)
    refused: int  # generation requests the proxy refused itself after the engine died
    dead: bool
    first_failure: int | None  # number of the first failed request
    failures: list[str] = field(default_factory=list)  # first few failure descriptions


class CountingProxy:
    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0,
                 health_path: str = "/health", generation_paths: tuple[str, ...] = GENERATION_PATHS,
                 trace_path: Path | None = None):
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.health_path = health_path
        self.generation_paths = generation_paths
        self.records: list[Forwarded] = []
        self.refused = 0
        self.dead = threading.Event()
        self.last_answer = time.monotonic()  # when a generation request last finished
        self._lock = threading.Lock()
        # every generation request as the engine got it, one JSON line each: {"index", "path", "body"}
        self._trace = trace_path.open("a", encoding="utf-8") if trace_path is not None else None
        self._server = _QuietServer((host, port), self._handler_class())
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "CountingProxy":
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                         name="kvrepro-counting-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            if self._trace is not None:
                self._trace.close()
                self._trace = None

    def __enter__(self) -> "CountingProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what was seen -------------------------------------------------------------------------

    def in_flight(self) -> int:
        with self._lock:
            return sum(not r.finished for r in self.records)

    def waiting_for(self, now: float | None = None) -> float:
        """Seconds the engine has kept requests in flight without finishing any (0: none in flight):
        since the last answer, or since the oldest request in flight arrived if that is later."""
        now = time.monotonic() if now is None else now
        with self._lock:
            pending = [r.arrived for r in self.records if not r.finished]
            if not pending:
                return 0.0
            return now - max(self.last_answer, min(pending))

    def counts(self) -> ProxyCounts:
        with self._lock:
            records = list(self.records)
            refused = self.refused
        failed = [r for r in records if r.failed]
        return ProxyCounts(
            forwarded=len(records), finished=sum(r.finished for r in records), failed=len(failed),
            client_errors=sum(1 for r in records if r.status is not None and 400 <= r.status < 500),
            refused=refused, dead=self.dead.is_set(),
            first_failure=min((r.index for r in failed), default=None),
            failures=[f"#{r.index} {r.path}: {r.error}" for r in sorted(failed, key=lambda r: r.index)[:3]],
        )

    # -- the engine ----------------------------------------------------------------------------

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=timeout)

    def engine_healthy(self) -> bool:
        conn = self._connection(2.0)
        try:
            conn.request("GET", self.health_path)
            resp = conn.getresponse()
            resp.read()
            return resp.status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def _begin(self, path: str, body: bytes) -> Forwarded | None:
        """Number a generation request, or None when the engine is dead (the proxy refuses it)."""
        with self._lock:
            if self.dead.is_set():
                self.refused += 1
                return None
            record = Forwarded(index=len(self.records) + 1, path=path, arrived=time.monotonic())
            self.records.append(record)
            if self._trace is not None:
                self._trace.write(json.dumps({"index": record.index, "path": path,
                                              "body": body.decode("utf-8", "replace")}) + "\n")
                self._trace.flush()
            return record

    def _end(self, record: Forwarded, status: int | None, error: str | None) -> None:
        failed = error is not None or status is None or status >= 500
        with self._lock:
            record.status = status
            record.failed = failed
            record.error = error if error is not None else (f"HTTP {status}" if failed else None)
            record.finished = True
            self.last_answer = time.monotonic()
        if failed and not self.dead.is_set() and not self.engine_healthy():
            self.dead.set()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _forward(self) -> None:
                body = self._body()
                path = self.path.split("?", 1)[0]
                record = None
                if self.command == "POST" and path in proxy.generation_paths:
                    record = proxy._begin(path, body)
                    if record is None:
                        self._reply(503, {"error": {"message": "the engine died (kvrepro counting proxy)",
                                                    "type": "EngineDead", "code": 503}})
                        return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in _HOP_BY_HOP and k.lower() != "x-request-id"}
                headers["Content-Length"] = str(len(body))
                if record is not None:
                    # the engine names the request by it in its log, as for kvrepro's own load (a
                    # shadow-KV violation then says which request it was: record.index, from 1)
                    headers["X-Request-Id"] = request_id(record.index - 1)
                conn = proxy._connection(_UPSTREAM_TIMEOUT_S)

                def settle(status: int | None, error: str | None) -> None:
                    # before the client has the whole answer: a client that sends its next request
                    # the moment this one ends must find the proxy closed if the engine died
                    if record is not None and not record.finished:
                        proxy._end(record, status, error)

                status: int | None = None
                try:
                    try:
                        conn.request(self.command, self.path, body=body, headers=headers)
                        resp = conn.getresponse()
                    except (OSError, http.client.HTTPException) as exc:
                        error = f"engine unreachable: {exc!r}"
                        settle(None, error)
                        self._reply(502, {"error": {"message": error, "type": "BadGateway", "code": 502}})
                        return
                    status = resp.status
                    self._relay(resp, settle)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away
                finally:
                    conn.close()
                    settle(status, None)

            def _relay(self, resp: http.client.HTTPResponse, settle) -> None:
                """Send the engine's answer on, calling ``settle(status, why it failed or None)``
                before the client can have all of it."""
                sse = "text/event-stream" in (resp.getheader("Content-Type") or "")
                length = resp.getheader("Content-Length")
                if length is not None and not sse:
                    data = resp.read()
                    settle(resp.status, None)
                    self.send_response(resp.status, resp.reason)
                    self._copy_headers(resp)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if resp.status >= 500:
                    settle(resp.status, None)
                self.send_response(resp.status, resp.reason)
                self._copy_headers(resp)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                scan = _SseScan(expect_done=self.path.split("?", 1)[0] != "/v1/responses") if sse else None
                cut: str | None = None
                while True:
                    try:
                        chunk = resp.read1(65536)
                    except (OSError, http.client.HTTPException) as exc:  # the engine's side broke
                        cut = f"answer cut off: {exc!r}"
                        break
                    if not chunk:
                        break
                    if scan is not None:
                        scan.feed(chunk)
                        if scan.error is not None and resp.status < 400:
                            settle(resp.status, scan.error)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))  # a client gone raises here
                    self.wfile.flush()
                problem = cut
                if problem is None and scan is not None and resp.status < 400:
                    problem = scan.problem()
                settle(resp.status, problem)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def _copy_headers(self, resp: http.client.HTTPResponse) -> None:
                for key, value in resp.getheaders():
                    if key.lower() not in _HOP_BY_HOP:
                        self.send_header(key, value)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

        return Handler


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up (a load tool being stopped) is not an error worth a traceback."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class _SseScan:
    """Watches a server-sent-events stream for an ``error`` object and for its ``[DONE]`` line."""

    def __init__(self, expect_done: bool = True) -> None:
        self.expect_done = expect_done
        self._buffer = b""
        self.done = False
        self.error: str | None = None

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            if self.error is None and b'"error"' in data:
                try:
                    event = json.loads(data)
                except ValueError:
                    continue
                if isinstance(event, dict) and event.get("error"):
                    self.error = f"error in stream: {json.dumps(event['error'])[:300]}"

    def problem(self) -> str | None:
        if self.error is not None:
            return self.error
        if self.expect_done and not self.done:
            return "stream ended without [DONE]"
        return None
