"""Tests of kvrepro.loadgen.http (the load generator's HTTP/1.1 client) and of what the asyncio
client changed in the runner: keep-alive reuse, the three ways a body ends, chunks cut at every
byte, reopening a connection the server closed, the inactivity timeout, and that a run stopped
by an exception (Ctrl-C) leaves no connection or thread behind.
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
from kvrepro.spec.matrix import LoadSpec, RunsSpec

LOAD = LoadSpec(profile="shared_prefix", concurrency=3, documents=2, document_tokens=30, min_prefix_tokens=1,
                suffix_tokens=(0, 3), max_tokens=2, vocab_size=100)


class _Transport:
    """Stands in for a transport: records writes and whether it was closed."""

    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed


def _feed(pieces: list[bytes], eof: bool = False) -> tuple[http.Response | None, BaseException | None, bool]:
    """(response, error, transport closed) after feeding ``pieces`` (then EOF if ``eof``)."""
    loop = asyncio.new_event_loop()
    try:
        proto = http._Protocol()
        transport = _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        waiter = loop.create_future()
        proto.waiter = waiter
        for piece in pieces:
            proto.data_received(piece)
        if eof:
            proto.eof_received()
        if not waiter.done():
            return None, None, transport.closed
        if waiter.exception() is not None:
            return None, waiter.exception(), transport.closed
        return waiter.result(), None, transport.closed
    finally:
        loop.close()


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"7\r\ndata: a\r\n" b"10\r\n" + b"x" * 16 + b"\r\n" b"0\r\n\r\n")


def test_a_chunked_body_is_the_same_however_the_bytes_are_cut():
    whole, error, closed = _feed([CHUNKED])
    assert error is None and whole is not None
    assert (whole.status, whole.body, closed) == (200, b"data: a" + b"x" * 16, False)  # kept alive
    for cut in range(1, len(CHUNKED)):
        response, error, _ = _feed([CHUNKED[:cut], CHUNKED[cut:]])
        assert error is None and response == whole, cut
    response, error, _ = _feed([CHUNKED[i:i + 1] for i in range(len(CHUNKED))])
    assert response == whole


def test_a_chunked_body_without_its_last_chunk_is_not_finished():
    response, error, _ = _feed([CHUNKED[:-5]])
    assert (response, error) == (None, None)
    response, error, _ = _feed([CHUNKED[:-5]], eof=True)
    assert response is None and isinstance(error, http.HttpError)


def test_content_length_body_and_the_bytes_after_it():
    head = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 5\r\n\r\n"
    response, error, closed = _feed([head + b"ab", b"cde"])
    assert (response.status, response.body, error, closed) == (500, b"abcde", None, False)
    response, error, _ = _feed([head + b"abc"], eof=True)  # cut short by the server
    assert response is None and "closed the connection" in str(error)


def test_a_body_without_length_ends_with_the_connection_and_is_not_reused():
    response, error, closed = _feed([b"HTTP/1.0 200 OK\r\n\r\n", b"data: [DONE]\n\n"])
    assert (response, error) == (None, None)  # more may come until the server closes
    response, error, closed = _feed([b"HTTP/1.0 200 OK\r\n\r\n", b"data: [DONE]\n\n"], eof=True)
    assert (response.body, error) == (b"data: [DONE]\n\n", None)
    response, error, closed = _feed([b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"])
    assert (response.body, closed) == (b"ok", True)


def test_bytes_past_the_response_or_a_bad_length_do_not_pass_unnoticed():
    response, error, closed = _feed([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA"])
    assert (response.body, error, closed) == (b"ok", None, True)  # answered, but not reused
    response, error, closed = _feed([b"HTTP/1.1 200 OK\r\nContent-Length: two\r\n\r\nok"])
    assert response is None and isinstance(error, http.HttpError) and closed


def test_what_is_not_http_is_an_error():
    response, error, closed = _feed([b"SSH-2.0-OpenSSH_9.6\r\n\r\n"])
    assert response is None and isinstance(error, http.HttpError) and closed


def test_parse_url():
    assert http.parse_url("http://127.0.0.1:8000") == ("127.0.0.1", 8000, "")
    assert http.parse_url("http://host:81/prefix/") == ("host", 81, "/prefix")
    with pytest.raises(ValueError):
        http.parse_url("https://host:443")


# --------------------------------------------------------------------------- against a server

class _Server:
    """An HTTP/1.1 keep-alive server that counts the connections it accepted. ``close_every``:
    it closes the connection after that many responses on it. ``trickle_s``: the body of a
    request whose path is /trickle comes one byte at a time with that pause in between."""

    def __init__(self, close_every: int = 0, trickle_s: float = 0.0):
        self.connections = 0
        self.requests = 0
        self.ranks: list[str | None] = []  # X-data-parallel-rank of each POST, in arrival order
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

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
                self._answer(body)

            def _answer(self, body: bytes = b""):
                outer.requests += 1
                self.served += 1
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
    async def go():
        return await http.fetch("127.0.0.1", server.port, http.build_request("GET", "127.0.0.1", server.port, path),
                                timeout)

    loop = new_event_loop()
    try:
        return loop.run_until_complete(go())
    finally:
        loop.close()


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
        loop = new_event_loop()
        try:
            loop.run_until_complete(http.fetch("127.0.0.1", port, b"GET / HTTP/1.1\r\n\r\n", 2.0))
        finally:
            loop.close()
    assert caught.value.connect and "Connection" in str(caught.value)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
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
    from kvrepro.loadgen.trace import open_writer

    prompt = Prompt(index=7, tokens=(5, 0, 123, 99999), max_tokens=3)
    writer = open_writer(tmp_path / "t.jsonl", {})
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
    from kvrepro.loadgen.trace import read_trace

    cap = EngineCapacity(gpu_tokens=400, block_tokens=16, chunk_tokens=16, max_model_len=1024, data_parallel_size=4)
    load = LoadSpec(concurrency=1, max_tokens=2, vocab_size=100, dp_routing="affinity")
    out = tmp_path / "l.jsonl"
    run_load(server.url, load, _runs(requests=24), out, seed=0, alive=lambda: True, capacity=cap,
             trace_path=tmp_path / "trace.jsonl", trace_header={"build": "A"})
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
