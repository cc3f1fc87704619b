"""Shrink a crashing or corrupting run's request trace to a small, deterministic reproducer.

``minimize(RUN, build=A, fixed=D)`` takes the trace of a repetition where A crashed with the
matrix's target signature, cuts it at the crashing request, and shrinks it:

1. **fewer requests** -- ddmin (Zeller's delta debugging) over the requests, keeping any subset
   whose sequential run still crashes A with the target signature (and cutting every candidate at
   the request it crashes at);
2. **shorter prompts** -- each prompt cut to the shortest length (in halves, then blocks, then
   tokens) that still crashes; cutting keeps the leading tokens, so prefixes stay shared;
3. **shorter outputs** -- the smallest ``max_tokens`` that still crashes.

Every candidate runs on the GPU-free engine in-process and sequentially
(:mod:`kvrepro.engine.offline`: one persistent process per build, a fresh EngineCore per
candidate), which is deterministic and takes well under a second. The result is then checked:
it must crash A the same way twice and must not crash ``fixed``; with ``confirm`` it is replayed
over HTTP against both builds (``kvrepro load replay``), the path every other run takes.

With ``emit_pytest`` the result is also written as a standalone test that drives vLLM's
scheduler directly (:mod:`kvrepro.pytest_emit`), and that test is run with each build's vLLM:
it must fail on ``build`` with the target signature and pass on ``fixed``.

A **CORRUPT** repetition (the engine served, the shadow KV caught a forward reading wrong KV) is
minimized the same way; "still fails" then means the shadow KV reports a violation of the same
kind as the run's first one (kind of KV group, and whether the request had an offload hit, e.g.
``full_attention+offload``; ``violation=`` picks another kind), and every candidate is cut at the
request of its first such violation (:func:`corruption_matches` is the one comparison). ``fixed``
must then be *clean*: no crash and no violation at all. The emitted test carries the shadow KV
(:mod:`kvrepro.engine.shadow`, inlined) and fails with the stale block in its message.

A **STALL** repetition after an injected load failure under ``kv_load_failure_policy: recompute``
(``recompute-failed-load-stall``) is not shrunk: its reproducer is one request whose blocks,
counted twice, exceed the free pool. With ``emit_pytest`` the upstream test is written with the
run's numbers (kvrepro/minimize/upstream_emit.py) and run with vLLM's own pytest in the release's
sdist ``tests/`` on the build and on the build plus ``fixed`` (a patch declared in the matrix, e.g.
``fix-recompute-failed-load-reservation``, or a build on the same release).

``build`` and ``fixed`` name a build of the matrix, or a cell ``<build>@<release>``: that build's
patch stack on another vLLM release (e.g. ``--fixed X@0.30.0`` for a build ``X: []``), as
``matrix run --base`` would build it (:func:`resolve_plan`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import lifetime, scratch
from ..results import store as results
from ..errors import InfraError, KvreproError, SpecError
from ..loadgen.trace import Trace, TraceRequest, read_trace, write_trace
from ..classify import is_target_crash
from ..records import Signature, to_jsonable
from ..spec.records import BuildPlan
from ..spec.matrix import LoadedMatrix, TargetSignature, expected_defects


@dataclass(frozen=True)
class OfflineResult:
    """One job's answer from the offline engine (kvrepro/engine/offline.py ``run_job``), parsed once
    where its JSON line comes in (:meth:`from_json`).

    ``kv_records``: the shadow KV's violation records (kvrepro/engine/shadow.py) as it wrote them,
    each with ``request_index`` added: ``kind``, ``class``, ``text``, ... (read by
    :func:`corruption_matches`). ``kv_checks`` None: the shadow KV did not run."""

    crashed: bool = False
    crash_at: int | None = None
    requests_done: int = 0
    exception: str | None = None
    function: str | None = None
    file: str | None = None
    statement: str | None = None
    message: str | None = None
    trigger_calls: int = 0
    external_hit_calls: int = 0
    kv_checks: int | None = None
    kv_violations: int = 0
    kv_violations_by: dict[str, int] = field(default_factory=dict)
    kv_records: tuple[dict[str, Any], ...] = ()
    kv_copied: int = 0  # GPU blocks the scheduler's copy-on-write copies filled (shadow KV)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "OfflineResult":
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in value.items() if k in names and v is not None}
        if "kv_records" in known:
            known["kv_records"] = tuple(known["kv_records"])
        if "kv_violations_by" in known:
            known["kv_violations_by"] = dict(known["kv_violations_by"])
        return cls(**known)


class OfflineEngine:
    """One ``python -m kvrepro.engine.offline -`` process for one build: jobs in, results out."""

    def __init__(self, loaded: LoadedMatrix, build: str, rep: int):
        from ..deploy.sim import SimTarget

        self.target = SimTarget(loaded)
        plan = resolve_plan(loaded, build)
        artifact = self.target.prepare(plan)
        if not artifact.ok:
            raise InfraError(f"build {build} failed: {artifact.error}")
        self.overlay = artifact.ref
        # fs offload tiers (kvrepro/spec/fs_tier.py) in a folder of this engine's, emptied before each
        # job by the offline engine: a candidate must not hit the files an earlier candidate stored
        # (every replay read as CORRUPT from the second on, the shadow KV never saw those stores)
        self.fs_root: str | None = None
        if loaded.matrix.engine.fs_tiers():
            from .. import scratch
            from ..spec.fs_tier import folders

            self.fs_root = tempfile.mkdtemp(prefix="offline-fs-", dir=scratch.folder())
            for name in folders(loaded.matrix.engine.extra_args):
                os.mkdir(os.path.join(self.fs_root, name))
        args = loaded.matrix.engine.serve_args(str(loaded.model_dir()), include_sim=True, fs_tier_root=self.fs_root)
        # forked from the shared zygote when there is one (tests): torch & co. are imported there already
        env = self.target.environment(artifact, rep, self.target.shared_zygote_socket(plan.base))
        env["VLLM_LOGGING_LEVEL"] = "ERROR"
        if self.fs_root is not None:
            env["KVREPRO_OFFLINE_FS_ROOT"] = self.fs_root
        runtime = self.target.runtime(plan.base)
        self.command = [str(runtime.python), "-m", "kvrepro.engine.offline", "-", *args]
        # a standalone test needs the build's vLLM and the runtime's packages, not kvrepro
        self.test_pythonpath = runtime.pythonpath(artifact.ref or "")
        self.env = env
        # SIGKILL when kvrepro dies, whatever kills it: the oracle holds nothing worth saving
        self.proc = subprocess.Popen(self.command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True,
                                     preexec_fn=lifetime.child_hook(signal.SIGKILL))
        self._lock = threading.Lock()
        self._busy = True  # starting: a stop now kills it
        try:
            first = self.proc.stdout.readline()
        except BaseException:
            self.close()
            raise
        self._busy = False
        if not first.strip().startswith('{"ready"'):
            self.close()
            raise InfraError(f"the offline engine for build {build} did not start (run "
                             f"`{' '.join(self.command[:4])} ...` by hand to see why)")
        # the settings and KV-cache groups vLLM built (kvrepro.engine.offline.describe)
        from .pytest_emit import EngineInfo

        self.engine_info = EngineInfo.from_json(json.loads(first).get("engine") or {})

    def run(self, job: list[TraceRequest]) -> OfflineResult:
        line = json.dumps([{"tokens": list(r.tokens), "max_tokens": r.max_tokens,
                            **({"events": to_jsonable(r.events)} if r.events is not None and r.events.any() else {})}
                           for r in job])
        with self._lock:
            self._busy = True
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
            self._busy = False
        if not answer:
            raise InfraError("the offline engine process died")
        return OfflineResult.from_json(json.loads(answer))

    def close(self) -> None:
        try:
            self._close_engine()
        finally:
            if self.fs_root is not None:
                shutil.rmtree(self.fs_root, ignore_errors=True)

    def _close_engine(self) -> None:
        if self.proc.poll() is None and self._busy:
            # stopped mid-candidate (Ctrl-C, SIGTERM): it would run on to the end of the job
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        scratch.release_regions()  # a SIGKILLed oracle's /dev/shm region (kvrepro/engine/shm_region.py)
        self.target.close()


def matches(result: OfflineResult, sig: TargetSignature) -> bool:
    """Whether an offline result is the target crash (:func:`kvrepro.classify.is_target_crash`
    on its exception, function, file and statement)."""
    return result.crashed and is_target_crash(_signature(result.exception, result.function, result.file,
                                                         result.statement), sig)


def _signature(exception: str | None, function: str | None, file: str | None, statement: str | None) -> Signature:
    """A crash seen outside the classifier (an offline replay, an emitted test) as its Signature."""
    return Signature(exception=exception or "", function=function or "", file=str(file or ""), line=None,
                     expression=statement or "")


def resolve_plan(loaded: LoadedMatrix, name: str) -> BuildPlan:
    """The plan of ``name``: a build of the matrix (on its first base), a cell ``<build>@<release>``
    of a matrix that lists several bases, or any build's stack on another release (``X@0.30.0``)."""
    cells = {plan.name: plan for plan in loaded.plans()}
    if name in cells:
        return cells[name]
    build, at, release = name.partition("@")
    if at and build in loaded.matrix.builds:
        if not re.fullmatch(r"\d+\.\d+(\.\d+)?\S*", release):
            raise SpecError(f"{name!r}: {release!r} must be a vLLM release version such as 0.30.0")
        return loaded.plans([build], [release])[0]
    if not at and name in loaded.matrix.builds:  # several bases: the build on the first one
        return loaded.plans([name])[0]
    known = ", ".join(cells)
    raise SpecError(f"unknown build {name!r}; {loaded.path} defines {known} "
                    f"(or write <build>@<release>, e.g. {next(iter(loaded.matrix.builds))}@0.30.0)")


