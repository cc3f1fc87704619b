"""Runs a matrix: every build through every repetition, stage by stage, recording as it goes.

spec -> target.prepare (builds) -> target.start (deploy) -> loadgen -> classify -> verdict ->
results. Nothing here knows how a target starts an engine or how a signature is recognised; it
only passes records between the stages and writes each one down the moment it exists, so that
Ctrl-C or a crash of kvrepro itself loses nothing already known.
"""

from __future__ import annotations

import functools
import os
import platform
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import requests

from .. import __version__, stopping
from ..results import store as results
from ..report.expectations import enough_runs
from ..classify import LogParser, LogTail
from ..classify.judge import judge
from ..classify.settle import settled
from ..deploy import engine_api_key as target_api_key
from ..deploy import get_target
from ..deploy.base import EngineHandle, SilentProgress, Target
from ..errors import InfraError, KvreproError, describe_os_error
from ..loadgen import run_load
from ..loadgen.runner import replay_load
from ..loadgen.trace import TraceHeader
from ..spec.geometry import built_mismatch as geometry_mismatch
from ..loadgen.capacity import engine_capacity
from ..records import (BuildArtifact, BuildPlan, BuildRecord, HostInfo, LoadSummary, Outcome, PatchInfo, RunBuildEntry, RunInfo, RunManifest, RunResult, StopRule, Verdict)
from ..secrets import option_values, redact
from ..spec.matrix import LoadedMatrix
from .slots import RunSlots


# how long a finished run's engine keeps running so its last counts reach the log
# (kvrepro/engine/executor.py writes them every FLUSH_INTERVAL_S = 0.5 s)
COUNTS_SETTLE_S = 1.0


class Progress(Protocol):
    def stage(self, text: str) -> None: ...
    def detail(self, text: str) -> None: ...
    def run_started(self, build: str, rep: int, budget: int | None) -> None: ...
    def requests_done(self, build: str, rep: int, done: int, failed: int) -> None: ...
    def run_finished(self, result: RunResult) -> None: ...


@dataclass
class MatrixOptions:
    target: str | None = None
    builds: list[str] | None = None
    repetitions: int | None = None
    results_root: Path = results.DEFAULT_ROOT
    jobs: int | None = None  # engines run at once; None: what the target says it can take
    first_rep: int = 0  # number of the first repetition (its seeds follow): a later batch of the same build
    adaptive_max: int | None = None  # repeat each build until decisive (stats.decisive), at most this often
    bases: list[str] | None = None  # vLLM releases to run every build on; None: the matrix's base
    replay: Any = None  # a loadgen.trace.Trace: send it (sequentially) instead of the matrix's load
    # each run ends once its verdict is settled (kvrepro/classify/settle.py); full_load: at its budget
    full_load: bool = False
    stop_rule: StopRule | None = None  # None: StopRule() (the bug's state, then the trigger path)


def stop_rule_for(options: MatrixOptions, expect: str | None) -> StopRule | None:
    """The stopping rule of a build's runs; None (the whole load) when asked for, on a replay (it
    sends a recorded sequence to its end), or when a stall is expected: no count settles a stall."""
    if options.full_load or options.replay is not None or "STALL" in (expect or "").upper():
        return None
    return options.stop_rule or StopRule()


def _build_record(artifact: BuildArtifact) -> BuildRecord:
    """build.json: what results.load_run reads back as the same record."""
    return BuildRecord(ok=artifact.ok, ref=artifact.ref, error=artifact.error, reused=artifact.reused,
                       manifest=artifact.manifest)


def _fetch_metrics(handle: EngineHandle) -> str | None:
    try:
        resp = requests.get(handle.base_url + "/metrics", timeout=5)
        return resp.text if resp.ok else None
    except requests.RequestException:
        return None


def _engine_args(target: Target) -> list[str] | None:
    try:
        return target.engine_args()
    except KvreproError:  # e.g. a host the matrix does not define: start() reports it as INFRA
        return None


def _fs_tier_folders(target: Target, run_dir: Path) -> list:
    try:
        return target.fs_tier_folders(run_dir)
    except KvreproError:  # as _engine_args: start() reports it
        return []


