"""The `kvrepro` command: wires the pipeline stages to commands. No stage logic lives here: each
command's work is a function of its stage (``kvrepro/<stage>/commands.py`` and the like), called
with the parsed options; output goes through kvrepro/report/terminal.py. Where a command's only
statement is ``stage.function(**locals())`` its options reach the stage by name: a new option
here is a parameter of the same name there.

Exit codes: 0 done (and every verdict as `expect:` says, when it says); 1 a verdict differs from
`expect:` (`builds test`: a build fails a vLLM test that passes on the release); 2 bad input
(matrix.yaml, arguments); 3 infrastructure (setup, build or engine start
failed); 130 interrupted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import typer

from .deploy import known_targets, target_commands
from .report.terminal import err, run_program, show
from .results import store as results


class _LazyModule:
    """A stage's command module, imported when its command runs: `kvrepro results list` must not
    pay for pydantic, scipy and the rest that `matrix run` needs (start-up time)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        import importlib

        return getattr(importlib.import_module(self._name), attr)


bisect_commands = _LazyModule("kvrepro.bisect.commands")
explore_commands = _LazyModule("kvrepro.explore.commands")
matrix_commands = _LazyModule("kvrepro.matrix.commands")
minimize_commands = _LazyModule("kvrepro.minimize.commands")
suite_commands = _LazyModule("kvrepro.suite.commands")
report_outputs = _LazyModule("kvrepro.report.outputs")
triage_commands = _LazyModule("kvrepro.triage.commands")
release_commands = _LazyModule("kvrepro.release.commands")


def load_matrix(path: Path) -> Any:
    from .matrix import load_matrix as load

    return load(path)


def _exit(code: int) -> None:
    if code:
        raise typer.Exit(code)


# `kvrepro --help` lists commands in the order of the work, whatever order they are defined in
COMMAND_ORDER = ("setup", "init", "matrix", "suite", "release", "bisect", "minimize", "triage", "explore", "results", "report",
                 "classify", "signatures", "load", "engine", "hosts", "images", "clean")


class _InWorkOrder(typer.core.TyperGroup):
    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda n: rank.get(n, len(COMMAND_ORDER)))  # stable: new ones last, as added


