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
* ``interrupted`` -- the caller set ``stop`` (Ctrl-C);
* ``settled`` -- the caller's ``settled()`` (asked every ``_SETTLE_EVERY_S`` while the engine
  lives and requests still go out) returned its words: the run's verdict is settled before the
  budget (kvrepro/classify/settle.py has the rule); they are kept as ``LoadSummary.settled_by``.
  No new request is sent and the ones in flight are waited for, as at the end of ``duration_s``.

How requests go out (``load``): closed loop (``concurrency`` workers, each sends its next request
when its last one finished) or Poisson arrivals at ``rate_rps`` (seeded gaps; ``concurrency``
caps what is in flight); token-id or text prompts; streamed or not. ``concurrency: 1`` sends
one request at a time, so the engine sees the same sequence of batches on every run: on the
GPU-free engine (seeded) such a run is deterministic, and a replay (:func:`replay_load`) always
runs that way.

Every request is written to the trace (``trace_path``, see :mod:`kvrepro.loadgen.trace`) the
moment it is sent: what was sent, in order, when, from which slot, with how many in flight.
Every finished request is one JSON line appended to ``out_path`` and flushed at once, so a run
that kills the engine (or kvrepro) leaves every line that was finished. When the engine process is
gone, requests in flight get up to a second to fail (so the one that killed it is recorded with
its index in ``first_failed_index``). Requests still in flight when the run ends for death, stall
or interruption are abandoned and not recorded: their tasks
are cancelled and their connections closed before the call returns, so nothing is written after
the return and nothing the run started is left running (a Ctrl-C raised inside the run too).

Why one event loop: the client must cost the engine's host little and must never be what limits
the load. All slots run as tasks on one asyncio loop (uvloop's when installed) in the calling
thread, sharing one aiohttp session with as many keep-alive connections as slots
(:mod:`kvrepro.loadgen.http`); the calling thread also watches the end conditions and calls
``on_progress``. ``benchmarks/client_capacity.py`` compares the client's rate against a null
server with what the GPU-free engine serves. ``runs.request_timeout_s`` bounds connecting and
each wait for the next bytes of an answer, as it did with ``requests``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from ..errors import InfraError
from ..records import REQUEST_ID_PREFIX, LoadSummary, to_jsonable
from ..spec.records import RequestEvents
from ..spec.matrix import LoadSpec, RunsSpec
from . import http
from . import trace as tracefile
from .profiles import EngineCapacity, Profile, Prompt, get_profile

_TICK_S = 0.05  # how often the run checks its end conditions
_ALIVE_EVERY_S = 0.25  # alive() may be a docker API call: not on every tick
_SETTLE_EVERY_S = 0.5  # the engine writes its counts every 0.5 s (kvrepro/engine/executor.py)
_DEATH_GRACE_S = 1.0  # after the process is gone, how long requests in flight may take to fail
_HEALTH_TIMEOUT_S = 2.0
_MODELS_PATIENCE_S = 5.0
_ERROR_CHARS = 300
_RIDER_LAG_S = 0.02  # a queued abort goes out this long after the request it rides along with
_RESET_PATIENCE_S = 10.0  # how long a refused /reset_prefix_cache is asked again
_JSON = {"Content-Type": "application/json"}
# Every request names itself to the engine (vLLM takes X-Request-Id as the base of its request id),
# so what the engine logs about a request -- a shadow-KV violation, a traceback -- points back to its
# line in load.jsonl (kvrepro.classify.exposure reads it).


def request_id(index: int) -> str:
    return f"{REQUEST_ID_PREFIX}{index}"


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
    trace_header: tracefile.TraceHeader | None = None,
    api_key: str | None = None,
    settled: Callable[[], str | None] | None = None,
) -> LoadSummary:
    """Send the load of one run and say why it ended.

    ``seed`` fixes every prompt of the run (callers derive one per repetition from
    ``load.seed``). ``alive`` reports whether the engine process still exists.
    ``on_progress(finished, budget)`` is called from this (the calling) thread whenever
    requests finished; ``budget`` is 0 when the run is bounded by time only. ``capacity`` is
    the engine's KV capacity that profiles size their eviction pressure from. ``settled``
    (None: the whole budget) ends the run early once it returns why the verdict is settled.
    """
    profile = get_profile(load.profile)(load, seed, capacity)
    header = (trace_header or tracefile.TraceHeader()).merged({**profile.describe(), "load": load.model_dump(),
                                                               "seed": seed})
    return _Run(base_url.rstrip("/"), profile, load, runs, Path(out_path), alive, on_progress, stop,
                trace_path, header, api_key, settled).run()


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
    api_key: str | None = None,
) -> LoadSummary:
    """Send a recorded trace again, one request at a time in recorded order (deterministic on the
    GPU-free engine), with the recorded output lengths, prompt format and streaming."""
    load = trace.load_spec().model_copy(update={"concurrency": 1, "arrival": "closed"})
    profile = tracefile.ReplayProfile(trace, load)
    budget = len(trace.requests)
    if runs.requests is not None:
        budget = min(budget, runs.requests)
    runs = runs.model_copy(update={"requests": budget, "duration_s": None})
    header = trace.header.updated(replay_of=str(trace.path), requests_in_trace=len(trace.requests))
    return _Run(base_url.rstrip("/"), profile, load, runs, Path(out_path), alive, on_progress, stop,
                trace_path, header, api_key).run()