def _remove_fs_tiers(folders: list, run_dir: Path) -> None:
    """The fs offload tiers' files, gone once the engine stopped: chunk copies of the run's KV (one
    file per chunk, megabytes on a long run), no evidence, and no later engine may read them
    (kvrepro/spec/fs_tier.py); the manifest keeps where they were. Only folders inside ``run_dir``
    (a container's are removed with the container)."""
    import shutil

    inside = run_dir.resolve()
    for folder in folders:
        path = Path(folder.engine_root_dir)
        if path.is_absolute() and path.resolve().is_relative_to(inside) and path.resolve() != inside:
            shutil.rmtree(path, ignore_errors=True)


def engine_api_key(loaded: LoadedMatrix, target_name: str) -> str | None:
    """The key an engine started with --api-key (any spelling) or VLLM_API_KEY wants on /v1/*."""
    keys = option_values(list(loaded.matrix.engine.extra_args), "--api-key")
    if keys:
        return keys[0]
    return target_api_key(target_name, loaded.matrix)  # e.g. $VLLM_API_KEY a target passes to its engine


def _infra_result(plan: BuildPlan, rep: int, run_dir: Path, error: str, seconds: float = 0.0) -> RunResult:
    first = error.strip().splitlines()[0] if error.strip() else "infrastructure failure"
    return RunResult(build=plan.name, rep=rep, verdict=Verdict.INFRA, outcome=Outcome.INFRA, title=first,
                     trigger_count=0, external_hit_calls=0, requests=0, seconds=round(seconds, 3),
                     infra_error=redact(error), run_dir=str(run_dir), base=plan.base)


def _start_failure(error: str, log_path: Path, artifact: BuildArtifact, target) -> tuple[str, str | None]:
    """Why the engine did not start, with its root cause from its log (parsed once), and what
    its `vllm serve` refused among its arguments (None: it did not refuse them).

    The target's error says what was seen from outside ("exited with code 1 before it became
    healthy", "did not become healthy within 120s"); the cause is in the engine's log, so the
    classifier's title of that log (or its last meaningful line) is appended.
    """
    head = error.strip().splitlines()[0] if error.strip() else "the engine did not start"
    head = head.split("; last lines of", 1)[0].rstrip(" ;:")
    if not log_path.is_file():
        return head, None
    source_root = Path(artifact.source_root) if artifact.source_root else None
    parsed = LogTail(log_path, LogParser(source_root, target)).finish()
    classification = parsed.classification
    if classification.outcome is not Outcome.NONE and classification.title:
        return f"{head}: {classification.title}", classification.refused_arguments
    if parsed.last_line:
        return f"{head}: last log line: {redact(parsed.last_line)[:200]}", None
    return head, None


_PROBE_SETTLE_S = 2.5


def _write_manifest(loaded: LoadedMatrix, target: Target, artifact: BuildArtifact, run_dir: Path, rep: int,
                    replay: Any, fs_tiers: list) -> None:
    """manifest.json: what this repetition is about to run, written before anything starts."""
    matrix, plan = loaded.matrix, artifact.plan
    engine_args = _engine_args(target)
    results.write_json(run_dir / "manifest.json", RunManifest(
        build=plan.name, rep=rep, base=plan.base, target=target.name,
        patches=tuple(PatchInfo(p.name, p.upstream, p.sha256, p.reverse) for p in plan.patches),
        artifact=_build_record(artifact),
        engine_args=tuple(engine_args) if engine_args is not None else None,
        sim_seed=matrix.engine.sim.seed + rep, load_seed=matrix.load.seed + rep,
        load=matrix.load.model_dump(), runs=matrix.runs.model_dump(), kvrepro_version=__version__,
        replay_of=str(replay.path) if replay is not None else None, fs_tiers=tuple(fs_tiers),
    ))


