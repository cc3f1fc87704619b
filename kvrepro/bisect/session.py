"""A bisection on disk: probes points through the runner, records every step, resumes.

Layout (next to matrix runs, so ``results show`` finds it)::

    results/<bisection-id>/bisect.json          the request, every run per point, the steps, the answer
    results/<bisection-id>/probes/<run-id>/     one ordinary matrix run folder per batch of runs

``bisect.json`` is rewritten (atomically) after every batch, so Ctrl-C loses at most the runs
that were interrupted; ``--resume`` replays the recorded verdicts through the same
deterministic search and only runs what is missing.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .. import lifetime
from ..results import store as results
from ..deploy import get_target
from ..deploy.base import Target
from ..errors import KvreproError, SpecError
from ..records import RunResult
from ..report.records import BisectDetail, BisectResult, BisectStep
from ..matrix.runner import MatrixOptions, Progress, SilentProgress, run_matrix
from .points import Point, PointMatrices
from .rules import (Evidence, PointRule, PointVerdict, RunSummary, Tally, confidence, default_max_runs, estimate_p_bad,
                    evidence, runs_needed_for_good, skip_reason)
from .state import BisectRequest, PointRecord, SessionState

STATE_FILE = "bisect.json"
LOCK_FILE = "bisect.lock"


class Interrupted(KvreproError):
    exit_code = 130


class BisectionBusy(KvreproError):
    """Another kvrepro is running this bisection right now."""

    exit_code = 2


def _owner_pid(folder: Path) -> str | None:
    """The pid the bisection's state names as its owner (for the message), if it can be read."""
    try:
        return (read_state(folder / STATE_FILE).owner or {}).get("pid")
    except (OSError, ValueError, KvreproError):
        return None