class _Run:
    def __init__(self, base_url: str, profile: Profile, load: LoadSpec, runs: RunsSpec, out_path: Path,
                 alive: Callable[[], bool], on_progress: Callable[[int, int], None] | None,
                 stop: threading.Event | None, trace_path: Path | None = None,
                 trace_header: tracefile.TraceHeader | None = None, api_key: str | None = None,
                 settled: Callable[[], str | None] | None = None):
        self.base_url = base_url
        http.parse_url(base_url)  # plain http:// only: a wrong URL fails here, before the engine is asked
        # an engine started with --api-key answers 401 to /v1/* without it (vLLM's own check)
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client: http.Client | None = None  # opened on the run's event loop
        self.profile = profile
        self.load = load
        self.runs = runs
        self.trace_path = trace_path
        self.trace_header = trace_header or tracefile.TraceHeader()
        self.trace: Any = None
        self.first_failed: int | None = None
        self.started = time.monotonic()
        self.arrivals = _Arrivals(load, profile.seed) if load.arrival == "poisson" else None
        self.out_path = out_path
        self.alive = alive
        self.on_progress = on_progress
        self.stop = stop or threading.Event()
        self.budget = runs.requests
        self.halted = False  # workers: send nothing more
        self.wake: asyncio.Event | None = None  # the watcher: look now (a worker ended, the run ended)
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
        self.settled = settled
        self.settled_by: str | None = None

    # ------------------------------------------------------------------ the calling thread

    def run(self) -> LoadSummary:
        started = time.monotonic()
        model = self._model_id()
        if model is None:
            return self._summary(started)
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(self.out_path, "a", encoding="utf-8")
        if self.trace_path is not None:
            self.trace = tracefile.open_writer(self.trace_path, self.trace_header.updated(
                model=model, concurrency=self.load.concurrency, arrival=self.load.arrival,
                rate_rps=self.load.rate_rps, stream=self.load.stream, prompt_format=self.load.prompt_format,
                started_at=round(time.time(), 6)))
        self.started = time.monotonic()
        loop = new_event_loop()
        try:
            loop.run_until_complete(self._main(model, started))
        finally:
            self.halted = self.closed = True
            self.out.close()
            if self.trace is not None:
                self.trace.close()
            _close_loop(loop)
        self._report()  # the last requests may have finished after the last tick
        return self._summary(started)

    def _report(self) -> None:
        if self.finished != self.reported and self.on_progress is not None:
            self.reported = self.finished
            self.on_progress(self.finished, self.budget or 0)

    async def _main(self, model: str, started: float) -> None:
        self.wake = asyncio.Event()
        # twice the slots: a queued abort rides along with its slot's request on a connection of its own
        self.client = await http.Client(self.base_url, connections=2 * self.load.concurrency,
                                        timeout=self.runs.request_timeout_s, headers=self.auth).open()
        workers = [asyncio.ensure_future(self._worker(model, slot)) for slot in range(self.load.concurrency)]
        try:
            await self._watch(workers, started)
        finally:
            self.halted = True
            for w in workers:
                w.cancel()  # requests still in flight are abandoned: nothing of them is recorded
            await asyncio.gather(*workers, return_exceptions=True)
            await self.client.close()

    async def _watch(self, workers: list[asyncio.Future[None]], started: float) -> None:
        assert self.wake is not None
        next_alive_check = 0.0
        next_settle_check = time.monotonic() + _SETTLE_EVERY_S
        dead_since: float | None = None
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), _TICK_S)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            now = time.monotonic()
            self._report()
            if self.worker_error is not None:
                raise self.worker_error
            if self.reason is not None:
                return
            if self.stop.is_set():
                self._end("interrupted")
                return
            if now >= next_alive_check:
                next_alive_check = now + _ALIVE_EVERY_S
                # alive() blocks this loop for as long as it takes (a docker API call: a few ms,
                # four times a second); requests in flight just wait that long for their answer
                if not self.alive():
                    # the requests in flight are answered (a 500, a closed connection) within
                    # moments of the death: wait that long, so the one that killed the engine is
                    # recorded as failed, then abandon what is left
                    self.halted = True
                    if dead_since is None:
                        dead_since = now
                    if self.in_flight == 0 or now - dead_since >= _DEATH_GRACE_S:
                        self._end("engine_dead")
                        return
                    next_alive_check = now
            if self.in_flight > 0 and now - self.last_answer > self.runs.stall_timeout_s:
                self._end("stall")
                return
            if all(w.done() for w in workers):
                self._end("settled" if self.settled_by else "duration" if self.draining else "budget")
                return
            if self.runs.duration_s is not None and not self.draining and now - started >= self.runs.duration_s:
                self.draining = True
            if self.settled is not None and now >= next_settle_check and dead_since is None and not self.draining:
                next_settle_check = now + _SETTLE_EVERY_S
                words = self.settled()
                # asked again after reading: the counts read are of events a live engine came through
                if words is not None and self.alive():
                    # no new request goes out; those in flight are answered and recorded (as at the
                    # end of runs.duration_s), so every request sent has its line in load.jsonl
                    self.settled_by = words
                    self.draining = True

    def _end(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.halted = True
        if self.wake is not None:
            self.wake.set()

    def _summary(self, started: float) -> LoadSummary:
        return LoadSummary(
            requests_sent=self.next_index,
            requests_ok=self.ok,
            requests_failed=self.finished - self.ok,
            seconds=round(time.monotonic() - started, 3),
            stopped_because=self.reason or "engine_dead",
            first_failed_index=self.first_failed,
            settled_by=self.settled_by if self.reason == "settled" else None,
        )

    def _model_id(self) -> str | None:
        """The served model's id from /v1/models; None (run over: engine dead) if it is gone."""
        deadline = time.monotonic() + _MODELS_PATIENCE_S
        url = f"{self.base_url}/v1/models"
        while True:
            try:
                resp = requests.get(url, timeout=min(10.0, self.runs.request_timeout_s), headers=self.auth)
                if resp.status_code == 401:
                    raise InfraError(f"GET {url}: 401 Unauthorized: the engine requires an API key "
                                     + ("and refused the one engine.extra_args gives (--api-key)" if self.auth else
                                        "that kvrepro does not know; give it as --api-key in engine.extra_args"))
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

    # ------------------------------------------------------------------ workers (one per slot, on the loop)

    async def _worker(self, model: str, slot: int) -> None:
        try:
            await self._work(model, slot)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surfaced by the watcher, not lost in a task
            self.worker_error = self.worker_error or exc
            self.halted = True
        finally:
            if self.wake is not None:
                self.wake.set()

    async def _work(self, model: str, slot: int) -> None:
        body_head = self._body_head(model)
        while True:
            if self.halted or self.draining or (self.budget is not None and self.next_index >= self.budget):
                return
            index = self.next_index
            self.next_index += 1
            if self.arrivals is not None and not await self._wait_for_arrival(index):
                self.next_index = min(self.next_index, index)  # not sent: not counted
                return
            prompt = self._prompt(index)
            if self.halted:
                return
            # a burst: this request and the next burst-1 go out together (earlier prompts again).
            # Claimed before the pause or reset below: with concurrency > 1 another slot would take
            # them while this one waits, and send them alone, before the reset (measured: it did)
            group = [prompt]
            burst = prompt.events.burst if prompt.events is not None and prompt.events.burst else 1
            while len(group) < burst and (self.budget is None or self.next_index < self.budget):
                group.append(self._prompt(self.next_index))
                self.next_index += 1
            # a queued abort rides along with the request before it: sent while that one is in
            # flight, so it waits in the engine's queue behind it (docs/load.md)
            rider = None
            following = self.next_index
            if not self.draining and (self.budget is None or following < self.budget):
                candidate = self._prompt(following)
                if candidate.events is not None and candidate.events.abort == "queued":
                    self.next_index += 1
                    rider = candidate
            await self._before(prompt)
            if self.halted:
                return
            sends = [asyncio.ensure_future(self._one(body_head, p, slot)) for p in group]
            if rider is not None:
                await asyncio.sleep(_RIDER_LAG_S)  # the request before it reaches the engine first
                if not self.halted:
                    sends.append(asyncio.ensure_future(self._one(body_head, rider, slot)))
            stop = await asyncio.gather(*sends)
            if any(stop):
                return

    def _prompt(self, index: int) -> Prompt:
        """Request ``index`` with its events: the profile's (a replay: the trace's), else load.events'."""
        prompt = self.profile.routed(index)
        if prompt.events is None:
            events = self.load.events_for(index)
            prompt = dataclasses.replace(prompt, events=events)
            if events.replay_of is not None:  # a burst sends an earlier request's prompt again
                earlier = self.profile.routed(events.replay_of)
                prompt = dataclasses.replace(prompt, tokens=earlier.tokens, max_tokens=earlier.max_tokens,
                                             fields={**prompt.fields, "replay_of": events.replay_of})
        return prompt

    async def _before(self, prompt: Prompt) -> None:
        """The events at the phase boundary before a request: a pause, a prefix-cache reset."""
        events = prompt.events
        if events is None:
            return
        if events.pause_s:
            await asyncio.sleep(events.pause_s)
        if events.reset_prefix_cache:
            await self._reset_prefix_cache(prompt.index, events.reset_prefix_cache == "external")

    async def _reset_prefix_cache(self, index: int, external: bool) -> None:
        """POST /reset_prefix_cache (vLLM's dev API: the engine runs with VLLM_SERVER_DEV_MODE=1). vLLM
        refuses (success false) while blocks are held, by running requests or transfers in flight:
        asked again until it succeeds or _RESET_PATIENCE_S passed; the outcome is a line of load.jsonl."""
        assert self.client is not None
        path = "/reset_prefix_cache" + ("?reset_external=true" if external else "")
        deadline = time.monotonic() + _RESET_PATIENCE_S
        attempts = 0
        error: str | None = None
        while True:
            attempts += 1
            try:
                resp = await self.client.post(path, b"", dict(self.auth))
            except http.HttpError as exc:
                # the engine died (or stopped answering) with the reset in flight: a line of the
                # record, like a request's failure; the requests around it tell the run's end
                error = str(exc)[:_ERROR_CHARS]
                break
            if resp.status == 404:
                raise InfraError(f"POST {self.base_url}/reset_prefix_cache: 404; vLLM serves it only with "
                                 "VLLM_SERVER_DEV_MODE=1 in the engine's environment (the GPU-free engine has it)")
            try:
                success = resp.status == 200 and bool(json.loads(resp.body or b"{}").get("success", True))
            except (ValueError, AttributeError):
                success = resp.status == 200
            if success or time.monotonic() >= deadline or self.halted:
                break
            await asyncio.sleep(_TICK_S)
        line = {"event": "reset_prefix_cache", "before_index": index, "external": external,
                "status": None if error else resp.status, "success": False if error else success,
                "attempts": attempts, "at": round(time.time(), 6), **({"error": error} if error else {})}
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()

    async def _one(self, body_head: str, prompt: Prompt, slot: int) -> bool:
        """Send one request and record it; True when the run must stop (the engine died)."""
        index = prompt.index
        self.in_flight += 1
        # the ids are encoded once: for the body, the trace line and the record's hash
        tokens_json = json.dumps(prompt.tokens, separators=(",", ":"))
        if self.trace is not None:
            self.trace.request(prompt, slot=slot, sent_s=time.monotonic() - self.started,
                               in_flight=self.in_flight, tokens_json=tokens_json)
        record, answered, failed = await self._send(body_head, prompt, tokens_json)
        record["slot"] = slot
        self.in_flight -= 1
        if self.closed:
            return True
        self.finished += 1
        self.ok += bool(record["ok"])
        if failed and (self.first_failed is None or index < self.first_failed):
            self.first_failed = index
        if answered:
            self.last_answer = time.monotonic()
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()
        if failed and await self._engine_is_dead():
            self._end("engine_dead")
            return True
        return False

    def _body_head(self, model: str) -> str:
        """The request body without its prompt and closing brace: the same for every request."""
        body: dict[str, Any] = {
            "model": model,
            "temperature": 0.0,
            # every request generates exactly max_tokens: the load's shape does not depend on
            # which tokens come out (vLLM's extension of the OpenAI API)
            "ignore_eos": True,
            "stream": self.load.stream,
        }
        if self.load.stream:
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body)[:-1]

    async def _send(self, body_head: str, prompt: Prompt,
                    tokens_json: str) -> tuple[dict[str, Any], bool, bool]:
        """POST one request: (its JSON line, whether the server answered, whether it failed in a
        way that can mean the engine died)."""
        text = tokens_json if self.load.prompt_format == "tokens" else json.dumps(tokens_to_text(prompt.tokens))
        events = prompt.events if prompt.events is not None and prompt.events.any() else None
        stream = self.load.stream
        if events is not None and events.abort in ("first_token", "tokens") and not stream:
            # an abort after N tokens needs the tokens as they come: this request streams
            body_head = body_head.replace('"stream": false', '"stream": true, "stream_options": {"include_usage": true}')
            stream = True
        extra = f', "priority": {int(events.priority)}' if events is not None and events.priority is not None else ""
        body = f'{body_head}, "max_tokens": {prompt.max_tokens}{extra}, "prompt": {text}}}'.encode()
        headers = {**_JSON, "X-Request-Id": request_id(prompt.index)}
        if prompt.rank is not None:
            headers["X-data-parallel-rank"] = str(prompt.rank)
        record: dict[str, Any] = {
            "index": prompt.index,
            **prompt.fields,
            "prompt_tokens": len(prompt.tokens),
            "max_tokens": prompt.max_tokens,
            # of json.dumps(tokens) with its default ", " (what earlier runs recorded): for a list
            # of ints the compact encoding with each comma widened is exactly that
            "prompt_sha256": hashlib.sha256(tokens_json.replace(",", ", ").encode()).hexdigest()[:16],
            "started_at": round(time.time(), 6),
        }
        t0 = time.monotonic()
        status: int | str = "error"
        error: str | None = None
        completion_tokens: int | None = None
        answered = failed = False
        if events is not None:
            record["events"] = to_jsonable(events)
        try:
            assert self.client is not None
            if events is not None and events.abort is not None:
                aborted, resp = await self._send_aborting(body, headers, events)
                record["aborted"] = aborted
                if aborted is not None:  # the client gave up as the event says: not a failure
                    record.update(status="aborted", ok=True, latency_s=round(time.monotonic() - t0, 4), error=None,
                                  completion_tokens=aborted)
                    return record, True, False
                assert resp is not None
            else:
                resp = await self.client.post("/v1/completions", body, headers)
            answered = True
            status = resp.status
            if status == 200 and stream:
                completion_tokens, error = _read_stream(resp.body)
                failed = error is not None and "engine" in error.lower()
            elif status == 200:
                data = json.loads(resp.body)
                completion_tokens = _completion_tokens(data)
                if not data.get("choices"):
                    error = "200 without choices"
            else:
                error = f"HTTP {status}: {resp.body.decode('utf-8', 'replace')[:_ERROR_CHARS]}"
                failed = status >= 500
        except http.HttpTimeout as exc:
            error = f"timeout after {self.runs.request_timeout_s}s: {exc}"[:_ERROR_CHARS]
        except http.HttpError as exc:
            error = str(exc)[:_ERROR_CHARS]
            failed = True
        except (ValueError, AttributeError) as exc:  # a 200 whose body is not (a JSON object)
            error = f"bad JSON in response: {exc}"[:_ERROR_CHARS]
        record.update(
            status=status,
            ok=status == 200 and error is None,
            latency_s=round(time.monotonic() - t0, 4),
            error=error,
            completion_tokens=completion_tokens,
        )
        return record, answered, failed

    async def _send_aborting(self, body: bytes, headers: dict[str, str],
                             events: "RequestEvents") -> tuple[int | None, http.Response | None]:
        """Send a request the client gives up on: (streamed tokens seen when it closed the connection,
        None) -- or (None, the whole answer) when the answer came first (the event did not happen:
        the record says ``aborted: null``)."""
        assert self.client is not None
        if events.abort == "queued":
            try:
                resp = await asyncio.wait_for(self.client.post("/v1/completions", body, headers),
                                              events.abort_after_s or 0.1)
            except asyncio.TimeoutError:
                return 0, None  # cancelled: aiohttp closed the connection, vLLM aborts the request
            return None, resp
        want = events.abort_after_tokens or 1
        seen, resp = await self.client.stream_until("/v1/completions", body, headers, want)
        return (seen, None) if resp is None else (None, resp)

    async def _wait_for_arrival(self, index: int) -> bool:
        """Poisson arrivals: sleep until request ``index`` is due; False if the run ended first."""
        assert self.arrivals is not None
        due = self.started + self.arrivals.offset(index)
        while True:
            left = due - time.monotonic()
            if left <= 0:
                return True
            await asyncio.sleep(min(left, _TICK_S))
            if self.halted or self.draining:
                return False

    async def _engine_is_dead(self) -> bool:
        """Confirm a failed request as engine death: process gone, /health 503 or unreachable."""
        if not self.alive():
            return True
        try:
            return (await http.fetch(self.base_url, "/health", _HEALTH_TIMEOUT_S)).status == 503
        except http.HttpTimeout as exc:
            return exc.connect  # no connection at all is unreachable; a slow answer is not death
        except http.HttpError:
            return True


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when it is installed (a fraction of the stdlib loop's cost per request),
    else asyncio's; ``KVREPRO_EVENT_LOOP=asyncio`` forces the stdlib one."""
    if os.environ.get("KVREPRO_EVENT_LOOP", "") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is still on the loop, let closed connections release their sockets, close it.
    Runs after a KeyboardInterrupt too: nothing the run started outlives it."""
    try:
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(asyncio.sleep(0))  # transports' connection_lost callbacks
        loop.run_until_complete(loop.shutdown_default_executor())  # a resolver's threads, if any ran
    finally:
        loop.close()


def tokens_to_text(tokens: tuple[int, ...] | list[int]) -> str:
    """The text fallback of a token-id prompt: one word per id, so prompts that share leading ids
    share leading words (and a word-level tokenizer's leading tokens)."""
    return " ".join(f"w{t}" for t in tokens)


def _read_stream(body: bytes) -> tuple[int | None, str | None]:
    """Read server-sent events to the end: (completion tokens from the usage event, error)."""
    completion_tokens: int | None = None
    chunks = 0
    for raw in body.splitlines():
        if not raw.startswith(b"data:"):
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

    def offset(self, index: int) -> float:
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