# the kinds of KV group the shadow KV names (kvrepro/engine/shadow.py, Group.kind)
VIOLATION_GROUP_KINDS = ("full_attention", "sliding_window", "mamba", "other")
_VIOLATION_GROUP = re.compile(r"\bgroup \d+ \((?P<kind>\w+)\)")


def violation_kind(text: str | None) -> str | None:
    """``full_attention+offload`` from a shadow-KV violation line (kvrepro/engine/shadow.py words
    it: ``request R group G (<kind>) block index J ... (request had offload hit)``)."""
    m = _VIOLATION_GROUP.search(text or "")
    if m is None:
        return None
    return m["kind"] + ("+offload" if "(request had offload hit)" in (text or "") else "")


def kind_count(violations_by: dict[str, int], kind: str) -> int:
    """Violations of one kind (``full_attention+offload``) in a shadow-KV count by class
    (``full_attention+offload/foreign/hit``; older runs counted by kind alone); ``kind`` may also
    be a defect name (``fa-hole-below-boundary``): the classes attributed to that defect."""
    if _is_defect(kind):
        from ..classify.corruption import attribute

        return attribute(violations_by or {}).get(kind, 0)
    return sum(n for key, n in (violations_by or {}).items() if key.split("/", 1)[0] == kind)


def _is_defect(name: str) -> bool:
    """Whether ``name`` is a known corruption defect (kvrepro/classify/corruptions/), not a kind."""
    from ..classify.corruption import by_name

    return by_name(name) is not None


