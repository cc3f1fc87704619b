"""Tests of kvrepro.loadgen: prompts of the shared-prefix profile and the concurrent client.

The client is driven against ``StandInEngine``, a small stdlib HTTP server on 127.0.0.1 that
stands in for the engine: it serves /v1/models, /v1/completions and /health like vLLM's API server
does, and can be told to die, to refuse connections or to hang, so that engine death and stalls
happen exactly when a test wants them. The real engine (the GPU-free one and `vllm serve`) is
driven end to end by the run tests elsewhere.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvrepro.errors import SpecError
from kvrepro.loadgen import get_profile, known_profiles, run_load
from kvrepro.spec.matrix import LoadSpec, RunsSpec

LOAD = LoadSpec(profile="shared_prefix", concurrency=4, documents=3, document_tokens=60, min_prefix_tokens=1, suffix_tokens=(0, 5),
                max_tokens=4, vocab_size=500)


def runs(**kw) -> RunsSpec:
    base = dict(requests=20, duration_s=30.0, request_timeout_s=5.0, stall_timeout_s=5.0)
    base.update(kw)
    return RunsSpec(**base)


class StandInEngine:
    """Stands in for the engine's HTTP API (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prompts: dict[int, list[int]] = {}  # arrival order -> prompt
        self.bodies: list[dict] = []
        self.request_ids: list[str | None] = []  # each POST's X-Request-Id, in arrival order
        self.dead = False  # EngineCore died: 500 on completions, 503 on /health, process gone
        self.die_after: int | None = None
        self.fail_numbers: set[int] = set()  # these arrivals get a 500 while the engine lives
        self.hang = False
        self.release = threading.Event()
        self.delay_s = 0.0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _json(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": "tiny-model", "object": "model"}]})
                elif self.path == "/health":
                    self._json(503 if engine.dead else 200, {})
                else:
                    self._json(404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with engine.lock:
                    number = len(engine.bodies)
                    engine.bodies.append(body)
                    engine.request_ids.append(self.headers.get("X-Request-Id"))
                    if engine.die_after is not None and number >= engine.die_after:
                        engine.dead = True
                    dead, hang = engine.dead, engine.hang
                if hang:
                    engine.release.wait(10)
                    return self._json(503, {"error": "released"})
                if engine.delay_s:
                    time.sleep(engine.delay_s)
                if dead or number in engine.fail_numbers:
                    return self._json(500, {"error": "EngineCore encountered an issue."})
                self._json(200, {"id": f"cmpl-{number}", "object": "text_completion", "model": body["model"],
                                 "choices": [{"index": 0, "text": "x" * body["max_tokens"], "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": len(body["prompt"]),
                                           "completion_tokens": body["max_tokens"],
                                           "total_tokens": len(body["prompt"]) + body["max_tokens"]}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)
        self.thread.start()
        self.closed = False

    def alive(self) -> bool:
        return not self.dead

    def close(self) -> None:
        """Stop listening: new connections are refused, as when the process is gone."""
        if not self.closed:
            self.closed = True
            self.release.set()
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def engine():
    e = StandInEngine()
    yield e
    e.close()


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------- the profile

def test_shared_prefix_prompts_are_deterministic_for_a_seed():
    a = get_profile("shared_prefix")(LOAD, seed=7)
    b = get_profile("shared_prefix")(LOAD, seed=7)
    c = get_profile("shared_prefix")(LOAD, seed=8)
    # the same index gets the same prompt, whatever order indices are asked in
    assert [a.prompt(i) for i in range(50)] == [b.prompt(i) for i in reversed(range(50))][::-1]
    assert [a.prompt(i).tokens for i in range(50)] != [c.prompt(i).tokens for i in range(50)]


def test_shared_prefix_prompts_share_prefixes_of_varying_length():
    profile = get_profile("shared_prefix")(LOAD, seed=1)
    prompts = [profile.prompt(i) for i in range(200)]
    by_doc: dict[int, list] = {}
    for p in prompts:
        f = p.fields
        assert LOAD.min_prefix_tokens <= f["prefix_tokens"] <= LOAD.document_tokens
        assert LOAD.suffix_tokens[0] <= f["suffix_tokens"] <= LOAD.suffix_tokens[1]
        assert len(p.tokens) == f["prefix_tokens"] + f["suffix_tokens"]
        assert all(0 <= t < LOAD.vocab_size for t in p.tokens)
        assert p.max_tokens == LOAD.max_tokens
        by_doc.setdefault(f["doc"], []).append(p)
    assert sorted(by_doc) == list(range(LOAD.documents))
    for same_doc in by_doc.values():
        assert len({p.fields["prefix_tokens"] for p in same_doc}) > 5  # lengths vary
        longest = max(same_doc, key=lambda p: p.fields["prefix_tokens"])
        for p in same_doc:  # every prompt starts with a prefix of the same document
            n = p.fields["prefix_tokens"]
            assert p.tokens[:n] == longest.tokens[:n]
    # different documents really differ
    firsts = {docs[0].tokens[:10] for docs in by_doc.values() if docs[0].fields["prefix_tokens"] >= 10}
    assert len(firsts) > 1


def test_empty_prompt_is_never_sent():
    load = LoadSpec(profile="shared_prefix", documents=1, document_tokens=5, min_prefix_tokens=0, suffix_tokens=(0, 0))
    profile = get_profile("shared_prefix")(load, seed=0)
    assert all(len(profile.prompt(i).tokens) >= 1 for i in range(100))


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(SpecError, match="unknown profile 'nope'.*shared_prefix"):
        get_profile("nope")
    assert "shared_prefix" in known_profiles()


# --------------------------------------------------------------------------- the client

def test_budget_is_honoured_and_every_request_is_a_json_line(engine, tmp_path):
    out = tmp_path / "requests.jsonl"
    progress: list[tuple[int, int]] = []
    summary = run_load(engine.url, LOAD, runs(requests=20), out, seed=3, alive=engine.alive,
                       on_progress=lambda done, total: progress.append((done, total)))
    assert summary.stopped_because == "budget"
    assert (summary.requests_sent, summary.requests_ok, summary.requests_failed) == (20, 20, 0)
    assert len(engine.bodies) == 20
    assert {b["model"] for b in engine.bodies} == {"tiny-model"}
    records = lines(out)
    assert sorted(r["index"] for r in records) == list(range(20))
    for r in records:
        assert {"index", "doc", "prefix_tokens", "suffix_tokens", "prompt_tokens", "max_tokens", "status", "ok",
                "latency_s", "started_at", "error", "completion_tokens"} <= set(r)
        assert (r["status"], r["ok"], r["error"], r["completion_tokens"]) == (200, True, None, LOAD.max_tokens)
        assert r["prompt_tokens"] == r["prefix_tokens"] + r["suffix_tokens"]
    # the prompts on the wire are the token-id lists the profile made
    profile = get_profile("shared_prefix")(LOAD, seed=3)
    assert sorted(map(tuple, (b["prompt"] for b in engine.bodies))) == sorted(profile.prompt(i).tokens for i in range(20))
    assert progress[-1] == (20, 20)
    # each request names itself (X-Request-Id kvrepro-<index>): the engine log's lines about it say which
    by_prompt = {tuple(b["prompt"]): rid for b, rid in zip(engine.bodies, engine.request_ids)}
    assert {by_prompt[profile.prompt(i).tokens] for i in range(20)} == {f"kvrepro-{i}" for i in range(20)}
    assert all(by_prompt[profile.prompt(i).tokens] == f"kvrepro-{i}" for i in range(20))


def test_same_seed_same_requests(engine, tmp_path):
    first = run_load(engine.url, LOAD, runs(requests=12), tmp_path / "a.jsonl", seed=5, alive=engine.alive)
    second = run_load(engine.url, LOAD, runs(requests=12), tmp_path / "b.jsonl", seed=5, alive=engine.alive)
    assert first.stopped_because == second.stopped_because == "budget"
    key = lambda r: (r["index"], r["doc"], r["prefix_tokens"], r["suffix_tokens"], r["prompt_sha256"])  # noqa: E731
    assert sorted(map(key, lines(tmp_path / "a.jsonl"))) == sorted(map(key, lines(tmp_path / "b.jsonl")))


def test_engine_death_is_detected_quickly(engine, tmp_path):
    engine.die_after = 10
    engine.delay_s = 0.01
    out = tmp_path / "requests.jsonl"
    start = time.monotonic()
    summary = run_load(engine.url, LOAD, runs(requests=10_000), out, seed=0, alive=engine.alive)
    assert summary.stopped_because == "engine_dead"
    assert time.monotonic() - start < 3
    records = lines(out)
    # answers still in flight when death is confirmed are abandoned, so up to concurrency-1 of
    # the 10 good ones may be missing
    assert sum(r["ok"] for r in records) == summary.requests_ok
    assert 10 - (LOAD.concurrency - 1) <= summary.requests_ok <= 10
    assert summary.requests_sent < 30  # stopped right away, not after the 10 000 budget


def test_connection_refused_is_engine_death(engine, tmp_path):
    """The process is still there (alive() True) but nothing listens any more."""
    done = threading.Event()

    def progress(finished, _total):
        if finished >= 5 and not done.is_set():
            done.set()
            engine.close()

    start = time.monotonic()
    summary = run_load(engine.url, LOAD, runs(requests=10_000), tmp_path / "r.jsonl", seed=0,
                       alive=lambda: True, on_progress=progress)
    assert summary.stopped_because == "engine_dead"
    assert time.monotonic() - start < 5
    # a connection-level failure, not an answer: refused (a new connection) or, when a request was
    # in flight on a kept connection as the server shut down, that connection closed (seen in CI)
    errors = [r["error"] for r in lines(tmp_path / "r.jsonl") if r["status"] == "error"]
    assert errors and all(e.startswith(("ClientConnectorError", "ConnectionRefusedError", "ServerDisconnectedError",
                                        "ClientOSError", "ConnectionResetError")) for e in errors), errors


def test_process_exit_is_seen_even_while_requests_hang(engine, tmp_path):
    engine.hang = True
    threading.Timer(0.3, lambda: setattr(engine, "dead", True)).start()
    start = time.monotonic()
    summary = run_load(engine.url, LOAD, runs(requests=100), tmp_path / "r.jsonl", seed=0, alive=engine.alive)
    assert summary.stopped_because == "engine_dead"
    assert time.monotonic() - start < 2


def test_a_5xx_from_a_living_engine_does_not_end_the_run(engine, tmp_path):
    engine.fail_numbers = {3, 4}
    summary = run_load(engine.url, LOAD, runs(requests=15), tmp_path / "r.jsonl", seed=0, alive=engine.alive)
    assert summary.stopped_because == "budget"
    assert (summary.requests_ok, summary.requests_failed) == (13, 2)
    failed = [r for r in lines(tmp_path / "r.jsonl") if not r["ok"]]
    assert [r["status"] for r in failed] == [500, 500]
    assert all(r["error"].startswith("HTTP 500") for r in failed)


def test_stall_is_detected(engine, tmp_path):
    engine.hang = True
    start = time.monotonic()
    summary = run_load(engine.url, LOAD, runs(requests=100, stall_timeout_s=0.5), tmp_path / "r.jsonl", seed=0,
                       alive=engine.alive)
    elapsed = time.monotonic() - start
    assert summary.stopped_because == "stall"
    assert 0.5 <= elapsed < 2
    assert summary.requests_sent == LOAD.concurrency  # one per worker, none answered
    assert lines(tmp_path / "r.jsonl") == []


def test_stop_event_interrupts(engine, tmp_path):
    stop = threading.Event()
    engine.delay_s = 0.02

    def progress(finished, _total):
        if finished >= 8:
            stop.set()

    start = time.monotonic()
    summary = run_load(engine.url, LOAD, runs(requests=10_000), tmp_path / "r.jsonl", seed=0,
                       alive=engine.alive, on_progress=progress, stop=stop)
    assert summary.stopped_because == "interrupted"
    assert time.monotonic() - start < 3
    assert 8 <= len(lines(tmp_path / "r.jsonl")) < 100


def test_duration_budget_lets_in_flight_requests_finish(engine, tmp_path):
    engine.delay_s = 0.05
    summary = run_load(engine.url, LOAD, runs(requests=None, duration_s=0.5), tmp_path / "r.jsonl", seed=0,
                       alive=engine.alive)
    assert summary.stopped_because == "duration"
    assert 0.5 <= summary.seconds < 2
    assert summary.requests_sent == summary.requests_ok == len(lines(tmp_path / "r.jsonl")) > 0


def test_lines_are_appended_and_survive_a_crash(engine, tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text('{"index": -1, "note": "earlier run"}\n')
    engine.die_after = 6
    one_at_a_time = LOAD.model_copy(update={"concurrency": 1})  # no answer in flight at death
    run_load(engine.url, one_at_a_time, runs(requests=1000), out, seed=0, alive=engine.alive)
    records = lines(out)
    assert records[0]["index"] == -1
    assert sum(r.get("ok", False) for r in records) == 6


def test_engine_gone_before_the_first_request(engine, tmp_path):
    engine.close()
    engine.dead = True
    summary = run_load(engine.url, LOAD, runs(), tmp_path / "r.jsonl", seed=0, alive=engine.alive)
    assert (summary.stopped_because, summary.requests_sent) == ("engine_dead", 0)


def test_a_bug_in_a_profile_is_raised_not_reported_as_budget(engine, tmp_path, monkeypatch):
    """Injects a bug into a load profile (our own code, not the engine's) and checks that the
    client raises it instead of recording a clean budget run: a broken profile must never pass
    as "the engine survived"."""
    profile_cls = get_profile("shared_prefix")

    def broken(self, index):
        raise RuntimeError(f"profile bug at {index}")

    monkeypatch.setattr(profile_cls, "prompt", broken)
    with pytest.raises(RuntimeError, match="profile bug"):
        run_load(engine.url, LOAD, runs(requests=5), tmp_path / "r.jsonl", seed=0, alive=engine.alive)
