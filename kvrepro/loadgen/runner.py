"""Drive an OpenAI-compatible engine with concurrent /v1/completions requests until a run ends.

A run ends for exactly one reason (``LoadSummary.stopped_because``):

* ``budget`` -- ``runs.requests`` requests were sent and all of them finished;
* ``duration`` -- ``runs.duration_s`` passed; no new requests are sent and the ones in flight
  are waited for (still watching for death and stalls);
* ``engine_dead`` -- the engine process is gone (``alive()`` is False), or a request failed
  (connection refused/reset, a 5xx) and the engine confirms it: ``alive()`` False, ``/health``
  503 or unreachable. vLLM answers 500 to every request once EngineCore died and 503 on /health;
* ``stall`` -- requests are in flight but none got an answer for ``runs.stall_timeout_s``
  (an engine that stopped making progress without dying -- a state of its own, not a crash);
* ``interrupted`` -- the caller set ``stop`` (Ctrl-C).

How requests go out (``load``): closed loop (``concurrency`` workers, each sends its next request
when its last one finished) or Poisson arrivals at ``rate_rps`` (seeded gaps; ``concurrency``
caps what is in flight); token-id or text prompts; streamed or not. ``concurrency: 1`` sends
one request at a time, so the engine sees the same sequence of batches on every run: on the
GPU-free engine (seeded) such a run is deterministic, and a replay (:func:`replay_load`) always
runs that way.

Every request is written to the trace (``trace_path``, see :mod:`kvrepro.loadgen.trace`) the
moment it is sent: what was sent, in order, when, from which slot, with how many in flight.
Every finished request is one JSON line appended to ``out_path`` and flushed at once, so a run
that kills the engine (or kvrepro) leaves every line that was finished. Requests still in flight
when the run ends for death, stall or interruption are abandoned and not recorded: their worker
threads are daemons, bounded by ``runs.request_timeout_s``, and write nothing after the return.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from ..errors import InfraError
from ..records import LoadSummary
from ..spec import LoadSpec, RunsSpec
from . import trace as tracefile
from .profiles import EngineCapacity, Profile, Prompt, get_profile

_TICK_S = 0.05  # how often the run checks its end conditions
_ALIVE_EVERY_S = 0.25  # alive() may be a docker API call: not on every tick
_HEALTH_TIMEOUT_S = 2.0
_MODELS_PATIENCE_S = 5.0
_ERROR_CHARS = 300


def run_load(
    base_url: str,
    load: LoadSpec,
    runs: RunsSpec,
    out_path: Path,
    *,
    seed: int,
    alive: Callable[[], bool],
    on_progress: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
    capacity: EngineCapacity | None = None,
    trace_path: Path | None = None,
    trace_header: dict[str, Any] | None = None,
) -> LoadSummary:
    """Send the load of one run and say why it ended.

    ``seed`` fixes every prompt of the run (callers derive one per repetition from
    ``load.seed``). ``alive`` reports whether the engine process still exists.
    ``on_progress(finished, budget)`` is called from this (the calling) thread whenever
    requests finished; ``budget`` is 0 when the run is bounded by time only. ``capacity`` is
    the engine's KV capacity that profiles size their eviction pressure from.
    """
    profile = get_profile(load.profile)(load, seed, capacity)
    header = {**(trace_header or {}), **profile.describe(), "load": load.model_dump(), "seed": seed}
    return _Run(base_url.rstrip("/"), profile, load, runs, Path(out_path), alive, on_progress, stop,
                trace_path, header).run()


def replay_load(
    base_url: str,
    trace: "tracefile.Trace",
    runs: RunsSpec,
    out_path: Path,
    *,
    alive: Callable[[], bool],
    on_progress: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
    trace_path: Path | None = None,
) -> LoadSummary:
    """Send a recorded trace again, one request at a time in recorded order (deterministic on the
    GPU-free engine), with the recorded output lengths, prompt format and streaming."""
    load = trace.load_spec().model_copy(update={"concurrency": 1, "arrival": "closed"})
    profile = tracefile.ReplayProfile(trace, load)
    budget = len(trace.requests)
    if runs.requests is not None:
        budget = min(budget, runs.requests)
    runs = runs.model_copy(update={"requests": budget, "duration_s": None})
    header = {**trace.header, "replay_of": str(trace.path), "requests_in_trace": len(trace.requests)}
    return _Run(base_url.rstrip("/"), profile, load, runs, Path(out_path), alive, on_progress, stop,
                trace_path, header).run()


class _Run:
    def __init__(self, base_url: str, profile: Profile, load: LoadSpec, runs: RunsSpec, out_path: Path,
                 alive: Callable[[], bool], on_progress: Callable[[int, int], None] | None,
                 stop: threading.Event | None, trace_path: Path | None = None,
                 trace_header: dict[str, Any] | None = None):
        self.base_url = base_url
        self.profile = profile
        self.load = load
        self.runs = runs
        self.trace_path = trace_path
        self.trace_header = trace_header or {}
        self.trace: Any = None
        self.first_failed: int | None = None
        self.started = time.monotonic()
        self.arrivals = _Arrivals(load, profile.seed) if load.arrival == "poisson" else None
        self.out_path = out_path
        self.alive = alive
        self.on_progress = on_progress
        self.stop = stop or threading.Event()
        self.budget = runs.requests
        self.lock = threading.Lock()
        self.halt = threading.Event()  # workers: send nothing more
        self.draining = False  # duration over: let in-flight requests finish
        self.reason: str | None = None
        self.next_index = 0
        self.in_flight = 0
        self.finished = 0
        self.ok = 0
        self.last_answer = time.monotonic()
        self.closed = False
        self.out: Any = None
        self.worker_error: BaseException | None = None  # a bug in a profile or here: re-raised
        self.reported = -1  # the finished count on_progress last heard

    # ------------------------------------------------------------------ main thread

    def run(self) -> LoadSummary:
        started = time.monotonic()
        model = self._model_id()
        if model is None:
            return self._summary(started)
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(self.out_path, "a", encoding="utf-8")
        if self.trace_path is not None:
            self.trace = tracefile.open_writer(self.trace_path, {
                **self.trace_header, "model": model, "concurrency": self.load.concurrency,
                "arrival": self.load.arrival, "rate_rps": self.load.rate_rps, "stream": self.load.stream,
                "prompt_format": self.load.prompt_format, "started_at": round(time.time(), 6)})
        self.started = time.monotonic()
        workers = [threading.Thread(target=self._worker, args=(model, i), name=f"kvrepro-load-{i}", daemon=True)
                   for i in range(self.load.concurrency)]
        try:
            for w in workers:
                w.start()
            self._watch(workers, started)
        finally:
            self.halt.set()
            with self.lock:
                self.closed = True
                self.out.close()
                if self.trace is not None:
                    self.trace.close()
            for w in workers:
                w.join(timeout=0.05)
        self._report()  # the last requests may have finished after the last tick
        return self._summary(started)

    def _report(self) -> None:
        with self.lock:
            finished = self.finished
        if finished != self.reported and self.on_progress is not None:
            self.reported = finished
            self.on_progress(finished, self.budget or 0)

    def _watch(self, workers: list[threading.Thread], started: float) -> None:
        next_alive_check = 0.0
        while True:
            self.halt.wait(_TICK_S)
            now = time.monotonic()
            self._report()
            with self.lock:
                in_flight, reason, last_answer = self.in_flight, self.reason, self.last_answer
            if self.worker_error is not None:
                raise self.worker_error
            if reason is not None:
                return
            if self.stop.is_set():
                self._end("interrupted")
                return
            if now >= next_alive_check:
                next_alive_check = now + _ALIVE_EVERY_S
                if not self.alive():
                    self._end("engine_dead")
                    return
            if in_flight > 0 and now - last_answer > self.runs.stall_timeout_s:
                self._end("stall")
                return
            if not any(w.is_alive() for w in workers):
                self._end("duration" if self.draining else "budget")
                return
            if self.runs.duration_s is not None and not self.draining and now - started >= self.runs.duration_s:
                with self.lock:
                    self.draining = True

    def _end(self, reason: str) -> None:
        with self.lock:
            if self.reason is None:
                self.reason = reason
        self.halt.set()

    def _summary(self, started: float) -> LoadSummary:
        with self.lock:
            return LoadSummary(
                requests_sent=self.next_index,
                requests_ok=self.ok,
                requests_failed=self.finished - self.ok,
                seconds=round(time.monotonic() - started, 3),
                stopped_because=self.reason or "engine_dead",
                first_failed_index=self.first_failed,
            )

    def _model_id(self) -> str | None:
        """The served model's id from /v1/models; None (run over: engine dead) if it is gone."""
        deadline = time.monotonic() + _MODELS_PATIENCE_S
        url = f"{self.base_url}/v1/models"
        while True:
            try:
                resp = requests.get(url, timeout=min(10.0, self.runs.request_timeout_s))
                resp.raise_for_status()
                return str(resp.json()["data"][0]["id"])
            except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as exc:
                problem = _short_error(exc)
            if self.stop.is_set():
                self.reason = "interrupted"
                return None
            if not self.alive():
                self.reason = "engine_dead"
                return None
            if time.monotonic() >= deadline:
                raise InfraError(f"GET {url} did not list a model ({problem}); the engine reported ready "
                                 "but does not serve the OpenAI API there -- check the target's port and logs")
            time.sleep(0.2)

    # ------------------------------------------------------------------ worker threads

    def _worker(self, model: str, slot: int) -> None:
        try:
            self._work(model, slot)
        except BaseException as exc:  # surfaced by the watching thread, not lost in a thread
            with self.lock:
                self.worker_error = self.worker_error or exc
            self.halt.set()

    def _work(self, model: str, slot: int) -> None:
        with requests.Session() as session:
            while True:
                with self.lock:
                    spent = self.budget is not None and self.next_index >= self.budget
                    if self.halt.is_set() or self.draining or spent:
                        return
                    index = self.next_index
                    self.next_index += 1
                if self.arrivals is not None and not self._wait_for_arrival(index):
                    with self.lock:
                        self.next_index = min(self.next_index, index)  # not sent: not counted
                    return
                prompt = self.profile.prompt(index)
                with self.lock:
                    if self.halt.is_set():
                        return
                    self.in_flight += 1
                    if self.trace is not None:
                        self.trace.request(prompt, slot=slot, sent_s=time.monotonic() - self.started,
                                           in_flight=self.in_flight)
                record, answered, failed = self._send(session, model, prompt)
                record["slot"] = slot
                with self.lock:
                    self.in_flight -= 1
                    if self.closed:
                        return
                    self.finished += 1
                    self.ok += bool(record["ok"])
                    if failed and (self.first_failed is None or index < self.first_failed):
                        self.first_failed = index
                    if answered:
                        self.last_answer = time.monotonic()
                    self.out.write(json.dumps(record) + "\n")
                    self.out.flush()
                if failed and self._engine_is_dead():
                    self._end("engine_dead")
                    return

    def _send(self, session: requests.Session, model: str, prompt: Prompt) -> tuple[dict[str, Any], bool, bool]:
        """POST one request: (its JSON line, whether the server answered, whether it failed in a
        way that can mean the engine died)."""
        stream = self.load.stream
        body = {
            "model": model,
            "prompt": list(prompt.tokens) if self.load.prompt_format == "tokens" else tokens_to_text(prompt.tokens),
            "max_tokens": prompt.max_tokens,
            "temperature": 0.0,
            # every request generates exactly max_tokens: the load's shape does not depend on
            # which tokens come out (vLLM's extension of the OpenAI API)
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        record: dict[str, Any] = {
            "index": prompt.index,
            **prompt.fields,
            "prompt_tokens": len(prompt.tokens),
            "max_tokens": prompt.max_tokens,
            "prompt_sha256": hashlib.sha256(json.dumps(prompt.tokens).encode()).hexdigest()[:16],
            "started_at": round(time.time(), 6),
        }
        t0 = time.monotonic()
        status: int | str = "error"
        error: str | None = None
        completion_tokens: int | None = None
        answered = failed = False
        try:
            resp = session.post(f"{self.base_url}/v1/completions", json=body, timeout=self.runs.request_timeout_s,
                                stream=stream)
            answered = True
            status = resp.status_code
            if resp.status_code == 200 and stream:
                completion_tokens, error = _read_stream(resp)
                failed = error is not None and "engine" in error.lower()
            elif resp.status_code == 200:
                data = resp.json()
                completion_tokens = _completion_tokens(data)
                if not data.get("choices"):
                    error = "200 without choices"
            else:
                error = f"HTTP {resp.status_code}: {resp.text[:_ERROR_CHARS]}"
                failed = resp.status_code >= 500
        except requests.Timeout as exc:
            error = f"timeout after {self.runs.request_timeout_s}s: {_short_error(exc)}"
        except requests.RequestException as exc:
            error = _short_error(exc)
            failed = True
        except ValueError as exc:  # a 200 whose body is not JSON
            error = f"bad JSON in response: {exc}"[:_ERROR_CHARS]
        record.update(
            status=status,
            ok=status == 200 and error is None,
            latency_s=round(time.monotonic() - t0, 4),
            error=error,
            completion_tokens=completion_tokens,
        )
        return record, answered, failed

    def _wait_for_arrival(self, index: int) -> bool:
        """Poisson arrivals: sleep until request ``index`` is due; False if the run ended first."""
        assert self.arrivals is not None
        due = self.started + self.arrivals.offset(index)
        while True:
            left = due - time.monotonic()
            if left <= 0:
                return True
            if self.halt.wait(min(left, _TICK_S)) or self.draining:
                return False

    def _engine_is_dead(self) -> bool:
        """Confirm a failed request as engine death: process gone, /health 503 or unreachable."""
        if not self.alive():
            return True
        try:
            return requests.get(f"{self.base_url}/health", timeout=_HEALTH_TIMEOUT_S).status_code == 503
        except requests.ConnectionError:
            return True
        except requests.RequestException:
            return False


def tokens_to_text(tokens: tuple[int, ...] | list[int]) -> str:
    """The text fallback of a token-id prompt: one word per id, so prompts that share leading ids
    share leading words (and a word-level tokenizer's leading tokens)."""
    return " ".join(f"w{t}" for t in tokens)


def _read_stream(resp: requests.Response) -> tuple[int | None, str | None]:
    """Read server-sent events to the end: (completion tokens from the usage event, error)."""
    completion_tokens: int | None = None
    chunks = 0
    for raw in resp.iter_lines():
        if not raw or not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            return (completion_tokens if completion_tokens is not None else chunks), None
        try:
            event = json.loads(data)
        except ValueError:
            return None, f"bad event in stream: {data[:100]!r}"
        if "error" in event or event.get("object") == "error":
            return None, f"error in stream: {json.dumps(event)[:_ERROR_CHARS]}"
        chunks += bool(event.get("choices"))
        usage = event.get("usage") or {}
        if isinstance(usage.get("completion_tokens"), int):
            completion_tokens = usage["completion_tokens"]
    return None, "stream ended without [DONE]"


class _Arrivals:
    """Poisson arrival times: request ``i`` is due ``offset(i)`` seconds after the start (seeded)."""

    def __init__(self, load: LoadSpec, seed: int):
        self.rate = float(load.rate_rps or 1.0)
        self.rng = random.Random(f"arrivals/{seed}")
        self.times: list[float] = []
        self.lock = threading.Lock()

    def offset(self, index: int) -> float:
        with self.lock:
            while len(self.times) <= index:
                last = self.times[-1] if self.times else 0.0
                self.times.append(last + self.rng.expovariate(self.rate))
            return self.times[index]


def _completion_tokens(data: dict[str, Any]) -> int | None:
    usage = data.get("usage") or {}
    value = usage.get("completion_tokens")
    return int(value) if isinstance(value, int) else None


def _short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