def _not_started(loaded: LoadedMatrix, artifact: BuildArtifact, run_dir: Path, rep: int, exc: InfraError,
                 seconds: float, stop: threading.Event) -> RunResult:
    """The record of an engine that did not start: INFRA with its root cause, or INTERRUPTED when a
    stop came while it was starting."""
    result = _infra_result(artifact.plan, rep, run_dir, str(exc), seconds)
    title, refused = _start_failure(str(exc), run_dir / "engine.log", artifact, loaded.matrix.target_signature)
    result = replace(result, title=title, refused_arguments=refused)
    if "last lines of" in str(exc):
        # the target quoted the engine's log (a traceback of vLLM's, perhaps): the record keeps
        # the root cause and where the whole log is, not raw log lines
        result = replace(result, infra_error=redact(f"{title}\n(the whole engine log: {run_dir / 'engine.log'})"))
    if stop.is_set():  # Ctrl-C while it was starting: says nothing about the infrastructure
        return replace(result, verdict=Verdict.INTERRUPTED, outcome=Outcome.NONE,
                       title="interrupted while the engine was starting")
    return result


def _send_load(loaded: LoadedMatrix, target: Target, plan: BuildPlan, handle: EngineHandle, log: LogTail,
               run_dir: Path, rep: int, progress: Progress, stop: threading.Event, replay: Any,
               stop_rule: StopRule | None) -> LoadSummary:
    """The matrix's load (sized for the engine's logged capacity, ended early once ``stop_rule``
    settles the verdict), or ``replay``'s recorded requests, to the started engine."""
    matrix = loaded.matrix
    api_key = engine_api_key(loaded, target.name)
    on_progress = lambda done, failed: progress.requests_done(plan.name, rep, done, failed)  # noqa: E731
    logged = log.read().capacity
    if replay is not None:
        load = replay_load(handle.base_url, replay, matrix.runs, run_dir / "load.jsonl", alive=handle.alive,
                           on_progress=on_progress, stop=stop, trace_path=run_dir / "trace.jsonl", api_key=api_key)
        if load.stopped_because == "budget" and not stop.is_set():
            # a replay can be over in a fraction of a second: give the probe's reporter
            # (every REPORT_INTERVAL_S = 2 s) time to write the counts before the engine stops
            stop.wait(_PROBE_SETTLE_S)
        return load
    engine_args = _engine_args(target)
    header = TraceHeader().updated(build=plan.name, rep=rep, sim_seed=matrix.engine.sim.seed + rep,
                                   engine_args=tuple(engine_args) if engine_args is not None else None)
    capacity = engine_capacity(matrix.load, logged, matrix.engine.block_size, matrix.engine.max_model_len,
                               chunk_tokens=matrix.engine.offload_chunk_tokens,
                               data_parallel_size=matrix.engine.data_parallel_size)
    is_settled = None
    if stop_rule is not None:
        is_settled = lambda: settled(log.read().exposure(), stop_rule)  # noqa: E731
    return run_load(handle.base_url, matrix.load, matrix.runs, run_dir / "load.jsonl",
                    seed=matrix.load.seed + rep, alive=handle.alive, on_progress=on_progress,
                    stop=stop, capacity=capacity, trace_path=run_dir / "trace.jsonl", trace_header=header,
                    api_key=api_key, settled=is_settled)