def corruption_matches(record: dict[str, Any], want: str) -> bool:
    """Whether one shadow-KV violation (an offline ``kv_records`` entry) is the corruption being
    minimized: the same kind of KV group and offload-hit flag (``full_attention+offload``), or,
    when ``want`` names a known defect (``fa-hole-below-boundary``), a class attributed to it."""
    if _is_defect(want):
        from ..classify.corruption import match_class

        found = match_class(str(record.get("class") or record.get("kind") or ""))
        return found is not None and found.name == want
    return record.get("kind") == want


@dataclass(frozen=True)
class Failure:
    """What "still fails" means for a candidate: the target crash, or (``violation`` set) a
    shadow-KV violation that :func:`corruption_matches` the one being minimized."""

    sig: TargetSignature
    violation: str | None = None

    @property
    def label(self) -> str:
        return "CORRUPT" if self.violation else "CRASH(target)"

    def at(self, result: OfflineResult) -> int | None:
        """The index of the request at which ``result`` fails this way (None: it does not). A
        corruption counts only before any crash: the candidate is then cut before the crash."""
        if not self.violation:
            return result.crash_at if matches(result, self.sig) else None
        for record in result.kv_records:
            at = record.get("request_index")
            if at is None or not corruption_matches(record, self.violation):
                continue
            if result.crashed and result.crash_at is not None and at >= result.crash_at:
                return None
            return at
        return None

    def clean(self, result: OfflineResult) -> bool:
        """What a fixed build must show: no crash; for a corruption, no violation of any kind
        either (and the shadow KV did check)."""
        if not self.violation:
            return not result.crashed
        return not result.crashed and not result.kv_violations and bool(result.kv_checks)

    def describe(self, result: OfflineResult) -> str:
        """One build's offline result, in words."""
        if matches(result, self.sig):
            return "CRASH(target)"
        if result.crashed:
            return f"CRASH({result.exception} in {result.function})"
        if result.kv_violations:
            by = ", ".join(f"{k} {n}" for k, n in sorted(result.kv_violations_by.items()))
            return f"CORRUPT ({result.kv_violations} violations: {by}; {result.trigger_calls} trigger calls)"
        if self.violation:
            return (f"clean (no crash, no KV violation in {result.kv_checks or 0} checked contexts; "
                    f"{result.trigger_calls} trigger calls)")
        return f"no crash ({result.trigger_calls} trigger calls)"


