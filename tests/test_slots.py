"""kvrepro/matrix/slots.py on its own: how many runs start or take load at once, when the next run
is decided, and how an error or a stop ends the rest. The runs here are threads that wait on
events (no engine: what is tested is the scheduler; tests/test_run_slots.py runs real engines)."""

from __future__ import annotations

import threading

import pytest

from kvrepro.matrix.slots import RunSlots


class Cells:
    """Runs that report their busy phase (start and load) and then wait for the test to end them."""

    def __init__(self, frees_early: bool):
        self.frees_early = frees_early
        self.lock = threading.Lock()
        self.busy = self.in_flight = self.most_busy = self.most_in_flight = 0
        self.started: list[int] = []
        self.release: dict[int, threading.Event] = {}

    def __call__(self, n: int, free_slot) -> None:
        with self.lock:
            self.started.append(n)
            self.busy += 1
            self.in_flight += 1
            self.most_busy = max(self.most_busy, self.busy)
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            done = self.release.setdefault(n, threading.Event())
        assert (free_slot is not None) == self.frees_early
        threading.Event().wait(0.02)  # the start and the load: long enough for a second run to overlap, were it let
        with self.lock:
            self.busy -= 1
        if free_slot is not None:
            free_slot()  # the load ended: the tail (the engine's stop, the verdict) follows
        done.wait(10)
        with self.lock:
            self.in_flight -= 1

    def end(self, n: int) -> None:
        with self.lock:
            self.release.setdefault(n, threading.Event()).set()


def _ender(cells: Cells, total: int, jobs: int) -> threading.Thread:
    """Ends run n once run n + 2 * jobs - 1 has started (or n is among the last): each tail outlives
    the start of as many runs as the slots allow."""

    def run() -> None:
        ended = 0
        while ended < total:
            with cells.lock:
                can = len(cells.started) >= min(total, ended + 2 * jobs)
            if can:
                cells.end(ended)
                ended += 1
            else:
                threading.Event().wait(0.01)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_run_that_frees_its_slot_early_lets_the_next_one_start_beside_its_tail(jobs):
    cells = Cells(frees_early=True)
    ender = _ender(cells, 8, jobs)
    RunSlots(jobs, threading.Event(), frees_early=True).run(((n,) for n in range(8)), cells)
    ender.join(10)
    assert cells.started == list(range(8))
    assert cells.most_busy <= jobs  # never more than `jobs` starting or loading
    assert jobs < cells.most_in_flight <= 2 * jobs  # tails overlap the next runs, at most one per slot


def test_a_run_that_holds_its_slot_runs_alone_on_one_slot():
    cells = Cells(frees_early=False)
    for n in range(4):
        cells.end(n)
    RunSlots(1, threading.Event(), frees_early=False).run(((n,) for n in range(4)), cells)
    assert cells.started == [0, 1, 2, 3] and cells.most_in_flight == 1


def test_the_next_run_is_taken_only_once_a_slot_is_free():
    """The work is read when a slot frees (runner.longest_first orders by what is recorded then):
    with one slot, item n+1 is made only after run n freed its slot."""
    made: list[int] = []
    freed: list[int] = []

    def work():
        for n in range(4):
            made.append(n)
            assert freed == list(range(n)), (made, freed)
            yield (n,)

    def cell(n, free_slot):
        freed.append(n)
        free_slot()

    RunSlots(1, threading.Event(), frees_early=True).run(work(), cell)
    assert made == freed == [0, 1, 2, 3]


def test_an_error_in_a_run_stops_the_others_and_is_raised():
    stop = threading.Event()
    started: list[int] = []

    def cell(n, free_slot):
        started.append(n)
        if n == 1:
            raise RuntimeError("a bug in a run")
        stop.wait(10)  # a run that ends only when stopped

    with pytest.raises(RuntimeError, match="a bug in a run"):
        RunSlots(2, stop, frees_early=False).run(((n,) for n in range(10**9)), cell)
    assert stop.is_set() and sorted(started) == [0, 1]


def test_a_stop_ends_the_work_without_reading_it_further():
    stop = threading.Event()
    started: list[int] = []

    def cell(n, free_slot):
        started.append(n)
        if n == 5:
            stop.set()

    RunSlots(2, stop, frees_early=True).run(((n,) for n in range(10**9)), cell)
    assert 6 <= len(started) <= 6 + 3, started  # those already taken when the stop came, no more