def take_lock(folder: Path, state: SessionState) -> int:
    """Hold the bisection's lock for as long as this process runs it: an exclusive ``flock`` on
    ``bisect.lock``. The kernel drops it when the holder exits, however it exits (SIGKILL
    included), so a dead owner never holds it. Returns the file descriptor (close it to let go)."""
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by engines (O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = _owner_pid(folder) if (folder / STATE_FILE).is_file() else None
        who = f"pid {pid}" if pid else "another kvrepro"
        raise BisectionBusy(f"{state.bisection_id} is still running ({who}); wait for it to finish, or stop it "
                            f"(kill -INT {pid or 'PID'}) and then `--resume {state.bisection_id}`") from None
    return fd


def new_bisection_id() -> str:
    return "bisect-" + results.new_run_id()


def is_bisection(root: Path, run_id: str) -> bool:
    return (root / run_id / STATE_FILE).is_file()


def latest_bisection(root: Path) -> str:
    ids = sorted(d.name for d in root.iterdir() if (d / STATE_FILE).is_file()) if root.is_dir() else []
    if not ids:
        raise SpecError(f"--resume latest: no bisection under {root}/ to resume; start one with `kvrepro bisect ...`")
    return ids[-1]


def read_state(path: Path) -> SessionState:
    return SessionState.from_json(results.read_json(path), str(path))


def load_state(root: Path, bisection_id: str) -> SessionState:
    if bisection_id == "latest":
        bisection_id = latest_bisection(root)
    # the state is written back there: never outside --results
    path = results.inside(root, root / bisection_id, f"--resume takes a bisection id under {root}/ (or latest)") / STATE_FILE
    if not path.is_file():
        raise SpecError(f"--resume {bisection_id}: no bisection of that id under {root}/ (a folder with {STATE_FILE}); "
                        f"pass --results if it is elsewhere")
    return read_state(path)


def ensure_idle(root: Path, bisection_id: str) -> None:
    """BisectionBusy if a live kvrepro runs this bisection (before anything is drawn or started;
    the lock the session takes is what really keeps a second one out)."""
    state = load_state(root, bisection_id)
    os.close(take_lock(root / state.bisection_id, state))


def _run_summary(run: RunResult) -> RunSummary:
    """What the point rule reads of a run (the run folder keeps the rest)."""
    return RunSummary(verdict=run.verdict.value, outcome=run.outcome.value, title=run.title, rep=run.rep,
                      trigger_count=run.trigger_count, state_count=run.state_count, requests=run.requests,
                      kv_check=run.kv_check, kv_violations=run.kv_violations,
                      seconds=run.seconds, run_dir=run.run_dir,
                      stopped_because=run.load.stopped_because if run.load is not None else None)


class Session:
    """One bisection's state and the means to probe a point (a cached, resumable oracle)."""

    def __init__(self, root: Path, state: SessionState, matrices: PointMatrices, progress: Progress | None = None,
                 stop: threading.Event | None = None, on_step: Callable[[BisectStep], None] | None = None):
        self.root = root
        self.state = state
        self.matrices = matrices
        self.progress = progress or SilentProgress()
        self.stop = stop or threading.Event()
        self.on_step = on_step or (lambda step: None)
        self.folder = root / state.bisection_id
        self._targets: dict[str, Target] = {}
        self._targets_lock = threading.Lock()
        # one build at a time: the runner's prepare and the prefetch thread's must never build the
        # same runtime env or overlay side by side (a runtime env being installed is not shareable)
        self._prepare_lock = threading.Lock()
        self._prefetchers: list[threading.Thread] = []
        self._started = time.monotonic()
        # one process at a time runs a bisection (a second `--resume` refuses while it runs)
        self._lock_fd: int | None = take_lock(self.folder, state)
        state.owner = lifetime.owner()

    # ------------------------------------------------------------------ creating / persisting
    @classmethod
    def create(cls, root: Path, kind: str, request: BisectRequest, matrices: PointMatrices, **kw) -> "Session":
        bisection_id = new_bisection_id()
        (root / bisection_id / "probes").mkdir(parents=True, exist_ok=False)
        state = SessionState(bisection_id=bisection_id, kind=kind, request=request, alpha=request.alpha,
                             started=time.time())
        session = cls(root, state, matrices, **kw)
        session.save()
        return session

    @property
    def request(self) -> BisectRequest:
        return self.state.request

    def save(self) -> None:
        results.write_json(self.folder / STATE_FILE, self.state.to_json())

    @property
    def steps(self) -> list[BisectStep]:
        return self.state.steps

    # ------------------------------------------------------------------ targets and prefetch
    def _target_for(self, point: Point, loaded) -> Target:
        """An open target per base release: consecutive probes on it keep its engine zygote warm."""
        key = self.matrices.base_of(point)
        with self._targets_lock:
            if key not in self._targets:
                name = self.request.target or loaded.matrix.target
                target = get_target(name)(loaded)
                unlocked = target.prepare

                def prepare(plan, unlocked=unlocked):
                    with self._prepare_lock:
                        return unlocked(plan)

                target.prepare = prepare  # type: ignore[method-assign]
                self._targets[key] = target
            return self._targets[key]

    def prefetch(self, points: list[Point]) -> None:
        """Prepare these points' builds (overlays, images) in the background while one runs."""
        todo = [p for p in points if self.recorded_verdict(p) is None]
        if not todo:
            return

        def prepare() -> None:
            for point in todo:
                if self.stop.is_set():
                    return
                try:
                    loaded = self.matrices.matrix_for(point)
                    self._target_for(point, loaded).prepare(loaded.plans()[0])
                except Exception:  # noqa: BLE001 - the probe itself will build again and report it
                    pass

        thread = threading.Thread(target=prepare, daemon=True, name="kvrepro-prefetch")
        thread.start()
        self._prefetchers.append(thread)

    def close(self) -> None:
        for thread in self._prefetchers:
            thread.join()
        for target in self._targets.values():
            target.close()
        self._targets.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------------ probing
    def recorded_verdict(self, point: Point) -> PointVerdict | None:
        record = self.state.record(point)
        return PointVerdict(record.verdict) if record is not None and record.verdict else None

    def runs_of(self, point: Point) -> list[RunSummary]:
        record = self.state.record(point)
        return record.runs if record is not None else []

    def tally(self, point: Point) -> Tally:
        return Tally.of(self.runs_of(point), self.request.title)

    def verdict_of(self, point: Point, role: str, rule: PointRule) -> PointVerdict:
        """The point's verdict: recorded, or run batch by batch until ``rule`` is decisive."""
        recorded = self.recorded_verdict(point)
        if recorded is not None:
            return recorded
        record = self.state.points.setdefault(point.key, PointRecord(point))
        title = self.request.title
        started = time.monotonic()
        while True:
            tally = Tally.of(record.runs, title)
            # a build that failed fails again: no point in running it more often
            verdict = PointVerdict.SKIP if record.build_error else rule.decide(tally)
            if verdict is not None:
                break
            if self.stop.is_set():
                raise Interrupted("interrupted")
            self._run_batch(point, record, rule.next_batch(tally))
        step = BisectStep(
            point=point, label=point.label, role=role, verdict=verdict.value,
            counts=dict(sorted(tally.labels.items())),
            runs_needed_for_good=rule.runs_for_good if rule.runs_for_good <= rule.max_runs else None,
            state=tally.state if verdict is PointVerdict.GOOD else None,
            reason=("" if verdict is not PointVerdict.SKIP
                    else f"build failed: {record.build_error}" if record.build_error
                    else skip_reason(tally, rule)),
            probe_runs=tuple(record.probe_runs), seconds=round(time.monotonic() - started, 1),
        )
        record.verdict = verdict.value
        self.steps.append(step)
        self.save()
        self.on_step(step)
        return verdict

    def _run_batch(self, point: Point, record: PointRecord, count: int) -> None:
        loaded = self.matrices.matrix_for(point)
        target = self._target_for(point, loaded)
        request = self.request
        first_rep = 1 + max((r.rep or 0 for r in record.runs), default=-1)
        # no more at once than run side by side: a point is bad at its first crash, so later
        # batches are often not needed
        count = max(1, min(count, request.jobs or target.max_parallel()))
        self.progress.stage(f"{point.label}: {count} run(s) from rep {first_rep}")
        run = run_matrix(loaded, MatrixOptions(target=request.target, repetitions=count,
                                               results_root=self.folder / "probes", jobs=request.jobs,
                                               first_rep=first_rep),
                         self.progress, self.stop, target=target)
        record.probe_runs.append(str(Path("probes") / run.run_id))
        build = run.build(point.build_name)
        if build is not None and build.build_error:
            record.build_error = build.build_error.strip().splitlines()[0]
        for r in build.runs if build is not None else ():
            summary = _run_summary(r)
            if evidence(summary, request.title) is not Evidence.DROPPED:
                record.runs.append(summary)
        self.save()
        if run.status == "interrupted" or self.stop.is_set():
            raise Interrupted("interrupted")

    # ------------------------------------------------------------------ rules and the result
    def end_rule(self) -> PointRule:
        """The bad end: `calibrate` runs at least (they measure p_bad); a few more to see one crash."""
        calibrate = self.request.calibrate
        return PointRule(runs_for_good=10**6, max_runs=calibrate + 3, min_runs=calibrate)

    def point_rule(self) -> PointRule:
        if self.state.p_bad is None:
            raise KvreproError("internal: p_bad unknown before the bad end was run")
        needed = runs_needed_for_good(self.state.p_bad, self.request.alpha)
        return PointRule(runs_for_good=needed, max_runs=self.request.max_runs or default_max_runs(needed))

    def measure_p_bad(self, bad_end: Point) -> float:
        tally = self.tally(bad_end)
        p_bad = round(estimate_p_bad(tally.bad, tally.clean), 4)
        self.state.p_bad = p_bad
        self.save()
        return p_bad

    def finish(self, answer: str | list[str] | None, reason: str = "",
               detail: dict[str, BisectDetail] | None = None) -> BisectResult:
        # each good verdict's clean runs bound the chance it was a crashing point that stayed clean
        clean_counts = [self.tally(step.point).clean for step in self.steps  # type: ignore[arg-type]
                        if step.verdict == PointVerdict.GOOD.value]
        p_bad = self.state.p_bad
        self.state.status = "complete"
        self.state.answer = answer
        self.state.reason = reason if answer is None else ""
        self.state.confidence = round(confidence(p_bad, clean_counts), 4) if answer is not None and p_bad else None
        self.state.finished = time.time()
        self.state.seconds = round(time.monotonic() - self._started, 1)
        if detail:
            self.state.detail.update(detail)
        self.save()
        return self.result()

    def mark_interrupted(self) -> None:
        self.state.status = "interrupted"
        self.save()

    def result(self) -> BisectResult:
        return result_from_state(self.state, self.folder)


def result_from_state(state: SessionState, folder: Path) -> BisectResult:
    status = state.status
    if status == "running" and lifetime.owner_alive(state.owner) is False:
        status = "aborted"  # its kvrepro vanished (SIGKILL): `--resume` continues it
    return BisectResult(kind=state.kind, answer=state.answer, reason=state.reason, confidence=state.confidence,
                        p_bad=state.p_bad, alpha=state.alpha, steps=tuple(state.steps), status=status,
                        bisection_id=state.bisection_id, path=str(folder), detail=dict(state.detail))
