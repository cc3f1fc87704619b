"""The `kvrepro` command: wires the pipeline stages to commands. No stage logic lives here.

Exit codes: 0 done (and every verdict as `expect:` says, when it says); 1 a verdict differs from
`expect:` (`builds test`: a build fails a vLLM test that passes on the release); 2 bad input (matrix.yaml, arguments); 3 infrastructure (setup, build or engine start
failed); 130 interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from .results import store as results
from .errors import BadInputError, KvreproError, SpecError, describe_os_error
from .records import RunResult, Verdict, to_jsonable
from .secrets import redact, redact_args

if TYPE_CHECKING:  # kvrepro.spec.matrix (pydantic) is imported when a command reads a matrix
    from .bisect.state import BisectRequest
    from .records import BisectResult, BisectStep
    from .results.index import RunRow
    from .spec.matrix import LoadedMatrix


class _LazyModule:
    """A module imported on first use: kvrepro.report.render pulls in scipy (1.4 s of a 2 s start-up),
    which `results list`, `clean` and the like never need."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        import importlib

        return getattr(importlib.import_module(self._name), attr)


report = _LazyModule("kvrepro.report.render")
report_document = _LazyModule("kvrepro.report.document")
builds = _LazyModule("kvrepro.builds")

# `kvrepro --help` lists commands in the order of the work, whatever order they are defined in
COMMAND_ORDER = ("setup", "init", "matrix", "suite", "bisect", "minimize", "triage", "explore", "results", "report",
                 "classify", "signatures", "load", "engine", "hosts", "images", "clean")


class _InWorkOrder(typer.core.TyperGroup):
    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda n: rank.get(n, len(COMMAND_ORDER)))  # stable: new ones last, as added


app = typer.Typer(help="Reproduce vLLM engine crashes and prove which fixes cure them.", cls=_InWorkOrder,
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
matrix_app = typer.Typer(help="Validate, plan, run and show build matrices.", no_args_is_help=True)
engine_app = typer.Typer(help="The GPU-free engine.", no_args_is_help=True)
results_app = typer.Typer(help="Recorded runs under results/.", no_args_is_help=True)
bisect_app = typer.Typer(help="Find the release, commit or patch that brought a crash in or took it away.",
                         no_args_is_help=True)
app.add_typer(matrix_app, name="matrix")
app.add_typer(bisect_app, name="bisect")
app.add_typer(engine_app, name="engine")
app.add_typer(results_app, name="results")
load_app = typer.Typer(help="Request traces: replay what a run sent.", no_args_is_help=True)
app.add_typer(load_app, name="load")
suite_app = typer.Typer(help="The known-defect suite: defects/ against releases and patch stacks.",
                        no_args_is_help=True)
app.add_typer(suite_app, name="suite")

# log_path=False: a progress line ends in what it says, not in the logger's source position (cli.py:166)
out = Console(log_path=False)
err = Console(stderr=True, log_path=False)

MatrixOpt = typer.Option(Path("matrix.yaml"), "--matrix", "-m", help="the experiment file")
JsonOpt = typer.Option(False, "--json", help="print machine-readable JSON on stdout")
ResultsOpt = typer.Option(results.DEFAULT_ROOT, "--results", help="where runs are recorded")


def _emit_json(value: Any) -> None:
    # one redaction for everything kvrepro hands on, --json included
    sys.stdout.write(redact(json.dumps(to_jsonable(value), indent=2)) + "\n")


def _load(path: Path) -> LoadedMatrix:
    from .matrix import load_matrix

    return load_matrix(path)


def _check(loaded: LoadedMatrix, target: Optional[str] = None, engine_flags: bool = True) -> None:
    """Everything checkable without an engine (kvrepro/validate.py); notes go to stderr."""
    from .matrix.validate import check

    with err.status("checking the matrix") as status:
        notes = check(loaded, target, engine_flags=engine_flags, on_line=lambda line: status.update(line[:120]))
    for note in notes:
        err.print(f"[yellow]note[/]: {note}", highlight=False)


def _results_root(root: Path) -> Path:
    if root.exists() and not root.is_dir():
        raise BadInputError(f"--results {root}: is a file, not a folder; give a folder where runs are recorded")
    return root


@matrix_app.command("validate")
def matrix_validate(matrix: Path = MatrixOpt, as_json: bool = JsonOpt) -> None:
    """Check matrix.yaml without starting anything: fields, duplicate keys, patch files and their
    sha256, target, load profile, model, engine.geometry (block_size, offload_chunk_tokens,
    mamba_groups, full_attention_groups, num_speculative_tokens, data_parallel_size: printed as
    the KV groups vLLM will form) and engine.extra_args (against the base's `vllm serve`)."""
    loaded = _load(matrix)
    _check(loaded)
    plans = loaded.plans()
    if as_json:
        _emit_json({"valid": True, "matrix": str(loaded.path), "builds": [p.name for p in plans]})
    else:
        out.print(f"[green]valid[/]: {loaded.path} ({len(plans)} builds on vLLM {', '.join(loaded.matrix.bases)})")
        if loaded.matrix.engine.geometry is not None:
            from .spec.geometry import describe

            out.print(f"geometry: {describe(loaded.matrix.engine)}; model config {loaded.model_dir()}",
                      highlight=False)


@matrix_app.command("plan")
def matrix_plan(matrix: Path = MatrixOpt, target: Optional[str] = typer.Option(None, help="sim, docker or ray"),
                as_json: bool = JsonOpt) -> None:
    """What would be built and run, without building or running anything."""
    loaded = _load(matrix)
    _check(loaded, target, engine_flags=False)
    m = loaded.matrix
    target_name = target or m.target
    plan = {
        "matrix": str(loaded.path),
        "base": m.base,
        "bases": m.bases,
        "target": target_name,
        "repetitions": m.runs.repetitions,
        "budget": {"requests": m.runs.requests, "duration_s": m.runs.duration_s},
        "engine_args": m.engine.serve_args(m.engine.model, include_sim=target_name == "sim"),
        "load": m.load.model_dump(),
        "builds": [
            {"name": p.name, "patches": [{"name": x.name, "upstream": x.upstream, "sha256": x.sha256} for x in p.patches],
             "expect": m.expect.get(p.name)}
            for p in loaded.plans()
        ],
    }
    if as_json:
        _emit_json(plan)
        return
    table = Table(title=f"{loaded.path}: vLLM {', '.join(m.bases)} on target {target_name}, "
                        f"{m.runs.repetitions} repetition(s) of {m.runs.requests or '-'} requests / {m.runs.duration_s or '-'} s")
    table.add_column("build")
    table.add_column("patch stack (in order)")
    table.add_column("expect")
    for b in plan["builds"]:
        table.add_row(b["name"], " -> ".join(f"{x['name']} ({x['sha256'][:12]})" for x in b["patches"]) or "(base)",
                      b["expect"] or "")
    out.print(table)
    out.print("engine: vllm serve " + " ".join(redact_args(plan["engine_args"])), highlight=False)


class RichProgress:
    """Shows builds, runs and each running engine's requests (on stderr, so --json stays clean)."""

    def __init__(self, total_runs: int):
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=err, transient=False)
        self.runs = self.progress.add_task("runs", total=total_runs)
        self.active: dict[tuple[str, int], Any] = {}

    def stage(self, text: str) -> None:
        self.progress.console.log(redact(text))

    def detail(self, text: str) -> None:
        self.progress.update(self.runs, description=f"runs  [dim]{escape(redact(text)[:80])}[/]")

    def run_started(self, build: str, rep: int, budget: int | None) -> None:
        self.progress.update(self.runs, description="runs")
        self.active[(build, rep)] = self.progress.add_task(f"  build {build} rep {rep}: requests", total=budget)

    def requests_done(self, build: str, rep: int, done: int, failed: int) -> None:
        task = self.active.get((build, rep))
        if task is not None:
            self.progress.update(task, completed=done)

    def run_finished(self, result: RunResult) -> None:
        task = self.active.pop((result.build, result.rep), None)
        if task is not None:
            self.progress.remove_task(task)
        self.progress.advance(self.runs)
        self.progress.console.log(_run_line(result))


def _run_line(result: RunResult) -> str:
    return redact(f"build {result.build} rep {result.rep}: {result.label}  trigger={result.trigger_count} "
            f"state={result.state_count} kv={result.kv_check} requests={result.requests} {result.seconds:.1f}s  "
            f"{result.title}" + (f"  [stopped: {result.load.stopped_because}]" if result.load is not None else ""))