def ddmin(items: list[TraceRequest], crashes: Callable[[list[TraceRequest]], list[TraceRequest] | None],
          on_line: Callable[[str], None] = lambda _: None) -> list[TraceRequest]:
    """Delta debugging: a 1-minimal sublist for which ``crashes`` holds. ``crashes`` returns the
    candidate cut at its crashing request (or None), so every accepted step also drops the tail."""
    n = 2
    while len(items) >= 2:
        size = len(items)
        bounds = [size * i // n for i in range(n + 1)]
        chunks = [items[bounds[i]:bounds[i + 1]] for i in range(n)]
        candidates = chunks + ([items[:bounds[i]] + items[bounds[i + 1]:] for i in range(n)] if n > 2 else [])
        for pos, candidate in enumerate(candidates):
            if not candidate:
                continue
            kept = crashes(candidate)
            if kept is not None:
                items = kept
                n = 2 if pos < len(chunks) else max(n - 1, 2)
                on_line(f"ddmin: {len(items)} requests")
                break
        else:
            if n >= size:
                break
            n = min(size, 2 * n)
    return items


def _shorten_prompts(items: list[TraceRequest], crashes, block: int) -> list[TraceRequest]:
    items = list(items)
    for i in range(len(items)):
        length = len(items[i].tokens)
        tried: set[int] = set()
        while True:
            options = sorted({max(1, length // 2), max(1, length - length // 4), max(1, (length - 1) // block * block),
                              max(1, length - 1)} - tried - {length})
            improved = False
            for new in options:
                tried.add(new)
                candidate = items[:i] + [TraceRequest(**{**items[i].__dict__, "tokens": items[i].tokens[:new]})] + items[i + 1:]
                kept = crashes(candidate)
                if kept is not None and len(kept) == len(items):
                    items, length, improved = kept, new, True
                    break
            if not improved:
                break
    return items


def _shorten_outputs(items: list[TraceRequest], crashes) -> list[TraceRequest]:
    for max_tokens in (1, 2, 4):
        if max_tokens >= max(r.max_tokens for r in items):
            break
        # a request a queued abort rides along with keeps its length: over HTTP its running time is
        # what keeps the rider waiting until the client drops it (docs/load.md)
        carries = {i for i in range(len(items) - 1)
                   if items[i + 1].events is not None and items[i + 1].events.abort == "queued"}
        candidate = [r if i in carries else TraceRequest(**{**r.__dict__, "max_tokens": min(r.max_tokens, max_tokens)})
                     for i, r in enumerate(items)]
        kept = crashes(candidate)
        if kept is not None and len(kept) == len(items):
            return kept
    return items


def find_crash(root: Path, run_id: str, build: str, rep: int | None, violation: str | None = None,
               target: TargetSignature | None = None):
    """The first repetition of ``build`` (or repetition ``rep``) that crashed with the target
    signature or was CORRUPT, and its trace. With ``violation`` (a kind of shadow-KV violation,
    ``full_attention+offload``): the first whose shadow KV counted that kind, whatever its verdict.
    ``target``: the signature to minimize when it is not the one the run was judged by (kvrepro
    explore's finding of another crash: the run says CRASH(other), its signature is the finding's)."""
    run = results.load_run(root, run_id)
    found = run.build(build)
    runs = list(found.runs) if found is not None else []
    if not runs:
        raise SpecError(f"run {run.run_id} has no repetitions of build {build}")
    def minimizable(r) -> bool:
        if violation is not None:
            return bool(kind_count(r.kv_violations_by, violation))
        if target is not None and r.label.startswith("CRASH") and is_target_crash(r.signature, target):
            return True
        return r.label in ("CRASH(target)", "CORRUPT")

    what = f"had a {violation} violation" if violation else "crashed with the target signature or were CORRUPT"
    found_reps = [r.rep for r in runs if minimizable(r)]
    hint = (f"; repetitions that {what}: {', '.join(map(str, found_reps))}" if found_reps
            else f"; none of its repetitions {what}")
    if rep is not None:
        chosen = [r for r in runs if r.rep == rep]
        if not chosen:
            raise SpecError(f"--rep {rep}: run {run.run_id} has no repetition {rep} of build {build} (it has "
                            f"{', '.join(str(r.rep) for r in runs)}){hint}")
        if not minimizable(chosen[0]):
            raise SpecError(f"--rep {rep}: repetition {rep} of build {build} in run {run.run_id} is "
                            f"{chosen[0].label}: only a target crash or a corruption can be minimized{hint}")
    for r in runs:
        if rep is not None and r.rep != rep:
            continue
        if minimizable(r):
            # the repetition's folder inside this run (minimized.* is written next to its trace),
            # not the path verdict.json recorded: a copied or edited results folder must not
            # send the output elsewhere
            trace = results.inside(run.path, run.path / found.name / str(r.rep)) / "trace.jsonl"
            if not trace.is_file():
                raise SpecError(f"{trace}: missing; runs record their trace since kvrepro wrote trace.jsonl")
            return r, trace
    if violation is not None:
        seen = "; ".join(f"rep {r.rep}: " + (", ".join(f"{k} {n}" for k, n in sorted(r.kv_violations_by.items()))
                                             or "none") for r in runs)
        raise SpecError(f"no repetition of build {build} in run {run.run_id} had a {violation} violation "
                        f"(violations by kind: {seen})")
    raise SpecError(f"no repetition of build {build} in run {run.run_id} crashed with the target "
                    f"signature or was CORRUPT (verdicts: {', '.join(r.label for r in runs)})")


@dataclass(frozen=True)
class PytestCheck:
    """The emitted test run with one build's vLLM: ``ok`` None when it was not run (another release's API)."""

    ok: bool | None
    result: str
    exit: int | None
    message: str | None = None  # the shadow KV's assertion message, when a corruption test failed

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {"ok": self.ok, "result": self.result, "exit": self.exit}
        if self.message is not None:
            data["message"] = self.message
        return data


@dataclass(frozen=True)
class EmittedTest:
    """The scheduler-level test written by ``--emit-pytest`` and what it did with each build."""

    pytest: str
    pytest_check: dict[str, PytestCheck]


@dataclass
class MinimizeResult:
    """What `kvrepro minimize` found (also written to ``minimized.json`` beside the trace).

    ``crash_at`` is the crash's request (None for a corruption, whose request is
    ``violation_at``); ``fixed_result`` what ``--fixed`` did with the result; ``confirmed`` the
    replays over HTTP; ``ok`` whether everything held (deterministic, fixed clean, tests, replays).
    """

    trace: str
    source: str
    build: str
    fixed: str | None
    requests_before: int
    requests: int
    tokens_before: int
    tokens: int
    crash_at: int | None
    deterministic: bool
    fixed_result: str | None
    candidates_run: int
    failure: str
    violation: str | None
    violation_at: int | None = None
    first_violation: str | None = None
    violation_kind: str | None = None
    violation_class: str | None = None
    violations_by: dict[str, int] = field(default_factory=dict)
    emitted: EmittedTest | None = None
    confirmed: list[str] = field(default_factory=list)
    ok: bool = False

    @property
    def pytest(self) -> str | None:
        return self.emitted.pytest if self.emitted is not None else None

    @property
    def pytest_check(self) -> dict[str, PytestCheck]:
        return self.emitted.pytest_check if self.emitted is not None else {}

    def to_json(self) -> dict[str, object]:
        """The form ``minimized.json`` and ``--json`` have always had (violation and pytest keys only when set)."""
        data: dict[str, object] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                   if f.name not in ("emitted", "violation_at", "first_violation", "violation_kind",
                                                     "violation_class", "violations_by", "confirmed", "ok")}
        if self.violation:
            data.update(violation_at=self.violation_at, first_violation=self.first_violation,
                        violation_kind=self.violation_kind, violation_class=self.violation_class,
                        violations_by=dict(self.violations_by))
        if self.emitted is not None:
            data.update(pytest=self.emitted.pytest,
                        pytest_check={name: c.to_json() for name, c in self.emitted.pytest_check.items()})
        data.update(confirmed=list(self.confirmed), ok=self.ok)
        return data


def minimize(loaded: LoadedMatrix, root: Path, run_id: str, build: str, *, fixed: str | None = None,
             rep: int | None = None, emit_pytest: Path | None = None, confirm: bool = True,
             violation: str | None = None,
             on_line: Callable[[str], None] = lambda _: None) -> MinimizeResult:
    for name in [build] + ([fixed] if fixed and not _is_patch_only(loaded, fixed) else []):
        resolve_plan(loaded, name)
    _check_violation_option(violation)
    stalled = _stalled_repetition(root, run_id, build, rep) if violation is None else None
    if stalled is not None:
        return _report_stall(loaded, build, fixed, stalled, emit_pytest, on_line)
    sig = loaded.matrix.target_signature
    run, trace_path = find_crash(root, run_id, build, rep, violation, sig)
    trace = read_trace(trace_path)
    if violation is None and run.label == "CORRUPT":
        violation = _violation_of(loaded, build, run)
    failure = Failure(sig, violation)
    rep_number = trace.header.rep if trace.header.rep is not None else run.rep
    on_line(f"starting the offline engine for build {build}")
    engine = OfflineEngine(loaded, build, rep_number)
    fixed_engine = None
    original = list(trace.requests)
    try:
        shrunk = _Shrink(engine, failure)
        items = shrunk.shortest(original, trace_path, build, violation, loaded.matrix.engine.block_size, on_line)
        # deterministic: the same verdict at the same request, twice more
        again = [engine.run(items) for _ in range(2)]
        deterministic = all(failure.at(r) == len(items) - 1 for r in again)
        fixed_result = None
        fixed_clean = True
        if fixed:
            on_line(f"checking build {fixed}")
            fixed_engine = OfflineEngine(loaded, fixed, rep_number)
            got = fixed_engine.run(items)
            fixed_result, fixed_clean = failure.describe(got), failure.clean(got)
    finally:
        engine.close()
        if fixed_engine is not None:
            fixed_engine.close()

    minimized = Trace(trace_path, trace.header.updated(minimized_from=str(trace_path),
                                                       load={**(trace.header.load or {}), "concurrency": 1}), items)
    out_path = trace_path.with_name("minimized.trace.jsonl")
    write_trace(out_path, minimized)
    summary = MinimizeResult(
        trace=str(out_path), source=str(trace_path), build=build, fixed=fixed,
        requests_before=len(original), requests=len(items),
        tokens_before=sum(len(r.tokens) for r in original), tokens=sum(len(r.tokens) for r in items),
        crash_at=None if violation else len(items) - 1, deterministic=deterministic, fixed_result=fixed_result,
        candidates_run=shrunk.runs, failure=failure.label, violation=violation,
    )
    if violation:
        # the offline engine's answer (its own JSON protocol, kvrepro.engine.offline)
        first = next((r for r in again[0].kv_records if corruption_matches(r, violation)), {})
        summary.violation_at, summary.first_violation = first.get("request_index"), first.get("text")
        summary.violation_kind, summary.violation_class = first.get("kind"), first.get("class")
        summary.violations_by = dict(again[0].kv_violations_by)
    if emit_pytest is not None:
        # the emitted test names violations by kind: a defect name is checked through its first one's
        summary.emitted = _emit_and_check(Path(emit_pytest), minimized, loaded, build, engine, fixed, fixed_engine,
                                          on_line, summary.violation_kind or violation, summary.first_violation)
    confirmed_ok = True
    if confirm:
        summary.confirmed, confirmed_ok = _confirm(loaded, out_path, root, [build] + ([fixed] if fixed else []),
                                                   on_line, violation)
    ok = deterministic and (fixed is None or fixed_clean)
    ok = ok and all(c.ok is not False for c in summary.pytest_check.values())
    summary.ok = ok and confirmed_ok and all("error" not in c for c in summary.confirmed)
    results.write_json(trace_path.with_name("minimized.json"), summary.to_json())
    return summary


def _check_violation_option(violation: str | None) -> None:
    """``--violation``: a kind of KV group (optionally +offload) or a catalogued defect's name."""
    if (violation is not None and violation.removesuffix("+offload") not in VIOLATION_GROUP_KINDS
            and not _is_defect(violation)):
        from ..classify.corruption import known_corruptions

        raise SpecError(f"--violation {violation!r}: a kind of KV group, optionally +offload "
                        f"(e.g. full_attention+offload, mamba), or a defect name "
                        f"({', '.join(c.name for c in known_corruptions())})")


def _violation_of(loaded: LoadedMatrix, build: str, run: Any) -> str:
    """Which wrong read a CORRUPT run is minimized for: the defect the build's `expect:` names (B:
    the boundary fix's hole, not the Mamba null-state read every 0.26.0 build shares), else the
    one the run showed most; a run whose violations no signature knows: its first one's kind."""
    expect = loaded.matrix.expect.get(resolve_plan(loaded, build).build_name, "")
    wanted = [d for alt in expect.split("|") for d in expected_defects(alt) if run.kv_defects.get(d)]
    named = [name for name in run.kv_defects if _is_defect(name)]
    violation = (wanted[0] if wanted else max(named, key=lambda name: run.kv_defects[name]) if named
                 else violation_kind(run.kv_first_violation))
    if violation is None:
        raise KvreproError(f"{run.run_dir}: CORRUPT, but its first violation does not say which KV group "
                           f"({run.kv_first_violation!r}); name one with --violation KIND")
    return violation


class _Shrink:
    """The shrinking itself: ddmin over the requests, then shorter prompts and outputs, each
    candidate replayed on the offline engine and kept when it still fails the same way (cut at
    the failing request). ``runs`` counts the candidates replayed."""

    def __init__(self, engine: OfflineEngine, failure: Failure) -> None:
        self.engine, self.failure, self.runs = engine, failure, 0

    def fails(self, candidate: list[TraceRequest]) -> list[TraceRequest] | None:
        self.runs += 1
        at = self.failure.at(self.engine.run(candidate))
        return None if at is None else candidate[:at + 1]

    def shortest(self, original: list[TraceRequest], trace_path: Path, build: str, violation: str | None,
                 block_size: int, on_line: Callable[[str], None]) -> list[TraceRequest]:
        start = self.fails(original)
        if start is None:
            what = (f"make build {build} read wrong KV ({violation} violation)" if violation
                    else f"crash build {build} with the target signature")
            raise KvreproError(
                f"{trace_path}: sent one request at a time, the trace does not {what} "
                f"(the run was concurrent: load.concurrency > 1 interleaves "
                f"requests differently); record the run with load.concurrency: 1 to minimize it")
        on_line(f"{'crashes' if not violation else f'{violation} violation'} at request {len(start) - 1}; "
                f"ddmin over {len(start)} requests")
        items = ddmin(start, self.fails, on_line)
        on_line(f"shortening {len(items)} prompts")
        items = _shorten_prompts(items, self.fails, block_size)
        return _shorten_outputs(items, self.fails)


def _is_patch_only(loaded: LoadedMatrix, name: str) -> bool:
    """``--fixed`` names a declared patch (for a stall: the build's stack plus it), not a build."""
    return name in loaded.matrix.patches and name.partition("@")[0] not in loaded.matrix.builds


def _stalled_repetition(root: Path, run_id: str, build: str, rep: int | None) -> Path | None:
    """The folder of the STALL repetition to report: repetition ``rep`` when it stalled, else (no
    ``rep``) the first that stalled when none crashed with the target signature or was CORRUPT."""
    run = results.load_run(root, run_id)
    found = run.build(build)
    runs = list(found.runs) if found is not None else []
    if rep is not None:
        chosen = [r for r in runs if r.rep == rep and r.label == "STALL"]
    elif any(r.label in ("CRASH(target)", "CORRUPT") for r in runs):
        return None
    else:
        chosen = [r for r in runs if r.label == "STALL"][:1]
    if not chosen or found is None:
        return None
    return results.inside(run.path, run.path / found.name / str(chosen[0].rep))


def _report_stall(loaded: LoadedMatrix, build: str, fixed: str | None, rep_dir: Path, emit_pytest: Path | None,
                  on_line: Callable[[str], None]) -> MinimizeResult:
    """A STALL after a failed offload load (``recompute-failed-load-stall``): no shrinking (its
    reproducer is one request over half the pool), the upstream test written with the run's numbers
    and run with vLLM's pytest on the build and on the build + ``fixed`` (a declared patch, or a
    build on the same release). See kvrepro/minimize/upstream_emit.py."""
    from ..builds import overlay
    from ..builds.standalone_test import run_standalone
    from . import upstream_emit

    if emit_pytest is None:
        raise SpecError(f"{rep_dir}: a STALL is reported as a scheduler test, not a shorter trace; give "
                        "--emit-pytest FILE (and --fixed PATCH-or-BUILD to check the proposed fix)")
    plan = resolve_plan(loaded, build)
    on_line(f"building {build} to read its scheduler")
    artifact = overlay.build_release_overlay(plan, on_line)
    if not artifact.ok:
        raise InfraError(f"build {build} failed: {artifact.error}")
    source = (Path(artifact.ref or "") / upstream_emit.SCHEDULER).read_text()
    engine = loaded.matrix.engine
    case = upstream_emit.stall_case(rep_dir, plan.base, source, engine.block_size, engine.sim.num_gpu_blocks)
    path = Path(emit_pytest)
    upstream_emit.emit_stall_test(path, case)
    stacks = [(f"build {build}", plan.patches)]
    if fixed:
        if _is_patch_only(loaded, fixed):
            fixed_patches = (*plan.patches, loaded.patch_ref(fixed))
        else:
            other = resolve_plan(loaded, fixed)
            if other.base != plan.base:
                raise SpecError(f"--fixed {fixed}: on vLLM {other.base}, the stall is on {plan.base}; name a patch "
                                f"or a build on {plan.base}")
            fixed_patches = other.patches
        stacks.append((f"build {build} + {fixed}" if _is_patch_only(loaded, fixed) else f"build {fixed}",
                       fixed_patches))
    runs = run_standalone(plan.base, path, upstream_emit.UPSTREAM_PATH, stacks, rep_dir / "upstream-test", on_line)
    check: dict[str, PytestCheck] = {}
    fixed_name = (f"{build}+{fixed}" if fixed and _is_patch_only(loaded, fixed) else fixed) or ""
    for n, run in enumerate(runs):
        name = build if n == 0 else fixed_name
        failing = [o for o in run.failed if upstream_emit.FAILING_CASE in o.nodeid]
        if n == 0:
            ok = bool(failing) and upstream_emit.STALL_WORDS in failing[0].message
            result = (f"fails ({upstream_emit.FAILING_CASE}): {failing[0].message[:600]}" if failing else
                      "passes: the scheduler admitted the retry (no stall on this build)")
        else:
            ok = bool(run.outcomes) and not run.failed
            result = "passes" if ok else "; ".join(f"{o.nodeid.split('::')[-1]} {o.outcome}: {o.message[:300]}"
                                                   for o in run.failed) or "no test ran"
        check[name] = PytestCheck(ok=ok, result=result, exit=0 if not run.failed else 1,
                                  message=failing[0].message[:4000] if n == 0 and failing else None)
    summary = MinimizeResult(
        trace=str(rep_dir / "trace.jsonl"), source=str(rep_dir / "trace.jsonl"), build=build, fixed=fixed,
        requests_before=case.request_index + 1, requests=1, tokens_before=case.prompt_tokens,
        tokens=case.prompt_tokens, crash_at=None, deterministic=True, fixed_result=check[fixed_name].result
        if fixed else None, candidates_run=0, failure="stall", violation=None,
        emitted=EmittedTest(pytest=str(path), pytest_check=check))
    summary.confirmed = [f"the run's stall: request {case.request_index} ({case.prompt_tokens} prompt tokens) after "
                         f"its failed load, {case.num_blocks}-block pool ({rep_dir})"]
    summary.ok = all(c.ok for c in check.values())
    results.write_json(rep_dir / "minimized.json", summary.to_json())
    return summary


def _emit_and_check(path: Path, trace: Trace, loaded: LoadedMatrix, build: str, engine: OfflineEngine,
                    fixed: str | None, fixed_engine: OfflineEngine | None,
                    on_line: Callable[[str], None], violation: str | None = None,
                    first_violation: str | None = None) -> EmittedTest:
    """Write the scheduler-level test and run it with each build's vLLM: it must fail on
    ``build`` with the target signature (a corruption: with the shadow KV's assertion naming a
    ``violation`` of that kind) and pass on ``fixed``."""
    from .pytest_emit import corruption_marker, emit, run_emitted

    sig = loaded.matrix.target_signature
    engines = {build: engine, **({fixed: fixed_engine} if fixed and fixed_engine is not None else {})}
    runs = {name: (e.command[0], e.test_pythonpath,
                   f"build {name}: " + ("fails (the bug)" if name == build else "passes (fixed)"))
            for name, e in engines.items()}
    emit(path, trace, loaded, engine.engine_info, runs, violation=violation, first_violation=first_violation)
    check: dict[str, PytestCheck] = {}
    base = resolve_plan(loaded, build).base
    for name, e in engines.items():
        other = resolve_plan(loaded, name).base
        if other != base:
            # the test is written against the failing build's vLLM: its KVCacheConfig, Scheduler and
            # connector APIs (0.30 changed KVCacheTensor, for one); the oracle and the replay still judge
            check[name] = PytestCheck(ok=None, exit=None,
                                      result=f"not run: the test is written for vLLM {base}'s API, build {name} is on {other}")
            continue
        on_line(f"running the emitted test with build {name}'s vLLM")
        got = run_emitted(path, e.command[0], e.test_pythonpath)
        if violation:
            target = (got.exit != 0 and got.exception == "AssertionError"
                      and corruption_marker(violation) in got.output)
            expected = f"the shadow KV's assertion on a {violation} violation"
        else:
            # the statement pytest shows is one line of it: not compared (the replay compared it)
            target = got.exit != 0 and is_target_crash(
                _signature(got.exception, got.function, got.file, got.statement), sig, statement_known=False)
            expected = "the target signature"
        if name == build:
            ok, seen = target, (f"fails with {expected}" if target else
                                f"exit {got.exit}, not {expected}: {got.tail[-300:]}")
            if target and violation:  # the assertion's line for this kind: the stale block, in words
                marker = corruption_marker(violation)
                seen += ": " + next((x for x in got.message.splitlines() if x.startswith(marker)), "")
        else:
            ok = got.exit == 0
            seen = "passes" if ok else f"exit {got.exit}: {got.tail[-300:]}"
        check[name] = PytestCheck(ok=ok, result=seen, exit=got.exit,
                                  message=got.message[:4000] if violation and got.exit != 0 else None)
    return EmittedTest(pytest=str(path), pytest_check=check)


def _confirm(loaded: LoadedMatrix, trace_path: Path, root: Path, builds: list[str],
             on_line: Callable[[str], None], violation: str | None = None) -> tuple[list[str], bool]:
    """Replay the minimized trace over HTTP on each build (the path `kvrepro load replay` takes).
    For a corruption, ok means: the first build CORRUPT with a ``violation``-kind violation, the
    others clean (neither a crash nor CORRUPT). A crash's replay is reported, not judged."""
    from ..matrix.runner import MatrixOptions, run_matrix

    lines = []
    ok = True
    trace = read_trace(trace_path)
    for n, name in enumerate(builds):
        on_line(f"replaying the minimized trace on build {name} over HTTP")
        plan = resolve_plan(loaded, name)
        options = MatrixOptions(target="sim", builds=[plan.build_name], bases=[plan.base], repetitions=1,
                                results_root=root, jobs=1, replay=trace)
        r = run_matrix(loaded, options).build(plan.build_name).runs[0]
        at = r.load.first_failed_index if r.load else None
        line = (f"{name}: {r.label}" + (f" at request {at}" if at is not None else "")
                + f", trigger count {r.trigger_count}, bug state {r.state_count}")
        if violation:
            by = ", ".join(f"{k} {v}" for k, v in sorted(r.kv_violations_by.items())) or "none"
            line += f", KV {r.kv_check} (violations: {by})"
            good = ((r.label == "CORRUPT" and bool(kind_count(r.kv_violations_by, violation))) if n == 0
                    else r.label != "CORRUPT" and not r.label.startswith("CRASH") and r.kv_check == "ok")
            ok = ok and good
            line += "" if good else " -- not as expected"
        lines.append(line + f" ({r.run_dir})")
    return lines, ok
