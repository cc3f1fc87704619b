"""Tests of kvrepro.loadgen.http (the load generator's aiohttp client) and of how the runner uses
it, against real local servers (sockets, ``http.server``), no mocks: a request is sent at most once
(aiohttp retries only idempotent methods; a completion is a POST), its trace line is on disk before
it arrives, keep-alive reuse and reopening after the server's idle close, bodies chunked, cut or
ending with the connection, streamed answers, the inactivity timeout, and that a run stopped by an
exception (Ctrl-C) leaves no connection or thread behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvrepro.loadgen import http, run_load
from kvrepro.loadgen.runner import new_event_loop
from kvrepro.spec.matrix import LoadEventSpec, LoadSpec, RunsSpec

LOAD = LoadSpec(profile="shared_prefix", concurrency=3, documents=2, document_tokens=30, min_prefix_tokens=1,
                suffix_tokens=(0, 3), max_tokens=2, vocab_size=100)


def _run(coro):
    loop = new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def _get(url: str, path: str = "/", timeout: float = 5.0) -> http.Response:
    async with http.Client(url, connections=1, timeout=timeout) as client:
        return await client.get(path)


class _RawServer:
    """A socket server that answers every connection with ``reply(conn)``: bytes as we choose them,
    cut where we choose (what a library's parser must put together)."""

    def __init__(self, reply):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)  # the request (small, in one piece on loopback)
                try:
                    self.reply(conn)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"7\r\ndata: a\r\n" b"10\r\n" + b"x" * 16 + b"\r\n" b"0\r\n\r\n")


def _with_raw(reply, path: str = "/", timeout: float = 5.0):
    server = _RawServer(reply)
    try:
        return _run(_get(server.url, path, timeout))
    finally:
        server.close()


def test_a_chunked_body_cut_into_single_bytes_is_read_whole():
    def trickle(conn):
        for i in range(len(CHUNKED)):
            conn.sendall(CHUNKED[i:i + 1])
            time.sleep(0.001)

    response = _with_raw(trickle)
    assert (response.status, response.body) == (200, b"data: a" + b"x" * 16)


def test_a_body_without_length_ends_with_the_connection():
    response = _with_raw(lambda conn: conn.sendall(b"HTTP/1.0 200 OK\r\n\r\ndata: [DONE]\n\n"))
    assert (response.status, response.body) == (200, b"data: [DONE]\n\n")