app = typer.Typer(help="Reproduce vLLM engine crashes and prove which fixes cure them.", cls=_InWorkOrder,
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _group(name: str, help: str) -> typer.Typer:
    group = typer.Typer(help=help, no_args_is_help=True)
    app.add_typer(group, name=name)
    return group


matrix_app = _group("matrix", "Validate, plan, run and show build matrices.")
bisect_app = _group("bisect", "Find the release, commit or patch that brought a crash in or took it away.")
engine_app = _group("engine", "The GPU-free engine.")
results_app = _group("results", "Recorded runs under results/.")
load_app = _group("load", "Request traces: replay what a run sent.")
suite_app = _group("suite", "The known-defect suite: defects/ against releases and patch stacks.")

MatrixOpt = typer.Option(Path("matrix.yaml"), "--matrix", "-m", help="the experiment file")
JsonOpt = typer.Option(False, "--json", help="print machine-readable JSON on stdout")
ResultsOpt = typer.Option(results.DEFAULT_ROOT, "--results", help="where runs are recorded")
TARGETS = ", ".join(known_targets())  # kvrepro/deploy/: one module or package per target


@matrix_app.command("validate")
def matrix_validate(matrix: Path = MatrixOpt, as_json: bool = JsonOpt) -> None:
    """Check matrix.yaml without starting anything: fields, duplicate keys, patch files and their
    sha256, target, load profile, model, engine.geometry (block_size, offload_chunk_tokens,
    mamba_groups, full_attention_groups, num_speculative_tokens, data_parallel_size: printed as
    the KV groups vLLM will form) and engine.extra_args (against the base's `vllm serve`)."""
    matrix_commands.validate(matrix, as_json)


@matrix_app.command("plan")
def matrix_plan(matrix: Path = MatrixOpt, target: Optional[str] = typer.Option(None, help=TARGETS),
                as_json: bool = JsonOpt) -> None:
    """What would be built and run, without building or running anything."""
    matrix_commands.plan(matrix, target, as_json)


@matrix_app.command("run")
def matrix_run(
    matrix: Path = MatrixOpt,
    target: Optional[str] = typer.Option(None, help=f"override matrix.yaml's target ({TARGETS})"),
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
    _exit(matrix_commands.run(**locals()))


@app.command("report")
def report_cmd(
    run_id: str = typer.Argument("latest", help="a run id under --results, `latest`, or a run folder"),
    junit: Optional[Path] = typer.Option(None, "--junit", help="also write JUnit XML here"),
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Write results/<run>/report.md and report.html (self-contained) for a recorded run."""
    report_outputs.report_recorded(results_root, run_id, junit, as_json)


@matrix_app.command("show")
def matrix_show(run_id: str = typer.Argument("latest"), results_root: Path = ResultsOpt,
                as_json: bool = JsonOpt) -> None:
    """The verdict table of a recorded run (default: the latest)."""
    matrix_commands.show(run_id, results_root, as_json)


@results_app.command("list")
def results_list(results_root: Path = ResultsOpt, as_json: bool = JsonOpt) -> None:
    """Every recorded run, oldest first (a folder another kvrepro wrote is listed with why it is unreadable)."""
    report_outputs.show_runs(results_root, as_json)


@results_app.command("show")
def results_show(run_id: str = typer.Argument("latest"), results_root: Path = ResultsOpt,
                 as_json: bool = JsonOpt) -> None:
    """Everything recorded for one run (or one bisection)."""
    if not bisect_commands.show_recorded(results_root, run_id, as_json):
        report_outputs.show_run(results.load_run(results_root, run_id), as_json)


@results_app.command("compare")
def results_compare(before: str = typer.Argument(..., help="the earlier run (id, `latest` or folder)"),
                    after: str = typer.Argument(..., help="the later run"),
                    results_root: Path = ResultsOpt, as_json: bool = JsonOpt) -> None:
    """Which verdicts changed between two runs (e.g. the same matrix on two vLLM releases)."""
    report_outputs.show_comparison(results_root, before, after, as_json)


@app.command("classify")
def classify_cmd(
    log: Path = typer.Argument(..., help="an engine log (engine.log, `docker logs` output, vllm serve output)"),
    source: Optional[Path] = typer.Option(None, "--source", help="a folder holding the build's vllm/ sources"),
    matrix: Optional[Path] = typer.Option(None, "--matrix", "-m",
                                          help="take target_signature from this matrix (default: the shipped matrix.yaml's)"),
    as_json: bool = JsonOpt,
) -> None:
    """Find the fatal traceback in an engine log and name its crash signature."""
    from rich.markup import escape

    from .classify.commands import check_log_arguments, classify_command
    from .spec.matrix import default_target_signature

    check_log_arguments(log, source)
    target = load_matrix(matrix).matrix.target_signature if matrix else default_target_signature()
    found = classify_command(log, source, target)
    for notice in found.notices:  # one line each, whatever the terminal's width
        err.print("[yellow]note[/]: " + escape(notice), highlight=False, soft_wrap=True)
    show(as_json, found.as_json, *found.lines())


@app.command("signatures")
def signatures_cmd(as_json: bool = JsonOpt) -> None:
    """List the known crash and corruption signatures (the names `expect:` and reports use)."""
    from .classify.commands import signature_rows
    from .report.tables import signatures_table

    rows = signature_rows()
    show(as_json, rows, signatures_table(rows))


@app.command("setup")
def setup_cmd(matrix: Path = MatrixOpt, as_json: bool = JsonOpt) -> None:
    """Download the base wheel, create the runtime env and build every overlay (idempotent)."""
    from .builds import setup_lines, setup_matrix

    loaded = load_matrix(matrix)
    with err.status("setting up") as status:
        done = setup_matrix(loaded, on_line=lambda line: status.update(line[:120]))
    show(as_json, done, *setup_lines(done))
    failed = [name for name, b in done["builds"].items() if not b["ok"]]
    if failed:  # a build whose patch does not apply is not set up: infrastructure, exit 3 (never 0)
        err.print(f"[red]error:[/] {len(failed)} of {len(done['builds'])} build(s) not built ({', '.join(failed)}); "
                  "fix their patches (the lines above say which did not apply) and run setup again",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(3)


@app.command("init")
def init_cmd(folder: Path = typer.Argument(Path("."), help="where to write it (made if missing)"),
             defects: bool = typer.Option(False, "--defects", help="also copy the known-defect catalogue into "
                                          "FOLDER/defects, to edit or extend (it then replaces the shipped one)"),
             force: bool = typer.Option(False, "--force", help="overwrite files that are already there"),
             as_json: bool = JsonOpt) -> None:
    """Write a starter project: the default matrix.yaml and its patches under builds/."""
    from .spec.starter import summary_lines, write_starter

    project = write_starter(folder, with_catalogue=defects, force=force)
    show(as_json, project, *summary_lines(project), highlight=False)


@engine_app.command("serve")
def engine_serve(
    build: str = typer.Option(..., "--build", "-b", help="which build of the matrix to serve"),
    port: int = typer.Option(8000, "--port", "-p", min=1, max=65535),
    matrix: Path = MatrixOpt,
    rep: int = typer.Option(0, help="repetition number (selects the seed)"),
) -> None:
    """Serve one build with vLLM's own `vllm serve`, GPU-free, on 127.0.0.1 until stopped (Ctrl-C)."""
    from .deploy.sim import serve_build

    raise typer.Exit(serve_build(load_matrix(matrix), build, port, rep, say=err.print, status=err.status))


AlphaOpt = typer.Option(0.05, "--alpha", min=0.0001, max=0.5,
                        help="a good point must be this unlikely to be a crashing one that stayed clean")
CalibrateOpt = typer.Option(3, "--calibrate", min=1, max=100, help="runs at the bad end (they measure the crash rate)")
MaxRunsOpt = typer.Option(None, "--max-runs", min=1, max=1000, help="runs after which an undecided point is a skip "
                                                           "(default: 3 x the runs a good verdict needs + 6)")
RequestsOpt = typer.Option(None, "--requests", min=1, max=1_000_000, help="override runs.requests for every probe")
TitleOpt = typer.Option(None, "--title", help="bisect this crash (title text) instead of target_signature")
TargetOpt = typer.Option(None, "--target", help=f"override matrix.yaml's target ({TARGETS})")
JobsOpt = typer.Option(None, "--jobs", "-j", min=1, max=256, help="engines at once")
ResumeOpt = typer.Option(None, "--resume", help="continue an interrupted bisection (its id, or `latest`)")


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
    _exit(bisect_commands.bisect_command("releases", locals()))


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
    _exit(bisect_commands.bisect_command("commits", locals()))


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
    _exit(bisect_commands.bisect_command("patches", locals()))


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
    _exit(bisect_commands.verdict_command(locals()))


@load_app.command("replay")
def load_replay(
    trace: Path = typer.Argument(..., help="a trace.jsonl (results/<run>/<build>/<rep>/trace.jsonl)"),
    build: str = typer.Option(..., "--build", "-b", help="the build to replay it against"),
    matrix: Path = MatrixOpt,
    target: Optional[str] = typer.Option(None, help=f"override matrix.yaml's target ({TARGETS})"),
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Send a recorded trace again, one request at a time, and give the verdict and the request it
    crashed at (deterministic on the GPU-free engine). Exit 0 whatever the verdict; 2 bad trace."""
    _exit(matrix_commands.replay(trace, build, matrix, target, results_root, as_json))


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
    _exit(minimize_commands.minimize(**locals()))


for name, command in target_commands():  # each target's own (kvrepro/deploy/<target>/cli.py: COMMANDS)
    app.add_typer(command, name=name) if isinstance(command, typer.Typer) else app.command(name)(command)


# --- known-defect suite (kvrepro/suite, docs/suite.md) ----------------------------------------

CatalogueOpt = typer.Option(None, "--catalogue", help="the folder of defect files (default: ./defects if there is one, else the shipped catalogue)")


@suite_app.command("list")
def suite_list(catalogue: Optional[Path] = CatalogueOpt, as_json: bool = JsonOpt) -> None:
    """Every catalogue entry: kind, signature, where present and fixed, the runs that measured it."""
    suite_commands.list_entries(catalogue, as_json)


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
    target: Optional[str] = typer.Option(None, "--target", help=f"run every case on this target ({TARGETS}; "
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
    _exit(suite_commands.run(**locals()))


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
    _exit(suite_commands.report_again(suite_dir, catalogue, ci, junit, results_root, as_json))


@app.command("explore")
def explore_cmd(
    base: Optional[str] = typer.Option(None, "--base", help="the vLLM release to explore (e.g. 0.26.0)"),
    patch: Optional[list[str]] = typer.Option(None, "--patch", help="a patch from the matrix's patches: on the "
                                              "base, in order (repeatable)"),
    budget: Optional[str] = typer.Option(None, "--budget", help="runs (20) or run time (90s, 30m, 2h, 1d); "
                                         "on --resume, the campaign's whole budget"),
    seed: int = typer.Option(0, "--seed", help="the campaign's seed: same seed, same runs"),
    unguided: bool = typer.Option(False, "--unguided", help="uniform choices: no steering by coverage"),
    no_corpus: bool = typer.Option(False, "--no-corpus", help="guided, without replaying the catalogue's entries first"),
    no_minimize: bool = typer.Option(False, "--no-minimize", help="keep new findings' traces as recorded: no "
                                     "minimized trace, no emitted pytest"),
    requests: int = typer.Option(200, "--requests", min=1, max=100000, help="request budget of each run"),
    replay_share: Optional[float] = typer.Option(
        None, "--replay-share", min=0.0, max=10.0, help="with --patch: each failing run is replayed on the base "
        "without the patches (and with them again) to tell the patch's failures from the base's; the replays "
        "take at most this share of the budget, on top of it (default 0.5; 0: none, every failure undecided)"),
    resume: Optional[str] = typer.Option(None, "--resume", help="continue campaign ID (explore-...) or latest"),
    target: Optional[str] = TargetOpt, jobs: Optional[int] = JobsOpt,  # ray: runs as Ray tasks (docs/explore.md)
    matrix: Path = typer.Option(None, "--matrix", "-m", help="the base matrix (default: the repository's matrix.yaml)"),
    catalogue: Optional[Path] = CatalogueOpt,
    ci: bool = typer.Option(False, "--ci", help="plain lines; exit 1 when a new (or regressed) failure is found "
                            "(with --patch: one the patches introduce, the base not showing it)"),
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Generated runs over loads, engine knobs and geometries, judged by every oracle; failures deduplicated
    against the catalogue, new ones written to findings/ (docs/explore.md)."""
    _exit(explore_commands.explore(**locals()))


@app.command("triage")
def triage_cmd(
    log: Path = typer.Argument(..., help="a vLLM server log (plain, .gz, .bz2, .xz, .zst, UTF-16; - for a pipe; "
                                         "DP-prefixed, docker timestamps, ANSI ok) or the text a report pasted "
                                         "(a partial traceback, a command, collect_env)"),
    emit: Optional[Path] = typer.Option(None, "--emit", help="write a matrix.yaml reproducing the configuration "
                                        "(and its patches under builds/) into this new folder"),
    run: bool = typer.Option(False, "--run", help="run that matrix (--emit's folder, else one under --results) "
                                                  "and say what it proved"),
    release: Optional[str] = typer.Option(None, "--release", help="the vLLM release, when the log does not say it "
                                          "(or says it wrong)"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, max=64, help="--run: engines at once"),
    catalogue: Optional[Path] = CatalogueOpt,
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Read a production log or a pasted report: the deployed configuration (each part's line, or not
    in the log), the crash or stall, the known defects it matches (best first, with why and why not;
    a tie said), their fixes and backports; --emit / --run reproduce it. Only what is not text is refused."""
    _exit(triage_commands.triage(**locals()))


builds_app = _group("builds", "The matrix's builds (patched vLLM trees).")


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
    target: Optional[str] = typer.Option(None, "--target", help="ray: each build's pytest job as a Ray task on "
                                         "the cluster of ray: (default: the matrix's target: if ray, else here)"),
    matrix: Path = MatrixOpt,
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Run vLLM's own CPU-runnable tests (tests/v1/core, tests/v1/kv_connector/unit) and each patch's
    upstream tests on every build; report what passes, fails and is excluded, and which patch changed what."""
    from .report.upstream_tests import run_builds_test

    _exit(run_builds_test(load_matrix(matrix), build, list(only or []), list(later or []), jobs, results_root,
                          as_json, run_all, target))


release_app = _group("release", "Release day: validate a new vLLM release; try a later one without a code change.")


@release_app.command("port")
def release_port(
    release: str = typer.Argument(..., help="a vLLM release: one of kvrepro/versions.py, or a newer one (unported)"),
    requests: int = typer.Option(100, "--requests", min=1, max=100000, help="requests of the one run"),
    ci: bool = typer.Option(False, "--ci", help="plain lines, no progress bars"),
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """The porting checklist of kvrepro/versions.py as a command: fetch the wheel, read it against the table,
    run it once with the settings it gets; name what it needs (a new worker RPC, a platform check, an
    executor interface, a renamed identifier in a signature) with the vLLM file:line, and the table entry.
    Exit 0 it runs without a code change, 1 it needs a porting step, 2 bad input, 3 no wheel."""
    _exit(release_commands.port(**locals()))


@release_app.command("check")
def release_check(
    release: str = typer.Argument(..., help="the vLLM release that landed (a known one, or a newer one: unported)"),
    budget: str = typer.Option("5m", "--budget", help="the explore campaign's budget: runs (20) or time (5m)"),
    seed: int = typer.Option(0, "--seed", help="the explore campaign's seed"),
    repo: Optional[Path] = typer.Option(None, "--repo", help="a vLLM git checkout: bisect each changed crash or "
                                        "corruption verdict to the commit"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, max=64, help="engines at once in the suite"),
    reps: Optional[int] = typer.Option(None, "--reps", min=1, max=1000, help="suite repetitions per entry and build"),
    test_jobs: int = typer.Option(2, "--test-jobs", min=1, max=16, help="pytest processes at once"),
    only: Optional[list[str]] = typer.Option(None, "--only", help="only these test files or node ids of the release"),
    skip: Optional[list[str]] = typer.Option(None, "--skip", help="skip a stage: port, suite, tests, explore, bisect"),
    catalogue: Optional[Path] = CatalogueOpt,
    ci: bool = typer.Option(False, "--ci", help="plain lines, no progress bars"),
    junit: Optional[Path] = typer.Option(None, "--junit", help="also write JUnit XML here"),
    results_root: Path = ResultsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """The release-day pipeline: fetch the wheel and sdist, port check, the whole suite on the release with
    the previous one beside it, the release's own unit tests with each catalogue entry's upstream tests, an
    explore campaign, and what changed since the previous release (bisected with --repo). Exit 0 nothing
    changed that needs a person, 1 something does (a row differs from the catalogue, a porting step, a new
    finding, a test regression), 2 bad input, 3 a stage could not run, 130 interrupted."""
    _exit(release_commands.check(**locals()))


def main() -> None:
    run_program(app)  # one line and an exit code per error, signals as kvrepro/stopping.py says


if __name__ == "__main__":
    main()