def run_one(loaded: LoadedMatrix, target: Target, artifact: BuildArtifact, run_dir: Path, rep: int,
            progress: Progress, stop: threading.Event, replay: Any = None,
            stop_rule: StopRule | None = None, on_load_done: Callable[[], None] | None = None) -> RunResult:
    """One repetition of one build; writes manifest.json first and verdict.json last.

    ``replay`` (a :class:`~kvrepro.loadgen.trace.Trace`) is sent instead of the matrix's load.
    ``stop_rule``: end the load once the engine's log settles the verdict (None: at the budget).
    ``on_load_done`` is called once the load has ended: what is left (the engine's last counts,
    its stop, the verdict) needs little CPU, so the caller may start the next engine meanwhile."""
    matrix = loaded.matrix
    plan = artifact.plan
    fs_tiers = _fs_tier_folders(target, run_dir)
    _write_manifest(loaded, target, artifact, run_dir, rep, replay, fs_tiers)
    started = time.monotonic()
    if not artifact.ok:
        return _infra_result(plan, rep, run_dir, artifact.error or "build failed")

    progress.run_started(plan.name, rep, matrix.runs.requests)
    try:
        handle = target.start(artifact, run_dir, rep)
        engine_start_s = round(time.monotonic() - started, 3)
    except InfraError as exc:
        _remove_fs_tiers(fs_tiers, run_dir)
        return _not_started(loaded, artifact, run_dir, rep, exc, time.monotonic() - started, stop)
    if stop.is_set():  # stopped while it started: it gets no request (kvrepro#8)
        handle.stop()
        _remove_fs_tiers(fs_tiers, run_dir)
        return replace(_infra_result(plan, rep, run_dir, "interrupted", time.monotonic() - started),
                       verdict=Verdict.INTERRUPTED, outcome=Outcome.NONE,
                       title="interrupted while the engine was starting", infra_error=None)

    load: LoadSummary | None = None
    metrics_text: str | None = None
    engine_exit: int | None = None
    # the engine log, read once: a piece at start (the capacity the load is sized for), pieces
    # while the load runs (the stop rule), the rest once the engine stopped (the verdict)
    source_root = Path(artifact.source_root) if artifact.source_root else None
    log = LogTail(handle.log_path, LogParser(source_root, matrix.target_signature))
    try:
        load = _send_load(loaded, target, plan, handle, log, run_dir, rep, progress, stop, replay, stop_rule)
        engine_exit = handle.exit_code()
        metrics_text = _fetch_metrics(handle)
        if on_load_done is not None:
            on_load_done()
        if metrics_text is not None:
            results.write_atomic(run_dir / "metrics.txt", metrics_text)
        if engine_exit is None and not stop.is_set():
            # the engine writes its counters (probe, shadow KV, offload jobs) to its log every
            # 0.5 s; a stop may kill EngineCore before it writes them once more
            time.sleep(COUNTS_SETTLE_S)
    except InfraError as exc:
        # the load could not be sent (the API refused kvrepro's own calls): this repetition is
        # INFRA with the reason, the run goes on (the engine is stopped below)
        return replace(_infra_result(plan, rep, run_dir, str(exc), time.monotonic() - started),
                       engine_start_s=engine_start_s)
    finally:
        handle.stop()
        _remove_fs_tiers(fs_tiers, run_dir)
    seconds = time.monotonic() - started

    parsed = log.finish()
    judgement = judge(parsed, metrics_text=metrics_text, load=load,
                      engine_exit=engine_exit, expected_probe_sha256=artifact.manifest.probe_target_sha256,
                      other_engine=geometry_mismatch(matrix.engine, parsed.geometries),
                      stall_timeout_s=matrix.runs.stall_timeout_s)
    return RunResult.judged(judgement, build=plan.name, rep=rep, requests=load.requests_sent if load else 0,
                            seconds=round(seconds, 3), run_dir=str(run_dir), base=plan.base, load=load,
                            engine_exit=engine_exit, probe_expected_sha256=artifact.manifest.probe_target_sha256,
                            engine_start_s=engine_start_s)


