"""The `kvrepro matrix ...` and `kvrepro load replay` commands' work, called by kvrepro/cli.py with
the parsed options: check, plan, run (under the Ctrl-C rule of kvrepro/stopping.py), show, and the
exit code a run's verdicts give."""

from __future__ import annotations

import threading
from pathlib import Path
from ..errors import BadInputError
from ..records import Verdict
from ..report import terminal
from ..report.terminal import err, out
from ..results import store as results
from ..secrets import redact_args
from ..spec.matrix import LoadedMatrix
from . import load_matrix


def check(loaded: LoadedMatrix, target: str | None = None, engine_flags: bool = True) -> None:
    """Everything checkable without an engine (kvrepro/matrix/validate.py); notes go to stderr."""
    from .validate import check as check_matrix

    with err.status("checking the matrix") as status:
        notes = check_matrix(loaded, target, engine_flags=engine_flags, on_line=lambda line: status.update(line[:120]))
    for note in notes:
        err.print(f"[yellow]note[/]: {note}", highlight=False)


def validate(matrix: Path, as_json: bool) -> None:
    loaded = load_matrix(matrix)
    check(loaded)
    plans = loaded.plans()
    if as_json:
        terminal.emit_json({"valid": True, "matrix": str(loaded.path), "builds": [p.name for p in plans]})
    else:
        out.print(f"[green]valid[/]: {loaded.path} ({len(plans)} builds on vLLM {', '.join(loaded.matrix.bases)})")
        if loaded.matrix.engine.geometry is not None:
            from ..spec.geometry import describe

            out.print(f"geometry: {describe(loaded.matrix.engine)}; model config {loaded.model_dir()}",
                      highlight=False)


def plan(matrix: Path, target: str | None, as_json: bool) -> None:
    from ..deploy import engine_always_gpu_free
    from ..report.tables import plan_table

    loaded = load_matrix(matrix)
    check(loaded, target, engine_flags=False)
    m = loaded.matrix
    target_name = target or m.target
    planned = {
        "matrix": str(loaded.path),
        "base": m.base,
        "bases": m.bases,
        "target": target_name,
        "repetitions": m.runs.count(),
        "budget": {"requests": m.runs.requests, "duration_s": m.runs.duration_s},
        "engine_args": m.engine.serve_args(m.engine.model, include_sim=engine_always_gpu_free(target_name)),
        "load": m.load.model_dump(),
        "builds": [
            {"name": p.name, "patches": [{"name": x.name, "upstream": x.upstream, "sha256": x.sha256} for x in p.patches],
             "expect": m.expect.get(p.name)}
            for p in loaded.plans()
        ],
    }
    if as_json:
        terminal.emit_json(planned)
        return
    out.print(plan_table(planned))
    out.print("engine: vllm serve " + " ".join(redact_args(planned["engine_args"])), highlight=False)


def exit_code(run: results.MatrixRun) -> int:
    """130 interrupted, 1 a verdict differs from expect:, 3 an INFRA run, else 0."""
    from ..report.expectations import mismatches

    if run.status == "interrupted":
        return 130
    problems = mismatches(run)
    if problems:
        err.print("[red]verdicts differ from expect:[/]\n  " + "\n  ".join(str(p) for p in problems))
        return 1
    if any(r.verdict is Verdict.INFRA for r in run.runs()):
        # INFRA wins over "differs from expect:" (report/expectations.py): CI must not read a
        # broken host as "the bug is back"
        err.print("[magenta]infrastructure failed (INFRA above); no verdict differs from expect:[/]")
        return 3
    return 0


def _import_in_background(*modules: str) -> threading.Thread:
    """Import the report's modules (scipy, matplotlib: ~2 s of CPU) on a thread of their own: they
    are needed only once the runs are over, and until the engine zygote has preloaded vLLM's
    dependencies (one core, several seconds) the other core has nothing else to do. A module
    that fails to import here fails again, with its error, where it is used.

    Not a daemon thread: a command that ends early (bad input, exit 2 or 3 in a second) would
    otherwise finalize the interpreter while this thread is inside a C extension's module init
    (numpy, scipy), and CPython aborts on that ("PyThreadState_Get: ... the GIL is released",
    SIGABRT instead of the documented exit code; seen once in CI). Interpreter shutdown joins a
    non-daemon thread first, which costs an early exit at most the import's remaining seconds."""
    import importlib

    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - reported by the import where the module is used
                return

    thread = threading.Thread(target=load, name="kvrepro-import-report")
    thread.start()
    return thread


