"""The counting proxy that measures external load tools: what it counts and when it closes.

A stand-in engine (stdlib HTTP server) answers like vLLM's API server: streamed completions that
end with ``data: [DONE]``, 500 and /health 503 once its EngineCore "died", or an ``error`` event in
the stream. No vLLM needed.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchmark-only code lives there
from counting_proxy import CountingProxy, _SseScan  # noqa: E402


class FakeEngine:
    """Dies on the request numbered ``die_on`` (1-based, generation requests only)."""

    def __init__(self, die_on: int | None = None, stream_error_on: int | None = None, flaky_on: int | None = None):
        self.die_on, self.stream_error_on, self.flaky_on = die_on, stream_error_on, flaky_on
        self.generation_requests = 0
        self.dead = False
        self.lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(503 if engine.dead else 200, b"")
                else:
                    self._send(200, json.dumps({"data": [{"id": "m"}]}).encode())

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with engine.lock:
                    engine.generation_requests += 1
                    n = engine.generation_requests
                    if n == engine.die_on:
                        engine.dead = True
                    dies_mid_stream = n == engine.stream_error_on
                if (engine.dead and not dies_mid_stream) or n == engine.flaky_on:
                    self._send(500, json.dumps({"error": {"message": "EngineCore died", "code": 500}}).encode())
                    return
                if not body.get("stream"):
                    self._send(200, json.dumps({"choices": [{"text": "abc"}]}).encode())
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                events = [{"choices": [{"text": t}]} for t in "abc"]
                if dies_mid_stream:  # vLLM's way: the status went out, the error comes as an event
                    events.append({"error": {"message": "boom", "code": 500}})
                    engine.dead = True
                for event in events:
                    data = f"data: {json.dumps(event)}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                done = b"data: [DONE]\n\n"
                self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def make():
    made = []

    def factory(**kwargs):
        engine = FakeEngine(**kwargs)
        proxy = CountingProxy(engine.url).start()
        made.append((engine, proxy))
        return engine, proxy

    yield factory
    for engine, proxy in made:
        proxy.stop()
        engine.close()


def complete(url: str, stream: bool = True) -> requests.Response:
    resp = requests.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": stream}, timeout=10)
    resp.content  # read the whole answer, stream included
    return resp


def test_counts_until_the_engine_dies_and_refuses_after(make):
    engine, proxy = make(die_on=4)
    assert requests.get(proxy.url + "/v1/models", timeout=10).ok  # passed on, not counted
    answers = [complete(proxy.url) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert b"data: [DONE]" in answers[0].content  # the stream reaches the client whole
    assert complete(proxy.url).status_code == 500  # the request the engine dies on
    assert proxy.dead.is_set()
    refused = complete(proxy.url)
    assert refused.status_code == 503 and "kvrepro" in refused.text
    counts = proxy.counts()
    assert (counts.forwarded, counts.first_failure, counts.failed, counts.refused) == (4, 4, 1, 1)
    assert engine.generation_requests == 4  # the refused one never reached the engine


def test_an_error_event_in_a_stream_is_a_failure(make):
    engine, proxy = make(stream_error_on=2)
    complete(proxy.url)
    assert complete(proxy.url).status_code == 200  # the status was sent before the error
    counts = proxy.counts()
    assert counts.dead and counts.forwarded == 2 and counts.first_failure == 2
    assert "boom" in counts.failures[0]


def test_a_failure_while_the_engine_is_healthy_does_not_close(make):
    engine, proxy = make(flaky_on=2)
    statuses = [complete(proxy.url, stream=False).status_code for _ in range(3)]
    assert statuses == [200, 500, 200]
    counts = proxy.counts()
    assert not counts.dead and counts.forwarded == 3 and counts.failed == 1


def test_sse_scan_needs_done_and_sees_errors_split_across_chunks():
    scan = _SseScan()
    scan.feed(b'data: {"choices": []}\n\ndata: {"err')
    scan.feed(b'or": {"message": "x"}}\n\n')
    assert "error in stream" in scan.problem()
    cut = _SseScan()
    cut.feed(b'data: {"choices": []}\n\n')
    assert cut.problem() == "stream ended without [DONE]"
    whole = _SseScan()
    whole.feed(b'data: {"choices": []}\n\ndata: [DONE]\n\n')
    assert whole.problem() is None


def test_waiting_counts_from_the_oldest_request_in_flight_not_from_the_proxys_start(make):
    engine, proxy = make()
    assert proxy.waiting_for() == 0.0  # nothing in flight: never a stall, however long the tool takes to start
    record = proxy._begin("/v1/completions", b"{}")
    assert record is not None
    assert proxy.waiting_for(now=record.arrived + 5) == 5  # not since the proxy was made
    proxy._end(record, 200, None)
    assert proxy.waiting_for() == 0.0