def _error_line(exc: BaseException) -> str:
    return redact(describe_os_error(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}")[:500]


def _mark_ended(folder: results.RunFolder, status: str, error: str | None) -> None:
    """run.json's last word, even on a full disk: the atomic write needs room for a second copy;
    failing that, the file is overwritten in place (same inode, about the same size)."""
    fields: dict[str, Any] = {"status": status, "finished": time.time()}
    if error:
        fields["error"] = error
    try:
        folder.update(**fields)
        return
    except OSError:
        pass
    try:
        info_path = folder.path / "run.json"
        info = results.read_json(info_path)
        info.update(fields)
        import json

        text = redact(json.dumps(info, indent=2) + "\n").encode()
        with open(info_path, "r+b") as fh:
            fh.write(text)
            fh.truncate()
    except (OSError, ValueError):
        pass  # nothing more can be written: the owner record makes `results show` say "aborted"


def _decided(artifact: BuildArtifact, runs: list[RunResult], expect: str | None) -> bool:
    """Adaptive repetitions: has this build seen enough (report/expectations.py: enough_runs)?"""
    if not artifact.ok:
        return bool(runs)  # every repetition of a failed build is the same INFRA
    return enough_runs(runs, expect)


def longest_first(artifacts: list[BuildArtifact], recorded: dict[str, list[RunResult]],
                  reps: Iterable[int]) -> Iterator[tuple[BuildArtifact, int]]:
    """Every build's repetition ``rep`` before any build's next one; within one repetition the
    builds whose recorded runs took longest go first (those with none yet, in matrix order, before
    them all), so that a matrix ends on its short runs rather than one slot finishing a long run
    alone. Ordered when the repetition's turn comes (a generator), from what is recorded then."""
    for rep in reps:
        def took(artifact: BuildArtifact) -> float:
            runs = recorded.get(artifact.plan.name) or []
            return -sum(r.seconds for r in runs) / len(runs) if runs else -float("inf")

        for artifact in sorted(artifacts, key=took):  # stable: ties keep the matrix's order
            yield artifact, rep


def host_info() -> HostInfo:
    """Where kvrepro runs, for the report's "what ran" (no user names, no environment)."""
    return HostInfo(hostname=platform.node(), platform=platform.platform(terse=True),
                    python=platform.python_version(), cpus=os.cpu_count() or 0)


def _create_folder(loaded: LoadedMatrix, options: MatrixOptions, plans: list[BuildPlan],
                   target_name: str) -> results.RunFolder:
    """The run's folder, with run.json saying what is about to run ("running")."""
    matrix = loaded.matrix
    bases = list(dict.fromkeys(p.base for p in plans))
    build_names = {p.build_name for p in plans}
    return results.create_run(options.results_root, loaded.text, RunInfo(
        run_id="", status="running",  # create_run gives both
        matrix=str(loaded.path),
        matrix_sha256=loaded.sha256,
        target=target_name,
        base=bases[0] if len(bases) == 1 else tuple(bases),
        bases=tuple(bases),
        repetitions=matrix.runs.count(options.repetitions, options.adaptive_max),
        adaptive=bool(options.adaptive_max),
        build_order=tuple(p.name for p in plans),
        builds={p.name: RunBuildEntry(patches=tuple(x.name for x in p.patches), base=p.base, build=p.build_name)
                for p in plans},
        expect={name: label for name, label in matrix.expect.items() if name in build_names},
        kvrepro_version=__version__,
        host=host_info(),
    ))


@contextmanager
def _interrupting(target: Target, stop: threading.Event) -> Iterator[None]:
    """While the matrix runs: once ``stop`` is set, ``target.interrupt()`` (an engine that is still
    starting gives up at once rather than at its health timeout)."""
    finished = threading.Event()

    def interrupt_on_stop() -> None:
        while not stop.wait(0.2):
            if finished.is_set():
                return
        target.interrupt()

    threading.Thread(target=interrupt_on_stop, daemon=True, name="kvrepro-interrupt").start()
    try:
        yield
    finally:
        finished.set()


def _record_end(folder: results.RunFolder, exc: BaseException) -> None:
    """run.json's status after ``exc`` ended the run. Ctrl-C is an interruption; anything else (a full
    disk, a read-only results folder) is a failure, said as such: "interrupted" would send the reader
    looking for who pressed Ctrl-C."""
    interrupted = isinstance(exc, KeyboardInterrupt)
    with stopping.deferred():  # a further Ctrl-C waits until the status is written (suite.run does the same)
        _mark_ended(folder, "interrupted" if interrupted else "failed", None if interrupted else _error_line(exc))


@dataclass
class _MatrixRun:
    """One matrix run under way: its builds, then their repetitions on the target's slots
    (:class:`~kvrepro.matrix.slots.RunSlots`), each written down the moment it exists."""

    loaded: LoadedMatrix
    options: MatrixOptions
    folder: results.RunFolder
    target: Target
    progress: Progress
    stop: threading.Event
    recorded: dict[str, list[RunResult]] = field(default_factory=dict)  # each build's runs so far

    def run(self, plans: list[BuildPlan]) -> None:
        artifacts = self._prepare(plans)
        self.recorded = {a.plan.name: [] for a in artifacts}
        if not self.stop.is_set() and not self.target.runs_remotely:
            self.target.warm_up(artifacts)  # the zygote ready before the first run, not inside its start
        jobs = max(1, self.options.jobs or self.target.max_parallel())
        slots = RunSlots(jobs, self.stop, frees_early=self.target.starts_during_stop)
        for work in self._rounds(artifacts):
            slots.run(work, self._run_cell)

    def _prepare(self, plans: list[BuildPlan]) -> list[BuildArtifact]:
        """Each build made (or found) by the target, build.json written; a failed build is recorded,
        its runs will be INFRA."""
        artifacts = []
        for plan in plans:
            if self.stop.is_set():
                break
            self.progress.stage(f"build {plan.name}: {' + '.join(p.name for p in plan.patches) or 'base'}")
            try:
                artifact = self.target.prepare(plan)
            except KvreproError as exc:
                artifact = BuildArtifact(plan=plan, ref=None, manifest={}, error=str(exc))
            results.write_json(self.folder.build_dir(plan.name) / "build.json", _build_record(artifact))
            artifacts.append(artifact)
        return artifacts

    def _rounds(self, artifacts: list[BuildArtifact]) -> Iterator[Iterable[tuple[BuildArtifact, int]]]:
        """The work, round by round (the next round is made once the last one ended)."""
        options, matrix = self.options, self.loaded.matrix
        if options.replay is not None:  # the trace's repetition number: the same engine seed
            yield ((a, options.replay.header.rep or 0) for a in artifacts)
        elif options.adaptive_max:
            # one more repetition of every undecided build per round, until each is decisive
            for rep in range(options.adaptive_max):
                pending = [a for a in artifacts
                           if not _decided(a, self.recorded[a.plan.name], matrix.expect.get(a.plan.build_name))]
                if not pending or self.stop.is_set():
                    return
                self.progress.stage(f"round {rep + 1}: {', '.join(a.plan.name for a in pending)} not decisive yet")
                yield ((a, rep) for a in pending)
        else:
            # Repetition-major order: with N parallel slots the first results cover every build.
            first = options.first_rep
            yield longest_first(artifacts, self.recorded, range(first, first + matrix.runs.count(options.repetitions)))

    def _run_cell(self, artifact: BuildArtifact, rep: int, slot_free: Callable[[], None] | None) -> None:
        """One repetition of one build, here or (a cluster) on a node; verdict.json written last."""
        if self.stop.is_set():
            return
        loaded, options, target, progress = self.loaded, self.options, self.target, self.progress
        run_dir = self.folder.rep_dir(artifact.plan.name, rep)
        rule = stop_rule_for(options, loaded.matrix.expect.get(artifact.plan.build_name))
        if target.runs_remotely:  # a cluster runs the whole run on a node and sends its files back
            result = target.run_remotely(functools.partial(run_one, stop_rule=rule), loaded, artifact, run_dir,
                                         rep, progress, self.stop, options.replay)
        else:
            result = run_one(loaded, target, artifact, run_dir, rep, progress, self.stop, options.replay, rule,
                             on_load_done=slot_free)
        results.write_json(run_dir / "verdict.json", result)
        self.recorded[artifact.plan.name].append(result)
        progress.run_finished(result)


def run_matrix(loaded: LoadedMatrix, options: MatrixOptions, progress: Progress | None = None,
               stop: threading.Event | None = None, target: Target | None = None) -> results.MatrixRun:
    """Run every build x repetition; return the run as `results.load_run` reads it back.

    ``target``: an open target to run on and leave open (a bisection probes many small matrices
    on the same base; reusing the target keeps its engine zygote warm). None: one is made for
    this matrix and closed at the end.
    """
    progress = progress or SilentProgress()
    stop = stop or threading.Event()
    target_name = options.target or loaded.matrix.target
    target_cls = get_target(target_name)
    plans = loaded.plans(options.builds, options.bases)
    folder = _create_folder(loaded, options, plans, target_name)
    owns_target = target is None
    if target is None:
        target = target_cls(loaded)
    target.on_line = progress.detail
    try:
        with _interrupting(target, stop):
            try:
                _MatrixRun(loaded, options, folder, target, progress, stop).run(plans)
                folder.update(status="interrupted" if stop.is_set() else "complete", finished=time.time())
            except BaseException as exc:
                stop.set()
                _record_end(folder, exc)
                raise
    finally:
        if owns_target:
            target.close()
    return results.load_run(options.results_root, folder.run_id)