def run(matrix: Path, *, target: str | None, build: list[str] | None, reps: int | None, base_image: str | None,
        jobs: int | None, base: list[str] | None, adaptive: int | None, full_load: bool, ci: bool,
        junit: Path | None, results_root: Path, as_json: bool) -> int:
    """Build, run, classify, record, report; print the verdict table; the exit code. The options are
    `matrix run`'s, by name."""
    builds, bases = build, base
    from .. import stopping
    from ..report.outputs import check_junit, write_outputs
    from .runner import MatrixOptions, run_matrix

    if adaptive is not None and reps is not None:
        raise BadInputError(f"--adaptive {adaptive} and --reps {reps}: give one; --adaptive MAX repeats each build "
                            "until its verdict is decisive, at most MAX times (it replaces --reps)")
    check_junit(junit)
    loaded = load_matrix(matrix)
    results_root = results.checked_root(results_root)
    if base_image:
        loaded.matrix = loaded.matrix.with_section("base_image", base_image)  # a target section (kvrepro.deploy types it)
    options = MatrixOptions(target=target, builds=builds, repetitions=reps, results_root=results_root, jobs=jobs,
                            bases=bases, adaptive_max=adaptive, full_load=full_load)
    total = len(loaded.plans(builds, bases)) * loaded.matrix.runs.count(reps, adaptive)
    stop = threading.Event()

    def on_first(signum: int) -> None:
        err.print(f"[yellow]{stopping.name(signum)}: stopping; engines are being stopped and finished runs "
                  "recorded (Ctrl-C again to stop at once)[/]")

    check(loaded, target)  # before a run folder exists: a typo leaves nothing behind
    from rich.markup import escape

    from ..versions import unported_note

    for release in dict.fromkeys(p.base for p in loaded.plans(builds, bases)):
        if (note := unported_note(release)) is not None:
            err.print(f"[yellow]note[/]: {escape(note)}", highlight=False)
    # bad input never waits for it; matplotlib only where the report may draw a curve (report/render.py)
    from ..report.render import MIN_TIMED_RUNS

    figure = loaded.matrix.runs.count(reps, adaptive) >= MIN_TIMED_RUNS
    reporting = _import_in_background("kvrepro.report.render", *(["kvrepro.report.plots"] if figure else []))
    # SIGTERM (a CI runner cancelling the job, `kill`) is a Ctrl-C: engines stopped, runs kept
    with stopping.stop_on_signals(stop, on_first):
        progress = terminal.progress_for(total, ci)
        with terminal.live(progress):
            finished = run_matrix(loaded, options, progress, stop)
        reporting.join()
        from ..report.render import matrix_json, matrix_table

        with stopping.ignored():  # every run is recorded: nothing may cut the table or the report short
            if as_json:
                terminal.emit_json(matrix_json(finished))
            else:
                (terminal.ci_console() if ci else out).print(matrix_table(finished))
            written = write_outputs(finished, junit, ci)
    code = exit_code(finished)
    if not written and code == 0:
        code = 3  # the error line above says what was not written; CI must not read it as a pass
    return code


def show(run_id: str, results_root: Path, as_json: bool) -> None:
    from ..report.render import matrix_json, matrix_table

    recorded = results.load_run(results_root, run_id)
    if as_json:
        terminal.emit_json(matrix_json(recorded))
    else:
        out.print(matrix_table(recorded))


def replay(trace: Path, build: str, matrix: Path, target: str | None, results_root: Path, as_json: bool) -> int:
    """Send a recorded trace again against ``build``; print its verdict and where it crashed."""
    from ..loadgen.trace import read_trace
    from ..stopping import name, stop_on_signals
    from .runner import MatrixOptions, run_matrix

    loaded = load_matrix(matrix)
    recorded = read_trace(trace)
    loaded.plans([build])  # unknown build: exit 2 before anything starts
    options = MatrixOptions(target=target, builds=[build], repetitions=1, results_root=results_root,
                            jobs=1, replay=recorded)
    stop = threading.Event()
    progress = terminal.RichProgress(1)

    def on_first(signum: int) -> None:
        err.print(f"[yellow]{name(signum)}: stopping; the engine is being stopped and the replay recorded "
                  "(Ctrl-C again to stop at once)[/]")

    with stop_on_signals(stop, on_first), progress.progress:
        finished = run_matrix(loaded, options, progress, stop)
    result = finished.build(build).runs[0]
    summary = {"trace": str(trace), "build": build, "verdict": result.label, "title": result.title,
               "crash_at": result.load.first_failed_index if result.load else None,
               "requests": result.requests, "requests_in_trace": len(recorded.requests),
               "trigger_count": result.trigger_count, "state_count": result.state_count,
               "run_dir": result.run_dir}
    if as_json:
        terminal.emit_json(summary)
    else:
        at = f" at request {summary['crash_at']}" if summary["crash_at"] is not None else ""
        out.print(f"build {build}: [bold]{summary['verdict']}[/]{at} ({summary['requests']}/"
                  f"{summary['requests_in_trace']} requests sent)  {summary['title'] or ''}")
    if finished.status == "interrupted":
        return 130
    return 3 if result.label == "INFRA" else 0
