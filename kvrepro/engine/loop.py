"""The engine loop: one thread that owns vLLM's EngineCore, as EngineCoreProc's busy loop does.

HTTP handler threads never touch the EngineCore: they queue an ``EngineCoreRequest`` with
``submit`` and wait on their ``Completion``. The loop thread adds queued requests
(``preprocess_add_request`` + ``add_request``), runs ``step()`` / ``post_step()``, routes the
outputs to the waiting completions and folds the ``SchedulerStats`` that EngineCore returns
into Prometheus counters. When there is nothing to do it sleeps on a condition variable, so an
idle engine uses no CPU.

If EngineCore raises, the loop logs it the way vLLM's core.py does
(``EngineCore encountered a fatal error.`` with the full traceback), marks the engine dead,
fails every pending and future completion with ``EngineDeadError`` and stops stepping; the
process stays up (``/metrics`` keeps answering) until it is told to stop.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from vllm.logger import init_logger
from vllm.v1.engine.exceptions import EngineDeadError

logger = init_logger("vllm.kvrepro_engine.loop")

STATS_LOG_INTERVAL_S = 10.0


class EngineStopping(Exception):
    """The process is shutting down; no more completions."""


@dataclass
class Delta:
    token_ids: list[int]
    finish_reason: str | None = None


class Completion:
    """One request in flight: the handler thread reads deltas (or an error) from ``events``."""

    def __init__(self, request_id: str, num_prompt_tokens: int):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.events: queue.Queue = queue.Queue()

    def next_event(self, timeout: float | None = None):
        """A Delta, or raises EngineDeadError / EngineStopping."""
        item = self.events.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class EngineMetrics:
    """Cumulative numbers for /metrics, named after vLLM's Prometheus metrics."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    requests_finished: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def absorb(self, stats) -> None:
        self.num_requests_running = stats.num_running_reqs
        self.num_requests_waiting = stats.num_waiting_reqs + getattr(stats, "num_skipped_waiting_reqs", 0)
        self.prefix_cache_queries += stats.prefix_cache_stats.queries
        self.prefix_cache_hits += stats.prefix_cache_stats.hits
        connector = stats.connector_prefix_cache_stats
        if connector is not None:
            self.external_prefix_cache_queries += connector.queries
            self.external_prefix_cache_hits += connector.hits


class EngineLoop:
    def __init__(self, core):
        self.core = core
        self.metrics = EngineMetrics()
        self.dead = False
        self._stopping = False
        self._cond = threading.Condition()
        self._incoming: list[tuple[object, Completion]] = []
        self._pending: dict[str, Completion] = {}
        self._thread = threading.Thread(target=self._run, name="EngineCoreLoop", daemon=True)
        self._last_stats_log = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self.dead

    def submit(self, prompt_token_ids: list[int], max_tokens: int) -> Completion:
        """Queue one completion request; raises EngineDeadError / EngineStopping at once if so."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest

        request_id = f"cmpl-{uuid.uuid4().hex}"
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            mm_features=None,
            sampling_params=SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        completion = Completion(request_id, len(prompt_token_ids))
        with self._cond:
            if self.dead:
                raise EngineDeadError()
            if self._stopping:
                raise EngineStopping("the engine is shutting down")
            self._incoming.append((request, completion))
            self._cond.notify()
        return completion

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        self._fail_all(lambda: EngineStopping("the engine is shutting down"))

    # -- the loop thread ---------------------------------------------------------------------

    def _run(self) -> None:
        core = self.core
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._incoming and not core.scheduler.has_requests():
                        self._cond.wait()
                    if self._stopping:
                        return
                    batch, self._incoming = self._incoming, []
                    for request, completion in batch:
                        self._pending[request.request_id] = completion
                for request, _ in batch:
                    core.add_request(*core.preprocess_add_request(request))
                outputs, model_executed = core.step()
                core.post_step(model_executed)
                self._route(outputs)
                if not model_executed and core.scheduler.has_requests():
                    # Waiting on transfers only (e.g. WAITING_FOR_REMOTE_KVS): do not spin.
                    time.sleep(0.001)
                else:
                    # Hand the GIL to HTTP threads now rather than after the 5 ms switch
                    # interval: on a GPU the engine core is a separate process and never
                    # starves the API server, and the sim should not either.
                    time.sleep(0)
                self._maybe_log_stats()
        except Exception:
            logger.exception("EngineCore encountered a fatal error.")
        with self._cond:
            self.dead = True
        self._fail_all(EngineDeadError)
        # What vLLM's frontend logs once it learns the core died: a traceback ending in
        # "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. ...".
        # Raised outside the except block so the root cause is not printed a second time.
        try:
            raise EngineDeadError()
        except EngineDeadError as err:
            logger.error("AsyncLLM output_handler failed.", exc_info=err)

    def _route(self, outputs) -> None:
        for engine_outputs in (outputs or {}).values():
            stats = engine_outputs.scheduler_stats
            if stats is not None:
                self.metrics.absorb(stats)
            for out in engine_outputs.outputs:
                completion = self._pending.get(out.request_id)
                if completion is None:
                    continue
                reason = str(out.finish_reason) if out.finish_reason is not None else None
                completion.events.put(Delta(list(out.new_token_ids), reason))
                if reason is not None:
                    del self._pending[out.request_id]
                    self.metrics.requests_finished += 1
                    self.metrics.finish_reasons[reason] = self.metrics.finish_reasons.get(reason, 0) + 1

    def _fail_all(self, make_error) -> None:
        with self._cond:
            victims = list(self._pending.values()) + [c for _, c in self._incoming]
            self._pending.clear()
            self._incoming = []
        for completion in victims:
            completion.events.put(make_error())

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats_log < STATS_LOG_INTERVAL_S:
            return
        self._last_stats_log = now
        m = self.metrics
        logger.info(
            "Engine 000: Running: %d reqs, Waiting: %d reqs, Finished: %d reqs, "
            "Prefix cache hit rate: %.1f%%, External prefix cache hit rate: %.1f%%",
            m.num_requests_running, m.num_requests_waiting, m.requests_finished,
            100.0 * m.prefix_cache_hits / max(1, m.prefix_cache_queries),
            100.0 * m.external_prefix_cache_hits / max(1, m.external_prefix_cache_queries),
        )