def test_a_body_cut_short_or_what_is_not_http_is_an_error():
    with pytest.raises(http.HttpError) as caught:
        _with_raw(lambda conn: conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: 5\r\n\r\nabc"))
    assert not caught.value.connect
    with pytest.raises(http.HttpError) as caught:
        _with_raw(lambda conn: conn.sendall(CHUNKED[:-5]))  # the last chunk never comes
    assert not caught.value.connect
    with pytest.raises(http.HttpError) as caught:
        _with_raw(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"))
    assert not caught.value.connect


# --------------------------------------------------------------------------- against a server

class _Server:
    """An HTTP/1.1 keep-alive server that counts the connections it accepted. ``close_every``:
    it closes the connection after that many responses on it. ``trickle_s``: the body of a
    request whose path is /trickle comes one byte at a time with that pause in between.
    ``idle_close_s``: it closes a keep-alive connection idle that long (as uvicorn does after 5 s).
    ``drop_every``: the Nth request on a connection is read whole, then the connection is closed
    without an answer (a server closing a reused connection as the request goes out).
    ``trace_path``: on each POST, the number of request lines in that trace file is noted.
    ``drop_path``: a request for a path starting with it is read whole and never answered (the
    connection closed), as an engine that dies with that request in flight."""

    def __init__(self, close_every: int = 0, trickle_s: float = 0.0, idle_close_s: float | None = None,
                 drop_every: int = 0, trace_path=None, drop_path: str | None = None):
        self.connections = 0
        self.requests = 0
        self.posts = 0  # POSTs received whole, answered or not
        self.dropped = 0
        self.trace_lines: list[int] = []  # request lines in the trace as each POST arrived
        self.ranks: list[str | None] = []  # X-data-parallel-rank of each POST, in arrival order
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle_close_s  # a read that waits this long ends the connection

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                outer.connections += 1
                self.served = 0

            def do_GET(self):
                self._answer()

            def do_POST(self):
                outer.ranks.append(self.headers.get("X-data-parallel-rank"))
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.posts += 1
                if trace_path is not None:
                    outer.trace_lines.append(len(trace_path.read_text().splitlines()) - 1)  # less the header
                self._answer(body)

            def _answer(self, body: bytes = b""):
                outer.requests += 1
                self.served += 1
                if drop_path and self.path.startswith(drop_path) or drop_every and self.served % drop_every == 0:
                    outer.dropped += 1
                    self.close_connection = True  # no answer: the client sees the connection close
                    return
                if b'"stream": true' in body:
                    return self._stream()
                if self.path == "/v1/models":
                    data = json.dumps({"data": [{"id": "m"}]}).encode()
                else:
                    data = json.dumps({"choices": [{"text": "x"}], "usage": {"completion_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                if close_every and self.served >= close_every:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                if self.path == "/trickle":
                    for byte in data:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(trickle_s)
                else:
                    self.wfile.write(data)

            def _stream(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                events = [{"choices": [{"text": "x"}]}, {"choices": [{"text": "y"}]},
                          {"choices": [], "usage": {"completion_tokens": 2}}]
                if self.path == "/v1/completions" and outer.posts == 2:  # the engine fails mid-stream
                    events[1] = {"object": "error", "message": "EngineCore encountered an issue"}
                for event in events:
                    self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
                    time.sleep(0.01)
                self._chunk(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")

            def _chunk(self, data: bytes):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def _runs(**kw) -> RunsSpec:
    return RunsSpec(**{"requests": 30, "duration_s": 30.0, "request_timeout_s": 5.0, "stall_timeout_s": 5.0, **kw})


def test_each_slot_keeps_one_connection_for_all_its_requests(server, tmp_path):
    summary = run_load(server.url, LOAD, _runs(requests=30), tmp_path / "l.jsonl", seed=0, alive=lambda: True)
    assert (summary.stopped_because, summary.requests_ok) == ("budget", 30)
    # /v1/models on one of its own, then one per slot
    assert server.connections == 1 + LOAD.concurrency
    assert server.requests == 31


def test_a_connection_the_server_closes_is_reopened_and_no_request_is_lost(tmp_path):
    server = _Server(close_every=2)
    try:
        load = LOAD.model_copy(update={"concurrency": 1})
        summary = run_load(server.url, load, _runs(requests=9), tmp_path / "l.jsonl", seed=0, alive=lambda: True)
        assert (summary.stopped_because, summary.requests_ok, summary.requests_failed) == ("budget", 9, 0)
        assert server.requests == 1 + 9  # each sent once: nothing retried
        assert server.connections == 1 + 5  # 9 requests, two per connection
    finally:
        server.close()


def _request(server: _Server, path: str, timeout: float) -> http.Response:
    return _run(http.fetch(server.url, path, timeout))


def test_the_timeout_is_for_silence_not_for_the_whole_answer():
    server = _Server(trickle_s=0.05)
    try:
        # ~60 bytes, 0.05 s apart: the whole answer takes ~3 s, never 1 s without a byte
        response = _request(server, "/trickle", timeout=1.0)
        assert response.status == 200 and json.loads(response.body)["usage"] == {"completion_tokens": 2}
        with pytest.raises(http.HttpTimeout) as caught:
            _request(server, "/trickle", timeout=0.01)
        assert not caught.value.connect
    finally:
        server.close()


def test_refused_connection_is_a_connect_error():
    server = _Server()
    port = server.port
    server.close()
    with pytest.raises(http.HttpError) as caught:
        _run(http.fetch(f"http://127.0.0.1:{port}", "/health", 2.0))
    assert caught.value.connect and "Connect" in str(caught.value)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") and not os.environ.get("CI"), reason="needs /proc (fails under CI)")
def test_an_exception_in_the_run_leaves_no_connection_or_thread_behind(server, tmp_path):
    """Ctrl-C lands as a KeyboardInterrupt wherever the calling thread is; here in on_progress."""
    # a first run: what the event loop library makes once per process (uvloop: a pipe) is not a leak
    run_load(server.url, LOAD, _runs(requests=3), tmp_path / "warm.jsonl", seed=0, alive=lambda: True)
    fds, threads = _open_fds(), set(threading.enumerate())

    def progress(finished, _total):
        if finished >= 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_load(server.url, LOAD, _runs(requests=100_000), tmp_path / "l.jsonl", seed=0, alive=lambda: True,
                 on_progress=progress, trace_path=tmp_path / "t.jsonl")
    # the server runs in this process: its side of each connection (a socket and a thread)
    # goes once it sees our side closed; a client that left a connection open fails here
    deadline = time.monotonic() + 5
    while not (_open_fds() <= fds and set(threading.enumerate()) <= threads) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _open_fds() <= fds, {f: os.readlink(f"/proc/self/fd/{f}") for f in _open_fds() - fds}  # sockets, files
    assert set(threading.enumerate()) <= threads  # (other tests' server threads may end meanwhile)
    records = [json.loads(line) for line in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert len(records) >= 5 and all(r["ok"] for r in records)


def test_the_encoded_ids_give_the_same_trace_line_and_the_same_hash_as_before(server, tmp_path):
    """The ids are encoded once per request (runner) and reused: the trace line and the record's
    prompt_sha256 must be what encoding them separately gave (earlier runs are compared to them)."""
    import hashlib

    from kvrepro.loadgen import get_profile
    from kvrepro.loadgen.profiles import Prompt
    from kvrepro.loadgen.trace import TraceHeader, open_writer

    prompt = Prompt(index=7, tokens=(5, 0, 123, 99999), max_tokens=3)
    writer = open_writer(tmp_path / "t.jsonl", TraceHeader())
    writer.request(prompt, slot=1, sent_s=0.5, in_flight=2)
    writer.request(prompt, slot=1, sent_s=0.5, in_flight=2, tokens_json="[5,0,123,99999]")
    writer.close()
    first, second = (tmp_path / "t.jsonl").read_text().splitlines()[1:]
    assert first == second and json.loads(first)["tokens"] == [5, 0, 123, 99999]

    run_load(server.url, LOAD, _runs(requests=6), tmp_path / "l.jsonl", seed=4, alive=lambda: True)
    profile = get_profile(LOAD.profile)(LOAD, seed=4)
    for record in map(json.loads, (tmp_path / "l.jsonl").read_text().splitlines()):
        tokens = profile.prompt(record["index"]).tokens
        assert record["prompt_sha256"] == hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def test_affinity_routing_sends_each_family_to_one_rank_and_the_replay_does_too(server, tmp_path):
    """dp_routing: affinity puts vLLM's X-data-parallel-rank header on every request (all uses of a
    family on one rank); the trace records the rank and a replay sends the same headers. Without
    it (the default, and with one rank) no header goes out: vLLM's balancer chooses."""
    from kvrepro.loadgen.runner import replay_load
    from kvrepro.loadgen.profiles import EngineCapacity
    from kvrepro.loadgen.trace import TraceHeader, read_trace

    cap = EngineCapacity(gpu_tokens=400, block_tokens=16, chunk_tokens=16, max_model_len=1024, data_parallel_size=4)
    load = LoadSpec(concurrency=1, max_tokens=2, vocab_size=100, dp_routing="affinity")
    out = tmp_path / "l.jsonl"
    run_load(server.url, load, _runs(requests=24), out, seed=0, alive=lambda: True, capacity=cap,
             trace_path=tmp_path / "trace.jsonl", trace_header=TraceHeader(build="A"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    sent = [int(r) for r in server.ranks]
    assert len(sent) == 24 and set(sent) == {0, 1, 2, 3}
    for record, rank in zip(records, sent):
        assert rank == record["family"] % 4  # every use of a family on the same rank
    trace = read_trace(tmp_path / "trace.jsonl")
    assert [r.rank for r in trace.requests] == sent

    server.ranks.clear()
    replay_load(server.url, trace, _runs(), tmp_path / "replay.jsonl", alive=lambda: True)
    assert [int(r) for r in server.ranks] == sent

    server.ranks.clear()
    run_load(server.url, load.model_copy(update={"dp_routing": "engine"}), _runs(requests=6), tmp_path / "e.jsonl",
             seed=0, alive=lambda: True, capacity=cap)
    run_load(server.url, load, _runs(requests=6), tmp_path / "one.jsonl", seed=0, alive=lambda: True,
             capacity=EngineCapacity(gpu_tokens=400, max_model_len=1024))
    assert server.ranks == [None] * 12


# --------------------------------------------------------------------------- at most once, keep-alive

def test_a_post_is_never_retried_when_the_server_closes_a_reused_connection():
    """The server reads the second request on each connection whole, then closes without an
    answer. aiohttp sends a GET again on a new connection (RFC 9112 allows it for idempotent
    methods); a POST it must not: the engine would see a request twice, the trace once."""
    server = _Server(drop_every=2)

    async def twice(method):
        async with http.Client(server.url, connections=1, timeout=5) as client:
            first = await client.request(method, "/v1/completions", b"{}" if method == "POST" else None)
            try:
                return first, await client.request(method, "/v1/completions", b"{}" if method == "POST" else None)
            except http.HttpError as exc:
                return first, exc

    try:
        first, second = _run(twice("POST"))
        assert first.status == 200 and isinstance(second, http.HttpError) and not second.connect
        assert (server.posts, server.connections) == (2, 1)  # sent once: no second connection, no resend
        server.requests = server.connections = 0
        first, second = _run(twice("GET"))
        assert (first.status, second.status) == (200, 200)
        assert (server.requests, server.connections) == (3, 2)  # the library's retry, on a new connection
    finally:
        server.close()


def test_a_run_sends_each_request_once_when_the_server_drops_answers(tmp_path):
    """Through the runner: a dropped answer is one failed request (the engine is asked, answers
    /health 200, the run goes on), never a resend; the server saw exactly the requests sent."""
    server = _Server(drop_every=3)
    try:
        load = LOAD.model_copy(update={"concurrency": 1})
        summary = run_load(server.url, load, _runs(requests=10), tmp_path / "l.jsonl", seed=0, alive=lambda: True)
        assert summary.stopped_because == "budget"
        assert server.posts == summary.requests_sent == 10
        assert summary.requests_failed == server.dropped >= 3
        records = [json.loads(line) for line in (tmp_path / "l.jsonl").read_text().splitlines()]
        assert len(records) == 10 and sum(not r["ok"] for r in records) == summary.requests_failed
    finally:
        server.close()


def test_a_prefix_cache_reset_the_engine_never_answers_is_a_line_of_the_record_not_a_traceback(tmp_path):
    """A load event's POST /reset_prefix_cache in flight when the engine dies (here: the server reads
    it and closes the connection unanswered) ends as a reset line with the error; the run goes on to
    its budget instead of the worker's exception ending the whole command (a suite run died so)."""
    server = _Server(drop_path="/reset_prefix_cache")
    try:
        load = LOAD.model_copy(update={"concurrency": 1, "events": [LoadEventSpec(at=2, reset_prefix_cache="local")]})
        summary = run_load(server.url, load, _runs(requests=4), tmp_path / "l.jsonl", seed=0, alive=lambda: True)
        assert summary.stopped_because == "budget" and summary.requests_sent == 4
        lines = [json.loads(line) for line in (tmp_path / "l.jsonl").read_text().splitlines()]
        (reset,) = [r for r in lines if r.get("event") == "reset_prefix_cache"]
        assert reset["success"] is False and reset["status"] is None and reset["error"]
    finally:
        server.close()


def test_a_connection_the_server_closed_while_idle_is_reopened(tmp_path):
    server = _Server(idle_close_s=0.2)

    async def go():
        async with http.Client(server.url, connections=1, timeout=5) as client:
            answers = [await client.post("/v1/completions", b"{}")]
            answers.append(await client.post("/v1/completions", b"{}"))  # reused
            await asyncio.sleep(0.6)  # the server closes it meanwhile
            answers.append(await client.post("/v1/completions", b"{}"))
            return answers

    try:
        assert [r.status for r in _run(go())] == [200, 200, 200]
        assert (server.posts, server.connections) == (3, 2)
    finally:
        server.close()


def test_a_connection_idle_past_idle_reopen_is_not_reused(server, monkeypatch):
    """The server may drop an idle connection just as a request goes out (uvicorn: after 5 s);
    one idle longer than IDLE_REOPEN_S is replaced before the request is sent."""
    monkeypatch.setattr(http, "IDLE_REOPEN_S", 0.2)

    async def go(pause):
        async with http.Client(server.url, connections=1, timeout=5) as client:
            await client.post("/v1/completions", b"{}")
            await asyncio.sleep(pause)
            await client.post("/v1/completions", b"{}")

    _run(go(0.0))
    assert server.connections == 1
    _run(go(0.5))
    assert (server.connections, server.posts) == (3, 4)


def test_the_trace_line_is_on_disk_before_the_request_arrives(tmp_path):
    trace = tmp_path / "trace.jsonl"
    server = _Server(trace_path=trace)
    try:
        load = LOAD.model_copy(update={"concurrency": 1})
        run_load(server.url, load, _runs(requests=6), tmp_path / "l.jsonl", seed=0, alive=lambda: True,
                 trace_path=trace)
        assert server.trace_lines == [1, 2, 3, 4, 5, 6]  # the Nth request found N request lines
    finally:
        server.close()


def test_streamed_answers_are_read_to_the_end_and_an_engine_error_in_a_stream_counts(tmp_path):
    server = _Server()
    try:
        load = LOAD.model_copy(update={"concurrency": 1, "stream": True})
        summary = run_load(server.url, load, _runs(requests=3), tmp_path / "l.jsonl", seed=0, alive=lambda: True)
        records = [json.loads(line) for line in (tmp_path / "l.jsonl").read_text().splitlines()]
        assert [r["ok"] for r in records] == [True, False, True]
        assert records[0]["completion_tokens"] == 2 and "error in stream" in records[1]["error"]
        assert (summary.stopped_because, summary.requests_failed, server.posts) == ("budget", 1, 3)
    finally:
        server.close()