class PlainProgress:
    """--ci: one plain line per stage and per finished run on stderr; no bars, no live display."""

    def __init__(self, total_runs: int):
        self.total = total_runs
        self.done = 0

    def stage(self, text: str) -> None:
        _plain(text)

    def detail(self, text: str) -> None:
        pass  # setup chatter (pip, patch output) would drown the lines that matter in a CI log

    def run_started(self, build: str, rep: int, budget: int | None) -> None:
        _plain(f"build {build} rep {rep}: started")

    def requests_done(self, build: str, rep: int, done: int, failed: int) -> None:
        pass

    def run_finished(self, result: RunResult) -> None:
        self.done += 1
        _plain(f"[{self.done}/{self.total}] " + _run_line(result))


def _plain(text: str) -> None:
    sys.stderr.write(redact(text) + "\n")
    sys.stderr.flush()


def _write_outputs(run: "results.MatrixRun", junit_path: Optional[Path], ci: bool) -> bool:
    """report.md/report.html always, JUnit when asked, $GITHUB_STEP_SUMMARY in CI mode. A failure
    here is one line: the verdicts are recorded and the exit code must still say what they are.
    False when something was not written (the exit code then says infrastructure, 3, never 0)."""
    ok = True
    try:
        md_path, html_path = report_document.write_report(run)
        err.print(f"report: {html_path} (markdown: {md_path.name})", highlight=False)
        if ci:
            summary = report.append_step_summary(md_path.read_text())
            if summary is not None:
                err.print(f"appended the report to $GITHUB_STEP_SUMMARY ({summary})", highlight=False)
    except OSError as exc:
        err.print("[red]error:[/] report not written: " + escape(redact(describe_os_error(exc))), highlight=False)
        ok = False
    except ValueError as exc:
        err.print(f"[red]error:[/] report not written: {escape(redact(str(exc)))}", highlight=False)
        ok = False
    if junit_path is not None:
        from .report.junit import write_junit

        try:
            write_junit(run, junit_path)
            err.print(f"junit: {junit_path}", highlight=False)
        except OSError as exc:
            err.print("[red]error:[/] " + escape(redact(_junit_problem(junit_path, exc))), highlight=False)
            ok = False
    return ok


def _junit_problem(path: Path, exc: OSError) -> str:
    return f"--junit {path}: cannot write it: {exc.strerror or exc}; give a path in a writable folder"


