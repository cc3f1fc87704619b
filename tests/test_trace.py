"""Tests of request traces (record, read, replay), the client's arrival/streaming/text options
and the minimizer's pure parts (ddmin, signature matching); the emitted test is covered by
tests/test_pytest_emit.py.

The client runs against ``StandInEngine`` (tests/test_loadgen.py), a stdlib HTTP server on
127.0.0.1 standing in for the engine's API, and against a small server-sent-events stand-in; the
real engine is driven by `kvrepro load replay` / `kvrepro minimize` runs (see docs/minimize.md).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvrepro.errors import SpecError
from kvrepro.loadgen import run_load
from kvrepro.loadgen.runner import _Arrivals, replay_load, tokens_to_text
from kvrepro.loadgen.trace import TraceHeader, TraceRequest, read_trace, write_trace
from kvrepro.minimize.shrink import ddmin, matches
from kvrepro.spec.matrix import LoadSpec, RunsSpec, TargetSignature
from test_loadgen import StandInEngine, lines

LOAD = LoadSpec(profile="partial-prefix", concurrency=3, max_tokens=4, vocab_size=500)


@pytest.fixture
def engine():
    e = StandInEngine()
    yield e
    e.close()


def runs(**kw) -> RunsSpec:
    return RunsSpec(**{"requests": 20, "duration_s": 30.0, "request_timeout_s": 5.0, "stall_timeout_s": 5.0, **kw})


def test_every_request_is_in_the_trace_in_the_order_sent(engine, tmp_path):
    trace_path = tmp_path / "trace.jsonl"
    summary = run_load(engine.url, LOAD, runs(), tmp_path / "load.jsonl", seed=1, alive=engine.alive,
                       trace_path=trace_path, trace_header=TraceHeader(build="A", rep=0))
    assert summary.stopped_because == "budget"
    trace = read_trace(trace_path)
    assert trace.header.build == "A" and trace.header.profile == "partial-prefix" and trace.header.seed == 1
    assert len(trace.requests) == 20
    # every request sent is in the trace (with three in flight, two may reach the server in
    # either order; sequential runs keep the order exactly: see the replay test)
    assert sorted(list(r.tokens) for r in trace.requests) == sorted(b["prompt"] for b in engine.bodies)
    assert {r.slot for r in trace.requests} <= {0, 1, 2}
    assert all(1 <= r.in_flight <= 3 for r in trace.requests)
    assert all(r.sent_s >= 0 for r in trace.requests)


def test_the_request_that_killed_the_engine_is_in_the_trace(engine, tmp_path):
    engine.die_after = 7
    load = LOAD.model_copy(update={"concurrency": 1})
    summary = run_load(engine.url, load, runs(), tmp_path / "load.jsonl", seed=0, alive=engine.alive,
                       trace_path=tmp_path / "trace.jsonl")
    assert summary.stopped_because == "engine_dead"
    assert summary.first_failed_index == 7
    assert len(read_trace(tmp_path / "trace.jsonl").requests) == 8


def test_replay_sends_the_trace_one_at_a_time_in_order(engine, tmp_path):
    run_load(engine.url, LOAD, runs(requests=12), tmp_path / "load.jsonl", seed=2, alive=engine.alive,
             trace_path=tmp_path / "trace.jsonl")
    sent = [b["prompt"] for b in engine.bodies]
    trace = read_trace(tmp_path / "trace.jsonl")
    replayed = StandInEngine()
    replayed.delay_s = 0.01  # gives overlapping requests a chance to show
    try:
        summary = replay_load(replayed.url, trace, runs(), tmp_path / "replay.jsonl", alive=replayed.alive,
                              trace_path=tmp_path / "replay.trace.jsonl")
        assert summary.stopped_because == "budget" and summary.requests_sent == 12
        assert [b["prompt"] for b in replayed.bodies] == [list(r.tokens) for r in trace.requests]
        assert sorted(map(tuple, sent)) == sorted(tuple(r.tokens) for r in trace.requests)
        assert all(b["max_tokens"] == 4 for b in replayed.bodies)
        assert {r["slot"] for r in lines(tmp_path / "replay.jsonl")} == {0}  # one slot: sequential
        again = read_trace(tmp_path / "replay.trace.jsonl")
        assert again.header.replay_of == str(tmp_path / "trace.jsonl")
        assert [r.in_flight for r in again.requests] == [1] * 12
    finally:
        replayed.close()


def test_replay_stops_at_the_request_that_fails(engine, tmp_path):
    requests = [TraceRequest(index=i, tokens=(i + 1, 2, 3), max_tokens=2) for i in range(10)]
    write_trace(tmp_path / "t.jsonl", _trace(tmp_path, requests))
    engine.die_after = 4
    summary = replay_load(engine.url, read_trace(tmp_path / "t.jsonl"), runs(), tmp_path / "r.jsonl",
                          alive=engine.alive)
    assert summary.stopped_because == "engine_dead" and summary.first_failed_index == 4


def _trace(tmp_path: Path, requests):
    from kvrepro.loadgen.trace import Trace

    return Trace(tmp_path / "t.jsonl", TraceHeader(load=LOAD.model_dump(), seed=0, rep=0), requests)


def test_a_file_that_is_not_a_trace_is_bad_input(tmp_path):
    bad = tmp_path / "load.jsonl"
    bad.write_text('{"index": 0}\n')
    with pytest.raises(SpecError, match=r"load.jsonl:1: not a kvrepro trace"):
        read_trace(bad)
    with pytest.raises(SpecError, match="no such trace"):
        read_trace(tmp_path / "missing.jsonl")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"trace": 1}\n{"index": 0, "max_tokens": 1}\n{"index": 1}\n')
    with pytest.raises(SpecError, match=r"broken.jsonl:2: a request line needs"):
        read_trace(broken)


def test_a_line_cut_by_a_crash_ends_the_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, _trace(tmp_path, [TraceRequest(index=0, tokens=(1, 2), max_tokens=1)]))
    with open(path, "a") as f:
        f.write('{"index": 1, "tok')
    assert len(read_trace(path).requests) == 1


def test_poisson_arrivals_are_seeded_and_increasing(engine, tmp_path):
    load = LOAD.model_copy(update={"arrival": "poisson", "rate_rps": 200.0})
    a, b = _Arrivals(load, 5), _Arrivals(load, 5)
    times = [a.offset(i) for i in range(50)]
    assert times == [b.offset(i) for i in range(50)] and times == sorted(times)
    assert times != [_Arrivals(load, 6).offset(i) for i in range(50)]
    summary = run_load(engine.url, load, runs(requests=15), tmp_path / "load.jsonl", seed=5, alive=engine.alive)
    assert summary.stopped_because == "budget" and summary.requests_ok == 15


def test_text_prompts_share_leading_words_when_tokens_share_a_prefix(engine, tmp_path):
    load = LOAD.model_copy(update={"prompt_format": "text", "concurrency": 1})
    run_load(engine.url, load, runs(requests=5), tmp_path / "load.jsonl", seed=0, alive=engine.alive,
             trace_path=tmp_path / "trace.jsonl")
    bodies = engine.bodies
    assert all(isinstance(b["prompt"], str) for b in bodies)
    trace = read_trace(tmp_path / "trace.jsonl")
    assert [b["prompt"] for b in bodies] == [tokens_to_text(r.tokens) for r in trace.requests]
    assert tokens_to_text((1, 2, 3)).startswith(tokens_to_text((1, 2)))


class _StreamingEngine:
    """Answers /v1/completions with server-sent events as vLLM does (or an error event)."""

    def __init__(self, fail: bool = False):
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                data = json.dumps({"data": [{"id": "m"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(body["max_tokens"]):
                    self.wfile.write(f'data: {json.dumps({"choices": [{"text": "x", "index": 0}]})}\n\n'.encode())
                if fail:
                    self.wfile.write(b'data: {"error": {"message": "EngineCore encountered an issue"}}\n\n')
                else:
                    usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
                    self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("fail", [False, True])
def test_streaming_requests_are_read_to_the_end(tmp_path, fail):
    engine = _StreamingEngine(fail)
    try:
        load = LOAD.model_copy(update={"stream": True, "concurrency": 2})
        summary = run_load(engine.url, load, runs(requests=6), tmp_path / "load.jsonl", seed=0, alive=lambda: True)
        assert all(b["stream"] is True and b["stream_options"] == {"include_usage": True} for b in engine.bodies)
        records = lines(tmp_path / "load.jsonl")
        if fail:
            assert summary.requests_ok == 0 and all("error in stream" in r["error"] for r in records)
        else:
            assert summary.requests_ok == 6 and all(r["completion_tokens"] == 4 for r in records)
    finally:
        engine.close()


# --------------------------------------------------------------------------- minimizer parts

def _req(i: int) -> TraceRequest:
    return TraceRequest(index=i, tokens=(i,), max_tokens=1)


def test_ddmin_finds_the_two_requests_that_matter():
    calls = []

    def crashes(candidate):
        calls.append(len(candidate))
        ids = [r.index for r in candidate]
        if 3 in ids and 7 in ids and ids.index(3) < ids.index(7):
            return candidate[:ids.index(7) + 1]  # the run ends at the crashing request
        return None

    result = ddmin([_req(i) for i in range(40)], crashes)
    assert [r.index for r in result] == [3, 7]
    assert len(calls) < 120


def test_ddmin_keeps_a_single_crashing_request():
    assert [r.index for r in ddmin([_req(i) for i in range(9)],
                                   lambda c: c if any(r.index == 5 for r in c) else None)] == [5]


SIG = TargetSignature(exception="AssertionError", function="update_state_after_alloc",
                      file="vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
                      expression="num_locally_computed_tokens <= num_locally_computed_gpu_blocks * tokens_per_block")


def test_signature_matching_reads_the_whole_statement():
    from kvrepro.minimize.shrink import OfflineResult

    crash = {"crashed": True, "exception": "AssertionError", "function": "update_state_after_alloc",
             "file": "/x/overlay/vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
             "statement": "assert ( num_locally_computed_tokens <= num_locally_computed_gpu_blocks * tokens_per_block )"}
    assert matches(OfflineResult.from_json(crash), SIG)
    assert not matches(OfflineResult.from_json({**crash, "statement": "assert len(offload_keys) == len(offload_block_ids)"}), SIG)
    assert not matches(OfflineResult.from_json({**crash, "function": "_build_store_jobs"}), SIG)
    assert not matches(OfflineResult.from_json({**crash, "crashed": False}), SIG)
