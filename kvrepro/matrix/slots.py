"""How a matrix's runs share its engine slots.

At most ``jobs`` runs start an engine or send load at once: each holds a slot meanwhile. On a
target that allows it (``Target.starts_during_stop``) a run frees its slot when its load ends:
its tail (the engine's last counts, its stop, the verdict) is mostly waiting, so the next engine
starts meanwhile, even with one slot (a suite runs each entry on one). At most ``2 * jobs`` runs
are then in flight, tails included. Elsewhere a run holds its slot to its end.

Made of the standard library's parts: a ``ThreadPoolExecutor`` of ``2 * jobs`` workers, a
``threading.Semaphore`` of ``jobs`` slots, and the work as one iterator the workers read (under a
lock) only once they hold a slot. Not one executor task per run: a slot frees in the middle of a
run (at its load's end), which no executor's ``max_workers`` expresses; and what runs next is
decided only when a slot frees (``runner.longest_first`` orders a repetition's builds by what the
runs recorded so far took), from a work list that may be endless (``--reps`` 10**9 stopped by
Ctrl-C, tests/test_reliability.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any

# how often a worker waiting for a slot looks at the stop event (a threading.Event wakes no semaphore)
STOP_POLL_S = 0.05

# runs one item of the work; its last argument frees the run's slot early (None: it cannot)
RunCell = Callable[..., None]


def once(release: Callable[[], None]) -> Callable[[], None]:
    """``release``, callable any number of times but run once (a run frees its slot when its load
    ends, or at its end when it never got that far)."""
    lock = threading.Lock()
    state = {"done": False}

    def call() -> None:
        with lock:
            if state["done"]:
                return
            state["done"] = True
        release()

    return call


def wait_through_interrupts(futures: Iterable[Future]) -> None:
    """Let running runs tear their engines down before the target closes, even through another
    Ctrl-C: closing first would let a run that is still starting an engine leave it behind."""
    for future in futures:
        while True:
            try:
                future.exception()
                break
            except KeyboardInterrupt:
                continue
            except BaseException:  # cancelled
                break


class RunSlots:
    """Runs work items, ``jobs`` of them at a time in their start and load, until ``stop`` is set.

    A run's error (a bug in kvrepro, not a verdict) ends them all: ``stop`` is set, the others
    record what they have and stop, and the error is raised from :meth:`run`, as is a
    KeyboardInterrupt that reaches the calling thread."""

    def __init__(self, jobs: int, stop: threading.Event, frees_early: bool):
        self.jobs = max(1, jobs)
        self.stop = stop
        self.frees_early = frees_early  # a run frees its slot when its load ends
        self._slots = threading.Semaphore(self.jobs)

    def run(self, work: Iterable[tuple[Any, ...]], run_cell: RunCell) -> None:
        """Run every item of ``work`` (an iterator: nothing is made for an item before its turn) as
        ``run_cell(*item, free_slot)``."""
        if self.jobs == 1 and not self.frees_early:
            self._in_order(work, run_cell)
        else:
            self._in_parallel(iter(work), run_cell)

    def _in_order(self, work: Iterable[tuple[Any, ...]], run_cell: RunCell) -> None:
        """One slot held to each run's end: the runs one after another, in this thread (a Ctrl-C
        reaches the run itself)."""
        for item in work:
            if self.stop.is_set():
                return
            run_cell(*item, None)

    def _in_parallel(self, work: Iterator[tuple[Any, ...]], run_cell: RunCell) -> None:
        take = self._taker(work)
        workers = 2 * self.jobs if self.frees_early else self.jobs
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvrepro-run")
        futures = [pool.submit(self._worker, take, run_cell) for _ in range(workers)]
        try:
            for future in as_completed(futures):
                future.result()  # a bug in a run (not a verdict) ends the matrix
        except BaseException:
            self.stop.set()  # the other runs record what they have and stop
            wait_through_interrupts(futures)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _taker(self, work: Iterator[tuple[Any, ...]]) -> Callable[[], tuple[Any, ...] | None]:
        """The next item of ``work`` (None: no more, or stopped), for one worker at a time."""
        lock = threading.Lock()

        def take() -> tuple[Any, ...] | None:
            with lock:
                return None if self.stop.is_set() else next(work, None)

        return take

    def _worker(self, take: Callable[[], tuple[Any, ...] | None], run_cell: RunCell) -> None:
        """Take a slot, then the next item (only now: an order made from the runs recorded so far
        sees every run that ended before), run it; again, until the work ends or a stop."""
        while self._hold_slot():
            item = take()
            if item is None:
                self._slots.release()
                return
            free = once(self._slots.release)
            try:
                run_cell(*item, free if self.frees_early else None)
            finally:
                free()  # the run ended before its load did (or never started), or holds its slot to its end

    def _hold_slot(self) -> bool:
        """Wait for a free slot; False (holding none) once a stop is set."""
        while not self._slots.acquire(timeout=STOP_POLL_S):
            if self.stop.is_set():
                return False
        if self.stop.is_set():
            self._slots.release()
            return False
        return True