def _check_junit(path: Optional[Path]) -> None:
    """--junit checked before anything runs: a folder is bad input (2); a place that cannot be
    written (read-only, no permission) is the environment (3). Either way one line, no run spent."""
    if path is None:
        return
    import tempfile

    from .errors import InfraError

    if path.is_dir():
        raise BadInputError(f"--junit {path}: is a folder; give a file, e.g. {path / 'kvrepro-junit.xml'}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise BadInputError(f"--junit {path}: {parent} is a file, not a folder; give a path in a folder")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise InfraError(_junit_problem(path, exc)) from None
    if path.exists() and not path.is_file():
        raise BadInputError(f"--junit {path}: not a regular file; give a file path")


def _exit_code(run: "results.MatrixRun") -> int:
    """130 interrupted, 1 a verdict differs from expect:, 3 an INFRA run, else 0."""
    if run.status == "interrupted":
        return 130
    problems = report.mismatches(run)
    if problems:
        err.print("[red]verdicts differ from expect:[/]\n  " + "\n  ".join(str(p) for p in problems))
        return 1
    if any(r.verdict is Verdict.INFRA for r in run.runs()):
        # INFRA wins over "differs from expect:" (report/expectations.py): CI must not read a
        # broken host as "the bug is back"
        err.print("[magenta]infrastructure failed (INFRA above); no verdict differs from expect:[/]")
        return 3
    return 0


@matrix_app.command("run")
def matrix_run(
    matrix: Path = MatrixOpt,
    target: Optional[str] = typer.Option(None, help="override matrix.yaml's target (sim, docker, ray)"),
    build: Optional[list[str]] = typer.Option(None, "--build", "-b", help="only these builds (repeatable)"),
    reps: Optional[int] = typer.Option(None, "--reps", min=1, max=1000, help="override runs.repetitions (at most 1000)"),
    base_image: Optional[str] = typer.Option(None, "--base-image",
                                             help="docker: base image to assemble on (e.g. kvrepro/vllm-openai-cpu:v0.26.0)"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, max=256,
                                       help="engines at once (default: what the target can take; sim: one per core)"),
    base: Optional[list[str]] = typer.Option(None, "--base",
                                             help="run on this vLLM release instead of matrix.yaml's base (repeatable)"),
    adaptive: Optional[int] = typer.Option(None, "--adaptive", min=1, max=1000, metavar="MAX",
                                           help="repeat each build until its verdict is decisive (docs/statistics.md: "
                                                "stopping rule), at most MAX times"),
    full_load: bool = typer.Option(False, "--full-load", help="send every run's whole load (runs.requests); by "
                                   "default a run ends once its verdict is settled (docs/statistics.md)"),
    ci: bool = typer.Option(False, "--ci", help="non-interactive: plain lines, no progress bars; appends the "
                                                "report to $GITHUB_STEP_SUMMARY when set"),
    junit: Optional[Path] = typer.Option(None, "--junit", help="also write JUnit XML here (one testcase per "
                                                               "base, build and repetition)"),
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Build every build, run each under load, classify, record, report, and print the verdict table."""
    from .matrix.runner import MatrixOptions, run_matrix

    if adaptive is not None and reps is not None:
        raise BadInputError(f"--adaptive {adaptive} and --reps {reps}: give one; --adaptive MAX repeats each build "
                            "until its verdict is decisive, at most MAX times (it replaces --reps)")
    _check_junit(junit)
    loaded = _load(matrix)
    results_root = _results_root(results_root)
    if base_image:
        loaded.matrix = loaded.matrix.model_copy(update={"base_image": base_image})
    options = MatrixOptions(target=target, builds=build, repetitions=reps, results_root=results_root, jobs=jobs,
                            bases=base, adaptive_max=adaptive, full_load=full_load)
    plans = loaded.plans(build, base)
    total = len(plans) * (adaptive or reps or loaded.matrix.runs.repetitions)
    stop = threading.Event()

    def on_stop_signal(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        err.print(f"[yellow]{what}: stopping; engines are being stopped and finished runs recorded "
                  "(Ctrl-C again to stop at once)[/]")

    _check(loaded, target)  # before a run folder exists: a typo leaves nothing behind
    # SIGTERM (a CI runner cancelling the job, `kill`) is a Ctrl-C: engines stopped, runs kept
    previous = {sig: signal.signal(sig, on_stop_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        if ci:
            run = run_matrix(loaded, options, PlainProgress(total), stop)
        else:
            progress = RichProgress(total)
            with progress.progress:
                run = run_matrix(loaded, options, progress, stop)
        # Every run is recorded and nothing is left running; the table and the report take a
        # moment. A further Ctrl-C must not land inside them (a KeyboardInterrupt raised in a
        # library's callback prints a traceback and leaves a half-written report): ignored.
        for sig in previous:
            signal.signal(sig, lambda signum, frame: None)
        if as_json:
            _emit_json(report.matrix_json(run))
        else:
            (_ci_console() if ci else out).print(report.matrix_table(run))
        written = _write_outputs(run, junit, ci)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = _exit_code(run)
    if not written and code == 0:
        code = 3  # the error line above says what was not written; CI must not read it as a pass
    if code:
        raise typer.Exit(code)


def _ci_console() -> Console:
    """A wide, colourless console: CI logs are read as text, and wrapped table cells are unreadable."""
    return Console(width=200, color_system=None, force_terminal=False, soft_wrap=False)


@app.command("report")
def report_cmd(
    run_id: str = typer.Argument("latest", help="a run id under --results, `latest`, or a run folder"),
    junit: Optional[Path] = typer.Option(None, "--junit", help="also write JUnit XML here"),
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Write results/<run>/report.md and report.html (self-contained) for a recorded run."""
    _check_junit(junit)
    run = results.load_run(results_root, run_id)
    md_path, html_path = report_document.write_report(run)
    if junit is not None:
        from .report.junit import write_junit
        from .errors import InfraError

        try:
            write_junit(run, junit)
        except OSError as exc:
            raise InfraError(_junit_problem(junit, exc)) from None
    if as_json:
        _emit_json({"run_id": run.run_id, "markdown": str(md_path), "html": str(html_path),
                    "junit": str(junit) if junit else None})
    else:
        out.print(f"{html_path}\n{md_path}" + (f"\n{junit}" if junit else ""), highlight=False)


@matrix_app.command("show")
def matrix_show(run_id: str = typer.Argument("latest"), results_root: Path = ResultsOpt,
                as_json: bool = JsonOpt) -> None:
    """The verdict table of a recorded run (default: the latest)."""
    run = results.load_run(results_root, run_id)
    if as_json:
        _emit_json(report.matrix_json(run))
    else:
        out.print(report.matrix_table(run))


@results_app.command("list")
def results_list(results_root: Path = ResultsOpt, as_json: bool = JsonOpt) -> None:
    """Every recorded run, oldest first (a folder another kvrepro wrote is listed with why it is unreadable)."""
    from .results.index import rows as indexed_rows

    rows = indexed_rows(_results_root(results_root))  # results/.index.json: only changed runs are read
    if as_json:
        _emit_json(rows)
        _say_what_list_omits(results_root, rows)
        return
    out.print(_runs_table(rows, results_root, out.width))
    _say_what_list_omits(results_root, rows)


def _say_what_list_omits(root: Path, rows: list[RunRow]) -> None:
    """results list shows runs; what else is there is said on stderr (so --json stays a list)."""
    bisections, others = results.other_folders(root)
    unreadable = sum(1 for r in rows if r.unreadable)
    notes = []
    if unreadable:
        notes.append(f"{unreadable} run(s) listed as unreadable (`kvrepro results show RUN` says why)")
    if bisections:
        notes.append(f"{len(bisections)} bisection(s) not listed: {', '.join(bisections[-5:])} "
                     "(`kvrepro results show bisect-ID`)")
    if others:
        notes.append(f"{len(others)} folder(s) that are not runs (no run.json): {', '.join(others[-5:])}")
    for note in notes:
        err.print(f"note: {escape(note)}", highlight=False)


def _compact(labels: list[str]) -> str:
    if not labels:
        return "-"
    return f"{len(labels)}x {labels[0]}" if len(set(labels)) == 1 and len(labels) > 1 else " ".join(labels)

def _runs_table(rows: list[RunRow], results_root: Path, width: int) -> Table:
    """`results list`'s table, folded to ``width``: when a run's verdicts do not fit on one line (an
    80-column terminal), each build gets a line of its own, its verdicts counted; target and base
    move into the title when every run shares them. No verdict is cut in the middle."""
    readable = [r for r in rows if not r.unreadable]
    one_line = {r.run_id: "  ".join(f"{n}: {_compact(v)}" for n, v in r.builds.items()) for r in readable}
    shared = {k: {getattr(r, k) for r in readable} for k in ("target", "base")}

    def room(keys: tuple[str, ...]) -> int:  # what the verdicts column has beside the others
        return width - 4 - 3 * len(keys) - sum(max((len(getattr(r, k) or "") for r in readable), default=0)
                                               for k in keys) - (2 if len(readable) < len(rows) else 0)

    keys: tuple[str, ...] = ("run_id", "status", "target", "base")
    narrow = any(len(text) > room(keys) for text in one_line.values())
    title = f"runs under {results_root}/"
    if narrow and readable and all(len(v) == 1 for v in shared.values()):
        keys = ("run_id", "status")
        title += f" (target {next(iter(shared['target'])) or '-'}, vLLM {next(iter(shared['base'])) or '-'})"
    table = Table(title=title)
    for key in keys:
        table.add_column(key.replace("_", " "))
    table.add_column("verdicts")
    for r in rows:
        if r.unreadable:
            table.add_row("", "unreadable", *([""] * (len(keys) - 2)), r.error)
            continue
        text = one_line[r.run_id]
        if narrow and len(text) > room(keys):
            text = "\n".join(f"{n}: {_counted(v)}" for n, v in r.builds.items())
        cells = [getattr(r, k) or "" for k in keys]
        if r.recorded_id:  # a copied run folder: its folder name, and the run it is a copy of
            cells[0] = f"{cells[0]}\n(run.json: {r.recorded_id})"
        table.add_row(*cells, text)
    return table


def _counted(labels: list[str]) -> str:
    """`2x CRASH(target) 1x INFRA`: each verdict once with its count."""
    if not labels:
        return "-"
    return " ".join(f"{n}x {label}" for label, n in Counter(labels).items())



@results_app.command("show")
def results_show(run_id: str = typer.Argument("latest"), results_root: Path = ResultsOpt,
                 as_json: bool = JsonOpt) -> None:
    """Everything recorded for one run (or one bisection)."""
    from . import bisect

    if run_id != "latest" and bisect.is_bisection(results_root, run_id):
        _show_bisection(bisect.result_from_state(bisect.load_state(results_root, run_id), results_root / run_id),
                        as_json)
        return
    run = results.load_run(results_root, run_id)
    if as_json:
        _emit_json({"info": run.info, "path": str(run.path),
                    "builds": [{"name": b.name, "base": b.base, "patches": b.patches, "expect": b.expect,
                                "build": b.build, "manifest": b.manifest, "runs": b.runs} for b in run.builds]})
    else:
        out.print(report.matrix_table(run))
        for b in run.builds:
            for r in b.runs:
                out.print(f"  {report.build_key(run, b)}/{r.rep}: {r.run_dir}")


@results_app.command("compare")
def results_compare(before: str = typer.Argument(..., help="the earlier run (id, `latest` or folder)"),
                    after: str = typer.Argument(..., help="the later run"),
                    results_root: Path = ResultsOpt, as_json: bool = JsonOpt) -> None:
    """Which verdicts changed between two runs (e.g. the same matrix on two vLLM releases)."""
    from .report.compare import compare, comparison_json

    c = compare(results.load_run(results_root, before), results.load_run(results_root, after))
    if as_json:
        _emit_json(comparison_json(c))
        return
    table = Table(title=f"{c.before.run_id} (vLLM {c.before.info.base_text}) -> {c.after.run_id} (vLLM {c.after.info.base_text})",
                  title_justify="left")
    for col in ("build", "before", "after", "failed", "Fisher p (two-sided)"):
        table.add_column(col)
    for b in c.builds:
        table.add_row(b.build, b.before or "(absent)", b.after or "(absent)",
                      f"{b.before_rate.crashes}/{b.before_rate.trials} -> {b.after_rate.crashes}/{b.after_rate.trials}",
                      "-" if b.p_value is None else f"{b.p_value:.3g}",
                      style="bold" if b.changed else "dim")
    out.print(table)
    out.print(f"{len(c.changed)} build(s) changed" + (": " + ", ".join(b.build for b in c.changed) if c.changed else ""))


@app.command("classify")
def classify_cmd(
    log: Path = typer.Argument(..., help="an engine log (engine.log, `docker logs` output, vllm serve output)"),
    source: Optional[Path] = typer.Option(None, "--source", help="a folder holding the build's vllm/ sources"),
    matrix: Optional[Path] = typer.Option(None, "--matrix", "-m",
                                          help="take target_signature from this matrix (default: the shipped matrix.yaml's)"),
    as_json: bool = JsonOpt,
) -> None:
    """Find the fatal traceback in an engine log and name its crash signature."""
    if log.is_dir():
        raise BadInputError(f"{log}: is a folder; give an engine log file, e.g. {log / 'engine.log'} "
                            "(results/<run>/<build>/<rep>/engine.log)")
    if not log.exists():
        raise BadInputError(f"{log}: no such file; give an engine log (engine.log, `docker logs` output)")
    from .untrusted import open_regular

    try:  # a FIFO, /dev/zero: one line, never a hang (kvrepro/untrusted.py)
        os.close(open_regular(log, follow=True))
    except OSError as exc:
        raise BadInputError(f"{log}: {exc.strerror or exc}; give an engine log file (engine.log, `docker logs` "
                            "output, or a .gz of one)") from None
    if source is not None and not source.is_dir():
        what = "is a file, not a folder" if source.exists() else "no such folder"
        raise BadInputError(f"--source {source}: {what}; give the folder that holds the build's vllm/ sources "
                            "(e.g. the overlay `kvrepro setup` prints)")
    from .spec.matrix import default_target_signature

    from .classify import classify_file
    from .classify.judge import judge

    target = _load(matrix).matrix.target_signature if matrix else default_target_signature()
    result = classify_file(log, source, target)  # streams; a binary or damaged .gz file is NotTextLog (exit 2)
    from .classify.logfile import open_log

    with open_log(log) as fh:
        judged = judge(fh.read(), source, target, judge_run=False)
    exposure, defects = judged.exposure, judged.defects
    if as_json:
        _emit_json({**result.to_json(), "kv_violations": exposure.kv_violations, "kv_defects": defects,
                    "kv_violations_by_class": dict(exposure.kv_violations_by)})
    else:
        out.print(f"[bold]{result.outcome.value}[/]: {escape(result.title)}")
        if defects:
            out.print(f"[bold]corrupt[/]: {escape(judged.title)} "
                      f"({', '.join(f'{name} {n}' for name, n in defects.items())})")


@app.command("signatures")
def signatures_cmd(as_json: bool = JsonOpt) -> None:
    """List the known crash and corruption signatures (the names `expect:` and reports use)."""
    from .classify import known_patterns
    from .classify.corruption import known_corruptions
    from .classify.infra import known_infra_causes

    crashes = [{"kind": "crash", "name": p.name, "title": p.title if "{" not in p.title else
                f"{p.exception} in {p.function}" + (f": {p.expressions[0]}" if p.expressions else ""),
                "site": f"{p.file}:{p.function}", "upstream": list(p.upstream), "test_log": p.test_log}
               for p in known_patterns()]
    corruptions = [{"kind": "corruption", "name": c.name, "title": c.title,
                    "classes": [vars(k) for k in c.classes], "upstream": list(c.upstream),
                    "fixed_by": list(c.fixed_by), "test_log": c.test_log} for c in known_corruptions()]
    infra = [{"kind": "infra", "name": c.name, "title": f"{c.kind}: <the line>", "line": c.line,
              "upstream": list(c.upstream), "test_log": c.test_log} for c in known_infra_causes()]
    if as_json:
        _emit_json(crashes + corruptions + infra)
        return
    table = Table(title="known signatures (kvrepro/classify/signatures/, corruptions/, infra/)",
                  title_justify="left")
    for column in ("kind", "name", "what"):
        table.add_column(column, overflow="fold")
    for row in crashes + corruptions + infra:
        table.add_row(row["kind"], row["name"], escape(row["title"]))
    out.print(table)


@app.command("setup")
def setup_cmd(matrix: Path = MatrixOpt, as_json: bool = JsonOpt) -> None:
    """Download the base wheel, create the runtime env and build every overlay (idempotent)."""
    loaded = _load(matrix)
    done: dict[str, Any] = {}
    with err.status("setting up") as status:
        for release in loaded.matrix.bases:
            runtime = builds.prepare_runtime(release, on_line=lambda line: status.update(line[:120]))
        python = runtime.python
        done["runtime_python"] = str(python)
        done["runtime_layers"] = [str(p) for p in runtime.layers]
        done["builds"] = {}
        for plan in loaded.plans():
            artifact = builds.build_overlay(plan, on_line=lambda line: status.update(line[:120]))
            done["builds"][plan.name] = {"ok": artifact.ok, "overlay": artifact.ref, "error": artifact.error,
                                         "reused": artifact.reused}
    if as_json:
        _emit_json(done)
    else:
        out.print(f"runtime env: {python}")
        for name, b in done["builds"].items():
            out.print(f"build {name}: " + (f"[green]ok[/] {b['overlay']}" if b["ok"] else f"[red]failed[/] {b['error']}"))


@app.command("init")
def init_cmd(folder: Path = typer.Argument(Path("."), help="where to write it (made if missing)"),
             defects: bool = typer.Option(False, "--defects", help="also copy the known-defect catalogue into "
                                          "FOLDER/defects, to edit or extend (it then replaces the shipped one)"),
             force: bool = typer.Option(False, "--force", help="overwrite files that are already there"),
             as_json: bool = JsonOpt) -> None:
    """Write a starter project: the default matrix.yaml and its patches under builds/."""
    from .spec.starter import write_starter

    project = write_starter(folder, with_catalogue=defects, force=force)
    if as_json:
        _emit_json(project)
        return
    out.print(f"wrote {len(project.written)} files into {project.folder.resolve()}: matrix.yaml, builds/"
              + (", defects/" if project.catalogue else ""), highlight=False)
    out.print("next:\n" + "\n".join(f"  {step}" for step in project.next_steps), highlight=False)


@engine_app.command("serve")
def engine_serve(
    build: str = typer.Option(..., "--build", "-b", help="which build of the matrix to serve"),
    port: int = typer.Option(8000, "--port", "-p", min=1, max=65535),
    matrix: Path = MatrixOpt,
    rep: int = typer.Option(0, help="repetition number (selects the seed)"),
) -> None:
    """Serve one build with vLLM's own `vllm serve`, GPU-free, on 127.0.0.1 until stopped (Ctrl-C)."""
    import subprocess

    from .deploy.sim import SimTarget

    loaded = _load(matrix)
    plan = loaded.plans([build])[0]
    _port_free(port)  # at once, not after vLLM's 18 s of imports end in `OSError: [Errno 98]`
    target = SimTarget(loaded)
    with err.status(f"building {build}"):
        artifact = target.prepare(plan)
    if not artifact.ok:
        raise KvreproError(f"build {build} failed: {artifact.error}")
    cmd = target.command(artifact, port)
    err.print(f"serving build {build} on http://127.0.0.1:{port} (overlay {artifact.ref}); Ctrl-C to stop")
    from . import lifetime, stopping

    # its own session: a terminal's Ctrl-C reaches kvrepro only, which stops the engine once
    proc = subprocess.Popen(cmd, env=target.environment(artifact, rep), start_new_session=True,
                            preexec_fn=lifetime.child_hook())  # kvrepro#8: dies with us, even on SIGKILL
    stops = {"signal": None, "count": 0}

    def on_signal(signum, frame):  # SIGINT, SIGTERM (a supervisor, `kill`), SIGHUP: stop the engine
        stops["signal"] = stops["signal"] or signum
        stops["count"] += 1
        try:
            if stops["count"] == 1:
                err.print(f"{stopping.name(signum)}: stopping the engine (again to stop at once)")
            os.killpg(proc.pid, signal.SIGTERM if stops["count"] == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, on_signal) for sig in stopping.SIGNALS}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # left by an exception of our own: never outlives the command
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        try:  # what the engine started in its session (EngineCore) goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if stops["signal"] is not None:
        raise typer.Exit(130)
    raise typer.Exit(code)


def _port_free(port: int) -> None:
    """BadInputError when 127.0.0.1:PORT cannot be listened on (another server holds it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise BadInputError(f"--port {port}: 127.0.0.1:{port} is in use ({exc.strerror}); stop what listens "
                                "there or choose another --port") from None


# --- bisection ---------------------------------------------------------------------------------

class BisectProgress(RichProgress):
    """Runs as they finish, and one line per decided step (stderr; --json stays clean)."""

    def __init__(self) -> None:  # noqa: D107 - how many runs a bisection takes is not known ahead
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed} done"),
                                 TimeElapsedColumn(), console=err, transient=False)
        self.runs = self.progress.add_task("runs", total=None)
        self.active: dict[tuple[str, int], Any] = {}

    def step(self, step: "BisectStep") -> None:
        from .report.bisection import step_line

        self.progress.console.log(step_line(step))


def _show_bisection(result: "BisectResult", as_json: bool) -> None:
    from .report.bisection import bisection_json, bisection_table

    if as_json:
        _emit_json(bisection_json(result))
    else:
        out.print(bisection_table(result))


def _run_bisection(how: Any, as_json: bool) -> None:
    """Run a bisection under the Ctrl-C rule of `matrix run` and print its result."""
    from . import bisect
    from .stopping import name, stop_on_signals

    stop = threading.Event()

    def on_first(signum: int) -> None:
        err.print(f"[yellow]{name(signum)}: stopping after the current run is recorded; `--resume` continues "
                  "(Ctrl-C again to stop at once)[/]")

    progress = BisectProgress()
    try:
        with stop_on_signals(stop, on_first), progress.progress:
            result = how(progress=progress, stop=stop, on_step=progress.step)
    except bisect.Interrupted:
        err.print("interrupted; finished runs are kept; continue with `--resume latest`")
        raise typer.Exit(130)
    _show_bisection(result, as_json)
    if result.answer is None:
        raise typer.Exit(1)


AlphaOpt = typer.Option(0.05, "--alpha", min=0.0001, max=0.5,
                        help="a good point must be this unlikely to be a crashing one that stayed clean")
CalibrateOpt = typer.Option(3, "--calibrate", min=1, max=100, help="runs at the bad end (they measure the crash rate)")
MaxRunsOpt = typer.Option(None, "--max-runs", min=1, max=1000, help="runs after which an undecided point is a skip "
                                                           "(default: 3 x the runs a good verdict needs + 6)")
RequestsOpt = typer.Option(None, "--requests", min=1, max=1_000_000, help="override runs.requests for every probe")
TitleOpt = typer.Option(None, "--title", help="bisect this crash (title text) instead of target_signature")
TargetOpt = typer.Option(None, "--target", help="override matrix.yaml's target (sim, docker, ray)")
JobsOpt = typer.Option(None, "--jobs", "-j", min=1, max=256, help="engines at once")
ResumeOpt = typer.Option(None, "--resume", help="continue an interrupted bisection (its id, or `latest`)")


def _bisect(kind: str, request: "BisectRequest", resume_id: Optional[str], results_root: Path, as_json: bool) -> None:
    from . import bisect

    # bad input is reported before any progress is drawn
    if resume_id:
        bisect.load_state(results_root, resume_id)
        bisect.ensure_idle(results_root, resume_id)  # a live bisection is not resumed twice
    else:
        bisect.check_request(kind, request)
    if resume_id:
        _run_bisection(lambda **kw: bisect.resume(results_root, resume_id, kind, **kw), as_json)
    else:
        _run_bisection(lambda **kw: bisect.start(kind, request, results_root, **kw), as_json)


def _need(**given: Any) -> None:
    missing = [f"--{name}" for name, value in given.items() if value is None]
    if missing:
        raise SpecError(f"give {' and '.join(missing)} (or --resume ID)")


@bisect_app.command("releases")
def bisect_releases(
    bad: Optional[str] = typer.Option(None, "--bad", help="a release that shows the crash"),
    good: Optional[str] = typer.Option(None, "--good", help="a release that does not (older or newer)"),
    build: Optional[str] = typer.Option(None, "--build", "-b",
                                        help="apply this build's patch stack (common first) at every release; "
                                             "default: the releases as shipped"),
    matrix: Path = MatrixOpt, target: Optional[str] = TargetOpt, title: Optional[str] = TitleOpt,
    alpha: float = AlphaOpt, calibrate: int = CalibrateOpt, max_runs: Optional[int] = MaxRunsOpt,
    requests: Optional[int] = RequestsOpt, jobs: Optional[int] = JobsOpt, resume: Optional[str] = ResumeOpt,
    results_root: Path = ResultsOpt, as_json: bool = JsonOpt,
) -> None:
    """The first vLLM release at which the verdict changes (the crash came in, or went away)."""
    if not resume:
        _need(bad=bad, good=good)
    from .bisect.state import BisectRequest

    _bisect("releases", BisectRequest(matrix=str(matrix), bad=bad, good=good, build=build, target=target,
                                      title=title, alpha=alpha, calibrate=calibrate, max_runs=max_runs,
                                      requests=requests, jobs=jobs), resume, results_root, as_json)


@bisect_app.command("commits")
def bisect_commits(
    repo: Optional[Path] = typer.Option(None, "--repo", help="a vLLM git checkout"),
    bad: Optional[str] = typer.Option(None, "--bad", help="a commit that shows the crash"),
    good: Optional[str] = typer.Option(None, "--good", help="a commit that does not (older or newer)"),
    wheel: Optional[str] = typer.Option(None, "--wheel",
                                        help="the release whose wheel every commit goes on (default: the nearest "
                                             "release tag before each commit)"),
    build: Optional[str] = typer.Option(None, "--build", "-b", help="apply this build's patch stack to every commit"),
    matrix: Path = MatrixOpt, target: Optional[str] = TargetOpt, title: Optional[str] = TitleOpt,
    alpha: float = AlphaOpt, calibrate: int = CalibrateOpt, max_runs: Optional[int] = MaxRunsOpt,
    requests: Optional[int] = RequestsOpt, jobs: Optional[int] = JobsOpt, resume: Optional[str] = ResumeOpt,
    results_root: Path = ResultsOpt, as_json: bool = JsonOpt,
) -> None:
    """The first commit at which the verdict changes; each commit's vllm/ runs on a release wheel."""
    if not resume:
        _need(repo=repo, bad=bad, good=good)
    from .bisect.state import BisectRequest

    _bisect("commits", BisectRequest(matrix=str(matrix), repo=str(repo) if repo else None, bad=bad, good=good,
                                     wheel=wheel, build=build, target=target, title=title, alpha=alpha,
                                     calibrate=calibrate, max_runs=max_runs, requests=requests, jobs=jobs),
            resume, results_root, as_json)


@bisect_app.command("patches")
def bisect_patches(
    patch: Optional[list[str]] = typer.Option(None, "--patch", "-p",
                                              help="a candidate patch (repeatable); default: every patch the "
                                                   "builds use beyond common:"),
    matrix: Path = MatrixOpt, target: Optional[str] = TargetOpt, title: Optional[str] = TitleOpt,
    alpha: float = AlphaOpt, calibrate: int = CalibrateOpt, max_runs: Optional[int] = MaxRunsOpt,
    requests: Optional[int] = RequestsOpt, jobs: Optional[int] = JobsOpt, resume: Optional[str] = ResumeOpt,
    results_root: Path = ResultsOpt, as_json: bool = JsonOpt,
) -> None:
    """Delta debugging on the matrix base (+ common): the smallest set of candidate patches that
    removes the crash, and for each patch whether removing it alone brings the crash back."""
    from .bisect.state import BisectRequest

    _bisect("patches", BisectRequest(matrix=str(matrix), patches=patch or None, target=target, title=title,
                                     alpha=alpha, calibrate=calibrate, max_runs=max_runs, requests=requests,
                                     jobs=jobs), resume, results_root, as_json)


GIT_BISECT_EXIT = {"good": 0, "bad": 1, "skip": 125}


@matrix_app.command("verdict")
def matrix_verdict(
    git_bisect: bool = typer.Option(False, "--git-bisect",
                                    help="exit 0 good, 1 bad, 125 skip (for `git bisect run`); bad input and "
                                         "Ctrl-C exit 128/130, which stop `git bisect run`"),
    find_fix: bool = typer.Option(False, "--find-fix",
                                  help="with --git-bisect, when looking for the commit that FIXED the crash: "
                                       "exit 0 when it crashes and 1 when not (git bisect start --term-old=broken "
                                       "--term-new=fixed)"),
    repo: Optional[Path] = typer.Option(None, "--repo", help="probe the commit checked out here (HEAD) on a release wheel"),
    commit: Optional[str] = typer.Option(None, "--commit", help="with --repo: this commit instead of HEAD"),
    wheel: Optional[str] = typer.Option(None, "--wheel", help="with --repo: the release wheel (default: nearest tag)"),
    release: Optional[str] = typer.Option(None, "--release", help="without --repo: this release (default: the matrix base)"),
    build: Optional[str] = typer.Option(None, "--build", "-b", help="apply this build's patch stack (common first)"),
    p_bad: float = typer.Option(0.5, "--p-bad", min=0.01, max=0.99,
                                help="crash rate assumed at a bad point: sets how many clean runs make a good one"),
    matrix: Path = MatrixOpt, target: Optional[str] = TargetOpt, title: Optional[str] = TitleOpt,
    alpha: float = AlphaOpt, max_runs: Optional[int] = MaxRunsOpt, requests: Optional[int] = RequestsOpt,
    jobs: Optional[int] = JobsOpt, results_root: Path = ResultsOpt, as_json: bool = JsonOpt,
) -> None:
    """Run one point until its verdict is decisive (good / bad / skip) under the bisection rule."""
    from . import bisect
    from .bisect.state import BisectRequest

    request = BisectRequest(matrix=str(matrix), repo=str(repo) if repo else None, commit=commit, wheel=wheel,
                            release=release, build=build, p_bad=p_bad, target=target, title=title,
                            alpha=alpha, calibrate=1, max_runs=max_runs, requests=requests, jobs=jobs)
    holder: dict[str, str] = {}
    if release is not None and repo is None:
        from .versions import SUPPORTED_RELEASES

        if release not in SUPPORTED_RELEASES:  # before any progress is drawn; bad input, not a skip
            problem = (f"--release {release}: not a vLLM release kvrepro supports; supported: "
                       f"{', '.join(SUPPORTED_RELEASES)}")
            if not git_bisect:
                raise SpecError(problem)
            err.print(f"[red]error:[/] {escape(problem)}", highlight=False, soft_wrap=True)
            raise typer.Exit(128)

    def how(**kw: Any) -> Any:
        verdict, result = bisect.probe_point(results_root, request, **kw)
        holder["verdict"] = verdict.value
        return result

    try:
        _run_bisection(how, as_json)
    except typer.Exit as exc:
        if not git_bisect or exc.exit_code == 130:
            raise
    except KvreproError as exc:
        if not git_bisect:
            raise
        err.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(128) from None
    if git_bisect:
        verdict = holder.get("verdict", "skip")
        if find_fix and verdict in ("good", "bad"):
            verdict = "bad" if verdict == "good" else "good"
        raise typer.Exit(GIT_BISECT_EXIT[verdict])




@load_app.command("replay")
def load_replay(
    trace: Path = typer.Argument(..., help="a trace.jsonl (results/<run>/<build>/<rep>/trace.jsonl)"),
    build: str = typer.Option(..., "--build", "-b", help="the build to replay it against"),
    matrix: Path = MatrixOpt,
    target: Optional[str] = typer.Option(None, help="override matrix.yaml's target (sim, docker, ray)"),
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Send a recorded trace again, one request at a time, and give the verdict and the request it
    crashed at (deterministic on the GPU-free engine). Exit 0 whatever the verdict; 2 bad trace."""
    from .loadgen.trace import read_trace
    from .matrix.runner import MatrixOptions, run_matrix

    loaded = _load(matrix)
    recorded = read_trace(trace)
    loaded.plans([build])  # unknown build: exit 2 before anything starts
    options = MatrixOptions(target=target, builds=[build], repetitions=1, results_root=results_root,
                            jobs=1, replay=recorded)
    from .stopping import name, stop_on_signals

    stop = threading.Event()
    progress = RichProgress(1)

    def on_first(signum: int) -> None:
        err.print(f"[yellow]{name(signum)}: stopping; the engine is being stopped and the replay recorded "
                  "(Ctrl-C again to stop at once)[/]")

    with stop_on_signals(stop, on_first), progress.progress:
        run = run_matrix(loaded, options, progress, stop)
    result = run.build(build).runs[0]
    summary = {"trace": str(trace), "build": build, "verdict": result.label, "title": result.title,
               "crash_at": result.load.first_failed_index if result.load else None,
               "requests": result.requests, "requests_in_trace": len(recorded.requests),
               "trigger_count": result.trigger_count, "state_count": result.state_count,
               "run_dir": result.run_dir}
    if as_json:
        _emit_json(summary)
    else:
        at = f" at request {summary['crash_at']}" if summary["crash_at"] is not None else ""
        out.print(f"build {build}: [bold]{summary['verdict']}[/]{at} ({summary['requests']}/"
                  f"{summary['requests_in_trace']} requests sent)  {summary['title'] or ''}")
    if run.status == "interrupted":
        raise typer.Exit(130)
    if result.label == "INFRA":
        raise typer.Exit(3)


@app.command("minimize")
def minimize_cmd(
    run_id: str = typer.Argument("latest", help="a recorded run whose build --build crashed or was CORRUPT"),
    build: str = typer.Option(..., "--build", "-b", help="the crashing (or CORRUPT) build (e.g. A, B)"),
    fixed: Optional[str] = typer.Option(None, "--fixed", help="a build that must NOT crash on the result (e.g. D; for a "
                                        "CORRUPT run: must be clean, e.g. E); <build>@<release> for a build on another release"),
    rep: Optional[int] = typer.Option(None, "--rep", help="which repetition's trace (default: the first that crashed)"),
    emit_pytest: Optional[Path] = typer.Option(None, "--emit-pytest", help="also write a standalone test here (vLLM's scheduler driven with the result; "
                                              "imports only vLLM and torch) and run it on --build and --fixed"),
    confirm: bool = typer.Option(True, "--confirm/--no-confirm",
                                 help="replay the result over HTTP on --build and --fixed"),
    violation: Optional[str] = typer.Option(None, "--violation", help="minimize this kind of shadow-KV violation "
                                            "(e.g. full_attention+offload) or a defect name of `kvrepro signatures` (e.g. "
                                            "fa-hole-below-boundary); default for a CORRUPT run: its first one's kind"),
    matrix: Path = MatrixOpt,
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Shrink a crashing or CORRUPT run's trace (fewer requests, shorter prompts) to the smallest one that
    still crashes --build deterministically, or still reads wrong KV the same way (and leaves --fixed clean)."""
    from .minimize.shrink import minimize

    loaded = _load(matrix)
    with err.status("minimizing") as status:
        summary = minimize(loaded, results_root, run_id, build, fixed=fixed, rep=rep, emit_pytest=emit_pytest,
                           confirm=confirm, violation=violation, on_line=lambda line: status.update(line[:120]))
    if as_json:
        _emit_json(summary.to_json())
    else:
        fails = (f"reads wrong KV ({summary.violation}) on {build} at request {summary.violation_at}"
                 if summary.violation else f"crashes {build} at request {summary.crash_at}")
        out.print(f"minimized: {summary.requests_before} -> [bold]{summary.requests}[/] requests, "
                  f"{summary.tokens_before} -> {summary.tokens} prompt tokens; {fails}"
                  + (f"; {fixed}: {summary.fixed_result}" if fixed else ""))
        if summary.first_violation:
            out.print(f"first violation: {escape(summary.first_violation)}")
        out.print(f"trace: {summary.trace}")
        if summary.emitted is not None:
            out.print(f"pytest: {summary.emitted.pytest} (drives vLLM's scheduler; imports vLLM and torch only)")
            for name, check in summary.emitted.pytest_check.items():
                out.print(f"  with build {name}'s vLLM: {escape(check.result)}")
        for line in summary.confirmed:
            out.print(f"  replay: {line}")
    if not summary.ok:
        raise typer.Exit(1)


# --- docker target commands (kvrepro/deploy/docker/cli.py) are wired below ---
try:
    from .deploy.docker import cli as _docker_cli

    app.add_typer(_docker_cli.hosts_app, name="hosts")
    app.add_typer(_docker_cli.images_app, name="images")
    app.command("clean")(_docker_cli.clean)
except ImportError:  # the docker extra is optional for the sim target
    pass


# --- known-defect suite (kvrepro/suite, docs/suite.md) ----------------------------------------

CatalogueOpt = typer.Option(None, "--catalogue", help="the folder of defect files (default: ./defects if there is one, else the shipped catalogue)")


def _catalogue(folder: Optional[Path]) -> Any:
    from .suite.run import load

    return load(folder)


@suite_app.command("list")
def suite_list(catalogue: Optional[Path] = CatalogueOpt, as_json: bool = JsonOpt) -> None:
    """Every catalogue entry: kind, signature, where present and fixed, the runs that measured it."""
    cat = _catalogue(catalogue)
    if as_json:
        _emit_json([{k: v for k, v in to_jsonable(e).items() if k != "fragment_yaml"} for e in cat.entries])
        return
    table = Table(title=f"{cat.folder}: {len(cat.entries)} known defects", title_justify="left")
    for col, width in (("entry", 26), ("kind", 10), ("present / fixed in", 28), ("measured", 9)):
        table.add_column(col, overflow="fold", max_width=width)
    for e in cat.entries:
        where = ("present: " + ", ".join(e.present_in) if e.present_in else "") + \
            ("\nfixed: " + ", ".join(e.fixed_in) if e.fixed_in else "")
        measured = "not testable" if not e.testable else (f"{len(e.reproduced)} run(s)" if e.reproduced else "no")
        table.add_row(f"{e.name}\n[dim]{escape(e.signature)}[/]", e.kind, where.strip(), measured)
    out.print(table)


def _suite_outputs(suite: Any, as_json: bool, ci: bool, junit: Optional[Path], reporting: bool = False) -> None:
    from .suite import report as suite_report

    if as_json:
        _emit_json(suite_report.as_json(suite))
    else:
        (_ci_console() if ci else out).print(suite_report.table(suite))
        for note in suite.notes:
            err.print(f"[yellow]note[/]: {escape(note)}", highlight=False)
        err.print(f"recorded: {suite.path}", highlight=False)
    if junit is not None:
        try:
            suite_report.write_junit(suite, junit)
            err.print(f"junit: {junit}", highlight=False)
        except OSError as exc:
            err.print("[red]error:[/] " + escape(redact(_junit_problem(junit, exc))), highlight=False)
            raise typer.Exit(3)
    for row in suite.mismatches:
        err.print(f"[red]differs from the catalogue[/]: {row.entry} on {row.build}: expected {row.expected}, "
                  f"got {row.state} ({escape(row.detail)})", highlight=False)
    code = suite_report.exit_code(suite, reporting)
    if code:
        raise typer.Exit(code)


@suite_app.command("run")
def suite_run(
    base: list[str] = typer.Option(..., "--base", help="a vLLM release to run every entry on (repeatable)"),
    patch: Optional[list[str]] = typer.Option(None, "--patch", help="a patch from matrix.yaml's patches: applied "
                                              "on every base, in order (repeatable)"),
    entry: Optional[list[str]] = typer.Option(None, "--entry", "-e", help="only these entries (repeatable)"),
    reps: Optional[int] = typer.Option(None, "--reps", min=1, max=1000, help="repetitions per entry and build "
                                       "(default: each entry's runs.repetitions)"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, max=64, help="engines at once (default: one "
                                       "per core, at most 4)"),
    catalogue: Optional[Path] = CatalogueOpt,
    target: Optional[str] = typer.Option(None, "--target", help="run every case on this target (sim, ray; "
                                                                "default: sim)"),
    ci: bool = typer.Option(False, "--ci", help="non-interactive: plain lines, no progress bars"),
    full_load: bool = typer.Option(False, "--full-load", help="send every run's whole load (runs.requests); by "
                                   "default a run ends once its verdict is settled (docs/statistics.md)"),
    junit: Optional[Path] = typer.Option(None, "--junit", help="also write JUnit XML here (one testcase per "
                                         "entry and build)"),
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Every catalogue entry on each build: PRESENT, ABSENT (path ran), UNREACHED, OTHER, NOT TESTABLE or
    INFRA, against what the catalogue expects. Exit codes as `matrix run --ci`."""
    import time as _time

    from .stopping import name, stop_on_signals
    from .suite.run import check_entries, parse_builds, run_suite

    _check_junit(junit)
    results_root = _results_root(results_root)
    cat = _catalogue(catalogue)
    chosen = cat.select(entry)
    builds_ = parse_builds(base, list(patch or []))
    matrices = check_entries(chosen, builds_, target)  # before the progress bar: bad input is one line
    total = sum(len(builds_) * (reps or m.matrix.runs.repetitions) for m in matrices.values())
    command = "kvrepro suite run " + " ".join(
        [f"--base {b}" for b in base] + [f"--patch {p}" for p in patch or []] + [f"--entry {e}" for e in entry or []]
        + ([f"--reps {reps}"] if reps else []) + ([f"--target {target}"] if target else [])
        + (["--full-load"] if full_load else []))
    stop = threading.Event()

    def on_first(signum: int) -> None:
        err.print(f"[yellow]{name(signum)}: stopping; engines are being stopped and finished runs recorded[/]")

    started = _time.monotonic()
    with stop_on_signals(stop, on_first):
        if ci:
            suite = run_suite(cat, chosen, builds_, results_root, reps, jobs, PlainProgress(total), stop, command,
                              target=target, full_load=full_load)
        else:
            progress = RichProgress(total)
            with progress.progress:
                suite = run_suite(cat, chosen, builds_, results_root, reps, jobs, progress, stop, command,
                                  target=target, full_load=full_load)
    err.print(f"wall time: {_time.monotonic() - started:.0f} s", highlight=False)
    _suite_outputs(suite, as_json, ci, junit)


@suite_app.command("report")
def suite_report_cmd(
    suite_dir: Path = typer.Argument(Path("latest"), help="a suite run folder (results/suite-...) or `latest`"),
    catalogue: Optional[Path] = CatalogueOpt,
    ci: bool = typer.Option(False, "--ci", help="plain, wide output"),
    junit: Optional[Path] = typer.Option(None, "--junit", help="write JUnit XML here"),
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Judge a recorded suite run again (against --catalogue, e.g. an edited copy); no engine runs."""
    from .suite.run import load_suite

    _check_junit(junit)
    _suite_outputs(load_suite(suite_dir, _catalogue(catalogue), results_root), as_json, ci, junit, reporting=True)


try:  # the click Typer parses with: its own copy (typer >= 0.2x), else click itself
    from typer._click.exceptions import ClickException as _ClickException
except ImportError:  # pragma: no cover - older typer
    from click.exceptions import ClickException as _ClickException
_CLICK_ERRORS = (_ClickException,)


def _usage_error(exc: Any) -> None:
    """A usage error (``--reps 0``, an unknown option) as one line and exit 2, as kvrepro's own
    bad-input errors are, instead of Typer's five-line box; `--help` still shows the usage."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # `kvrepro matrix`: the group's help, as before
        if exc.format_message():
            sys.stderr.write(exc.format_message() + "\n")
        sys.exit(exc.exit_code)
    ctx = getattr(exc, "ctx", None)
    where = f"{ctx.command_path}: " if ctx is not None else ""
    hint = f" (`{ctx.command_path} --help` shows the options)" if ctx is not None else ""
    err.print("[red]error:[/] " + escape(redact(f"{where}{exc.format_message()}{hint}")), highlight=False,
              soft_wrap=True)
    sys.exit(exc.exit_code)


@app.command("explore")
def explore_cmd(
    base: Optional[str] = typer.Option(None, "--base", help="the vLLM release to explore (e.g. 0.26.0)"),
    patch: Optional[list[str]] = typer.Option(None, "--patch", help="a patch from the matrix's patches: on the "
                                              "base, in order (repeatable)"),
    budget: Optional[str] = typer.Option(None, "--budget", help="runs (20) or run time (90s, 30m, 2h)"),
    seed: int = typer.Option(0, "--seed", help="the campaign's seed: same seed, same runs"),
    unguided: bool = typer.Option(False, "--unguided", help="uniform choices: no steering by coverage"),
    requests: int = typer.Option(200, "--requests", min=1, max=100000, help="request budget of each run"),
    resume: Optional[str] = typer.Option(None, "--resume", help="continue campaign ID (explore-...) or latest"),
    matrix: Path = typer.Option(None, "--matrix", "-m", help="the base matrix (default: the repository's matrix.yaml)"),
    catalogue: Optional[Path] = CatalogueOpt,
    ci: bool = typer.Option(False, "--ci", help="plain lines; exit 1 when a new (or regressed) failure is found"),
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Generated runs over loads, engine knobs and geometries, judged by every oracle; failures deduplicated
    against the catalogue, new ones written to findings/ (docs/explore.md)."""
    from .explore import CampaignRequest, load_campaign, new_campaign, parse_budget, run_campaign, summary
    from .explore.render import lines, run_line
    from .stopping import name, stop_on_signals

    results_root = _results_root(results_root)
    cat = _catalogue(catalogue)
    if resume:
        state, folder = load_campaign(results_root, resume)
        if budget:  # a new budget for the resumed campaign (the rest is pinned)
            runs_, seconds_ = parse_budget(budget)
            state.request = type(state.request)(**{**state.request.__dict__, "budget_runs": runs_,
                                                   "budget_seconds": seconds_})
    else:
        if not base or not budget:
            raise BadInputError("explore needs --base RELEASE and --budget RUNS|DURATION (or --resume ID)")
        runs_, seconds_ = parse_budget(budget)
        state, folder = new_campaign(results_root, CampaignRequest(
            base=base, patches=tuple(patch or ()), budget_runs=runs_, budget_seconds=seconds_, seed=seed,
            guided=not unguided, matrix=str(matrix) if matrix else "", requests=requests))
    err.print(f"campaign {state.campaign_id}: {folder}", highlight=False)
    stop = threading.Event()
    with stop_on_signals(stop, lambda signum: err.print(f"[yellow]{name(signum)}: stopping after this run[/]")):
        total = max(0, (state.request.budget_runs or 0) - len(state.runs))  # the runs this session makes
        progress = PlainProgress(total) if ci else RichProgress(total)
        show = (lambda r: _plain(run_line(r))) if ci else (lambda r: progress.progress.console.log(escape(run_line(r))))
        if ci:
            state = run_campaign(state, folder, cat, progress, stop, on_run=show)
        else:
            with progress.progress:
                state = run_campaign(state, folder, cat, progress, stop, on_run=show)
    if as_json:
        _emit_json(summary(state))
    else:
        for line in lines(state, str(folder)):
            out.print(escape(line), highlight=False, soft_wrap=True)
    if ci and state.new_findings:
        raise typer.Exit(1)
    if state.status == "interrupted":
        raise typer.Exit(130)


@app.command("triage")
def triage_cmd(
    log: Path = typer.Argument(..., help="a vLLM server log (plain or .gz; DP-prefixed, docker timestamps, ANSI ok)"),
    emit: Optional[Path] = typer.Option(None, "--emit", help="write a matrix.yaml reproducing the configuration "
                                        "(and its patches under builds/) into this new folder"),
    run: bool = typer.Option(False, "--run", help="run that matrix (--emit's folder, else one under --results) "
                                                  "and say what it proved"),
    release: Optional[str] = typer.Option(None, "--release", help="the vLLM release, when the log's banner is cut off"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, max=64, help="--run: engines at once"),
    catalogue: Optional[Path] = CatalogueOpt,
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Read a production log: the deployed configuration, the crash or stall, the known defects it
    matches (best first, with why and why not), their fixes and backports; --emit / --run reproduce it."""
    from .stopping import name, stop_on_signals
    from .triage import triage_file
    from .triage import render as triage_render

    cat = _catalogue(catalogue)
    found = triage_file(log, cat, release)
    if as_json and not run:
        _emit_json(triage_render.as_json(found))
    elif not as_json:
        for line in triage_render.plain(found):
            out.print(escape(line), highlight=False, soft_wrap=True)
    if emit is None and not run:
        return
    if not found.matches:
        if as_json:
            _emit_json(triage_render.as_json(found))
        err.print("nothing to reproduce: the failure matches no catalogue entry")
        raise typer.Exit(1)
    from .triage.emit import build_matrix, write_matrix
    from .triage.run import proofs, run_emitted, what_it_proved

    entry = next(e for e in cat.entries if e.name == found.best.entry)
    data, notes = build_matrix(found, entry, list(cat.entries), _target_of(found))
    folder = emit or (_results_root(results_root) / f"triage-{results.new_run_id()}")
    path = write_matrix(folder, data, found, entry, notes)
    err.print(f"wrote {path}", highlight=False)
    if not run:
        return
    stop = threading.Event()
    with stop_on_signals(stop, lambda signum: err.print(f"[yellow]{name(signum)}: stopping[/]")):
        progress = RichProgress(len(data["builds"]))
        with progress.progress:
            matrix_result = run_emitted(path, _results_root(results_root), progress, stop, jobs)
    items = proofs(matrix_result)
    if as_json:  # one document: the triage and what the run proved
        _emit_json({**triage_render.as_json(found), "run": matrix_result.run_id, "proofs": items})
    else:
        out.print(report.matrix_table(matrix_result))
        for line in what_it_proved(items):
            out.print(escape(line), highlight=False, soft_wrap=True)
    if not all(p.as_expected for p in items):
        raise typer.Exit(1)


def _target_of(found: Any) -> Optional[dict[str, str]]:
    """The emitted matrix's target_signature: the matched crash's, as its signature pattern names it."""
    from .classify import known_patterns

    if found.failure.kind != "crash" or not found.failure.pattern:
        return None
    pattern = next(p for p in known_patterns() if p.name == found.failure.pattern)
    return {"exception": pattern.exception, "function": pattern.function, "file": pattern.file,
            **({"expression": pattern.expressions[0]} if pattern.expressions else {})}


# --- vLLM's own tests on every build (kvrepro/builds/upstream_tests.py, docs/upstream-tests.md) ---

builds_app = typer.Typer(help="The matrix's builds (patched vLLM trees).", no_args_is_help=True)
app.add_typer(builds_app, name="builds")


@builds_app.command("test")
def builds_test(
    build: Optional[list[str]] = typer.Option(None, "--build", "-b", help="only these builds (repeatable)"),
    only: Optional[list[str]] = typer.Option(None, "--only", help="only these test files or node ids of the "
                                             "release (repeatable; the patches' tests always run)"),
    later: Optional[list[str]] = typer.Option(None, "--later", help="a newer release whose tests/ says whether "
                                              "upstream changed a test that differs (repeatable; default: every "
                                              "supported release after the base, read in order until one changed it)"),
    jobs: int = typer.Option(max(1, min(os.cpu_count() or 1, 4)), "--jobs", "-j", min=1, max=16,
                             help="pytest processes at once"),
    run_all: bool = typer.Option(False, "--all", help="every test on every build, not only those that reach a change"),
    matrix: Path = MatrixOpt,
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Run vLLM's own CPU-runnable tests (tests/v1/core, tests/v1/kv_connector/unit) and each patch's
    upstream tests on every build; report what passes, fails and is excluded, and which patch changed what."""
    from .builds import upstream_tests
    from .report import upstream_tests as upstream_report

    loaded = _load(matrix)
    plans = loaded.plans(build)
    patches = [loaded.patch_ref(name) for name in loaded.matrix.patches]
    releases = list(later) if later else upstream_tests.newer_releases(plans[0].base)
    command = "kvrepro builds test" + "".join(f" --build {b}" for b in build or []) + "".join(
        f" --only {o}" for o in only or []) + (" --all" if run_all else "")
    with err.status("vLLM's own tests") as status:
        runtime = builds.prepare_runtime(plans[0].base, on_line=lambda line: status.update(escape(line[:120])))
        run = upstream_tests.check_builds(plans, patches, runtime, workers=jobs, only=list(only or []),
                                          later_releases=releases, command=command, impact=not run_all,
                                          on_line=lambda line: err.print(escape(line[:160]), highlight=False))
    folder = upstream_report.write(run, _results_root(results_root))
    if as_json:
        _emit_json(run)
    else:
        out.print(upstream_report.markdown(run), markup=False, highlight=False, soft_wrap=True)
    err.print(f"recorded: {folder}", highlight=False)
    if upstream_report.regressions(run):  # exit 1, documented above
        raise typer.Exit(1)


def main() -> None:
    from . import scratch, stopping

    stopping.install_default()  # SIGINT, SIGTERM, SIGHUP: one line, exit 130 (kvrepro/stopping.py)
    try:
        code = app(standalone_mode=False)  # usage errors come here, to be one line (_usage_error)
        sys.exit(code if isinstance(code, int) else 0)
    except _CLICK_ERRORS as exc:
        _usage_error(exc)
    except KvreproError as exc:
        err.print("[red]error:[/] " + escape(redact(str(exc))), highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except ModuleNotFoundError as exc:
        # an environment installed before this checkout needed the package (aiohttp, prometheus_client
        # came with later versions): one line saying how to bring it up to date, not a traceback
        if not exc.name or exc.name.split(".")[0] == "kvrepro":
            raise
        err.print(f"[red]error:[/] the Python package {exc.name.split('.')[0]!r} is missing from this environment "
                  f"({sys.prefix}); it was probably set up for an older kvrepro: run "
                  f"`{sys.executable} -m pip install -e .` in the checkout", highlight=False, soft_wrap=True)
        sys.exit(3)
    except OSError as exc:  # a full or read-only disk, a folder where a file should be: one line
        err.print("[red]error:[/] " + escape(redact(describe_os_error(exc))), highlight=False, soft_wrap=True)
        sys.exit(3)
    except KeyboardInterrupt:
        if stopping.last_signal() is None:
            err.print("interrupted; finished runs are kept under results/")
        sys.exit(130)
    finally:
        stopping.ignore()  # engines are stopped by now; nothing may cut the cleanup short
        scratch.remove()  # the temp folder (zygote, vLLM's IPC sockets): kvrepro/scratch.py


if __name__ == "__main__":
    main()
