"""Shrink a crashing run's request trace to a small, deterministic reproducer.

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
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import results
from .errors import InfraError, KvreproError, SpecError
from .loadgen.trace import Trace, TraceRequest, read_trace, write_trace
from .spec import LoadedMatrix, TargetSignature


class OfflineEngine:
    """One ``python -m kvrepro.engine.offline -`` process for one build: jobs in, results out."""

    def __init__(self, loaded: LoadedMatrix, build: str, rep: int):
        from .deploy.sim import SimTarget

        self.target = SimTarget(loaded)
        plan = loaded.plans([build])[0]
        artifact = self.target.prepare(plan)
        if not artifact.ok:
            raise InfraError(f"build {build} failed: {artifact.error}")
        self.overlay = artifact.ref
        args = loaded.matrix.engine.serve_args(str(loaded.model_dir()), include_sim=True)
        env = self.target.environment(artifact, rep)
        env["VLLM_LOGGING_LEVEL"] = "ERROR"
        runtime = self.target.runtime(plan.base)
        self.command = [str(runtime.python), "-m", "kvrepro.engine.offline", "-", *args]
        # a standalone test needs the build's vLLM and the runtime's packages, not kvrepro
        self.test_pythonpath = runtime.pythonpath(artifact.ref or "")
        self.env = env
        self.proc = subprocess.Popen(self.command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True)
        self._lock = threading.Lock()
        first = self.proc.stdout.readline()
        if not first.strip().startswith('{"ready"'):
            self.close()
            raise InfraError(f"the offline engine for build {build} did not start (run "
                             f"`{' '.join(self.command[:4])} ...` by hand to see why)")
        # the settings and KV-cache groups vLLM built (kvrepro.engine.offline.describe)
        self.engine_info: dict[str, Any] = json.loads(first).get("engine") or {}

    def run(self, job: list[TraceRequest]) -> dict[str, Any]:
        line = json.dumps([{"tokens": list(r.tokens), "max_tokens": r.max_tokens} for r in job])
        with self._lock:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        if not answer:
            raise InfraError("the offline engine process died")
        return json.loads(answer)

    def close(self) -> None:
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
        self.target.close()


def matches(result: dict[str, Any], sig: TargetSignature) -> bool:
    """Whether an offline result is the target crash (exception, function, file, statement)."""
    if not result.get("crashed"):
        return False
    if result.get("exception") != sig.exception or result.get("function") != sig.function:
        return False
    if sig.file and not str(result.get("file") or "").endswith(sig.file):
        return False
    if sig.expression:
        squash = lambda t: "".join(str(t or "").split())  # noqa: E731
        if squash(sig.expression) not in squash(result.get("statement")):
            return False
    return True


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
        candidate = [TraceRequest(**{**r.__dict__, "max_tokens": min(r.max_tokens, max_tokens)}) for r in items]
        kept = crashes(candidate)
        if kept is not None and len(kept) == len(items):
            return kept
    return items


def find_crash(root: Path, run_id: str, build: str, rep: int | None):
    """The first repetition of ``build`` (or repetition ``rep``) that crashed with the target
    signature, and its trace."""
    run = results.load_run(root, run_id)
    found = run.build(build)
    runs = list(found.runs) if found is not None else []
    if not runs:
        raise SpecError(f"run {run.run_id} has no repetitions of build {build}")
    crashed = [r.rep for r in runs if r.label == "CRASH(target)"]
    hint = (f"; repetitions that crashed with the target signature: {', '.join(map(str, crashed))}" if crashed
            else "; none of its repetitions crashed with the target signature")
    if rep is not None:
        chosen = [r for r in runs if r.rep == rep]
        if not chosen:
            raise SpecError(f"--rep {rep}: run {run.run_id} has no repetition {rep} of build {build} (it has "
                            f"{', '.join(str(r.rep) for r in runs)}){hint}")
        if chosen[0].label != "CRASH(target)":
            raise SpecError(f"--rep {rep}: repetition {rep} of build {build} in run {run.run_id} is "
                            f"{chosen[0].label}, not CRASH(target): only a target crash can be minimized{hint}")
    for r in runs:
        if (rep is None or r.rep == rep) and r.label == "CRASH(target)":
            # the repetition's folder inside this run (minimized.* is written next to its trace),
            # not the path verdict.json recorded: a copied or edited results folder must not
            # send the output elsewhere
            trace = results.inside(run.path, run.path / found.name / str(r.rep)) / "trace.jsonl"
            if not trace.is_file():
                raise SpecError(f"{trace}: missing; runs record their trace since kvrepro wrote trace.jsonl")
            return r, trace
    raise SpecError(f"no repetition of build {build} in run {run.run_id} crashed with the target "
                    f"signature (verdicts: {', '.join(r.label for r in runs)})")


def minimize(loaded: LoadedMatrix, root: Path, run_id: str, build: str, *, fixed: str | None = None,
             rep: int | None = None, emit_pytest: Path | None = None, confirm: bool = True,
             on_line: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    loaded.plans([build] + ([fixed] if fixed else []))
    run, trace_path = find_crash(root, run_id, build, rep)
    trace = read_trace(trace_path)
    sig = loaded.matrix.target_signature
    rep_number = int(trace.header.get("rep", run.rep))
    on_line(f"starting the offline engine for build {build}")
    engine = OfflineEngine(loaded, build, rep_number)
    fixed_engine = None
    try:
        runs = {"count": 0}

        def crashes(candidate: list[TraceRequest]) -> list[TraceRequest] | None:
            runs["count"] += 1
            result = engine.run(candidate)
            if not matches(result, sig):
                return None
            return candidate[:result["crash_at"] + 1]

        original = list(trace.requests)
        start = crashes(original)
        if start is None:
            raise KvreproError(
                f"{trace_path}: sent one request at a time, the trace does not crash build {build} "
                f"with the target signature (the run was concurrent: load.concurrency > 1 interleaves "
                f"requests differently); record the run with load.concurrency: 1 to minimize it")
        on_line(f"crashes at request {len(start) - 1}; ddmin over {len(start)} requests")
        items = ddmin(start, crashes, on_line)
        on_line(f"shortening {len(items)} prompts")
        items = _shorten_prompts(items, crashes, loaded.matrix.engine.block_size)
        items = _shorten_outputs(items, crashes)
        # deterministic: the same verdict at the same request, twice more
        again = [engine.run(items) for _ in range(2)]
        deterministic = all(matches(r, sig) and r["crash_at"] == len(items) - 1 for r in again)
        fixed_result = None
        if fixed:
            on_line(f"checking build {fixed}")
            fixed_engine = OfflineEngine(loaded, fixed, rep_number)
            got = fixed_engine.run(items)
            fixed_result = ("CRASH(target)" if matches(got, sig) else
                            f"CRASH({got.get('exception')} in {got.get('function')})" if got.get("crashed") else
                            f"no crash ({got['trigger_calls']} trigger calls)")
    finally:
        engine.close()
        if fixed_engine is not None:
            fixed_engine.close()

    minimized = Trace(trace_path, {**trace.header, "minimized_from": str(trace_path),
                                   "load": {**(trace.header.get("load") or {}), "concurrency": 1}}, items)
    out_path = trace_path.with_name("minimized.trace.jsonl")
    write_trace(out_path, minimized)
    summary: dict[str, Any] = {
        "trace": str(out_path), "source": str(trace_path), "build": build, "fixed": fixed,
        "requests_before": len(original), "requests": len(items),
        "tokens_before": sum(len(r.tokens) for r in original), "tokens": sum(len(r.tokens) for r in items),
        "crash_at": len(items) - 1, "deterministic": deterministic, "fixed_result": fixed_result,
        "candidates_run": runs["count"],
    }
    if emit_pytest is not None:
        summary.update(_emit_and_check(Path(emit_pytest), minimized, loaded, build, engine, fixed, fixed_engine,
                                       on_line))
    summary["confirmed"] = []
    if confirm:
        summary["confirmed"] = _confirm(loaded, out_path, root, [build] + ([fixed] if fixed else []), on_line)
    ok = deterministic and (fixed is None or not str(fixed_result).startswith("CRASH"))
    ok = ok and all(c["ok"] for c in summary.get("pytest_check", {}).values())
    summary["ok"] = ok and all("error" not in c for c in summary["confirmed"])
    results.write_json(trace_path.with_name("minimized.json"), summary)
    return summary


def _emit_and_check(path: Path, trace: Trace, loaded: LoadedMatrix, build: str, engine: OfflineEngine,
                    fixed: str | None, fixed_engine: OfflineEngine | None,
                    on_line: Callable[[str], None]) -> dict[str, Any]:
    """Write the scheduler-level test and run it with each build's vLLM: it must fail on
    ``build`` with the target signature and pass on ``fixed``."""
    from .pytest_emit import emit, run_emitted

    sig = loaded.matrix.target_signature
    engines = {build: engine, **({fixed: fixed_engine} if fixed and fixed_engine is not None else {})}
    runs = {name: (e.command[0], e.test_pythonpath,
                   f"build {name}: " + ("fails (the bug)" if name == build else "passes (fixed)"))
            for name, e in engines.items()}
    emit(path, trace, loaded, engine.engine_info, runs)
    check: dict[str, dict[str, Any]] = {}
    for name, e in engines.items():
        on_line(f"running the emitted test with build {name}'s vLLM")
        got = run_emitted(path, e.command[0], e.test_pythonpath)
        target = (got["exit"] != 0 and got["exception"] == sig.exception and got["function"] == sig.function
                  and (not sig.file or str(got["file"] or "").endswith(sig.file)))
        if name == build:
            ok, seen = target, ("fails with the target signature" if target else
                                f"exit {got['exit']}, not the target signature: {got['tail'][-300:]}")
        else:
            ok = got["exit"] == 0
            seen = "passes" if ok else f"exit {got['exit']}: {got['tail'][-300:]}"
        check[name] = {"ok": ok, "result": seen, "exit": got["exit"]}
    return {"pytest": str(path), "pytest_check": check}


def _confirm(loaded: LoadedMatrix, trace_path: Path, root: Path, builds: list[str],
             on_line: Callable[[str], None]) -> list[str]:
    """Replay the minimized trace over HTTP on each build (the path `kvrepro load replay` takes)."""
    from .runner import MatrixOptions, run_matrix

    lines = []
    trace = read_trace(trace_path)
    for name in builds:
        on_line(f"replaying the minimized trace on build {name} over HTTP")
        options = MatrixOptions(target="sim", builds=[name], repetitions=1, results_root=root, jobs=1, replay=trace)
        r = run_matrix(loaded, options).build(name).runs[0]
        at = r.load.first_failed_index if r.load else None
        lines.append(f"{name}: {r.label}" + (f" at request {at}" if at is not None else "")
                     + f", trigger count {r.trigger_count}, bug state {r.state_count} ({r.run_dir})")
    return lines
