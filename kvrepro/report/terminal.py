"""What the `kvrepro` command shows while it works: its two consoles, progress (rich bars, or one
plain line per event with ``--ci``), and ``--json`` output. Every stage's command functions print
through these, so output, redaction and progress look the same whichever command runs.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..records import RunResult, to_jsonable
from .records import BisectStep
from ..secrets import redact, redact_value

# log_path=False: a progress line ends in what it says, not in the logger's source position (terminal.py:40)
out = Console(log_path=False)
err = Console(stderr=True, log_path=False)


def emit_json(value: Any) -> None:
    # one redaction for everything kvrepro hands on, --json included
    # each string redacted before it is JSON-escaped (a secret holding a quote or a non-ASCII
    # character is not found in the escaped text), then the text as a whole
    sys.stdout.write(redact(json.dumps(redact_value(to_jsonable(value)), indent=2)) + "\n")


def plain(text: str) -> None:
    sys.stderr.write(redact(text) + "\n")
    sys.stderr.flush()


def note(text: str) -> None:
    err.print(f"[yellow]note[/]: {escape(text)}", highlight=False)


def error_line(text: str) -> None:
    err.print("[red]error:[/] " + escape(redact(text)), highlight=False, soft_wrap=True)


def ci_console() -> Console:
    """A wide, colourless console: CI logs are read as text, and wrapped table cells are unreadable."""
    return Console(width=200, color_system=None, force_terminal=False, soft_wrap=False)


def run_line(result: RunResult) -> str:
    return redact(f"build {result.build} rep {result.rep}: {result.label}  trigger={result.trigger_count} "
            f"state={result.state_count} kv={result.kv_check} requests={result.requests} {result.seconds:.1f}s  "
            f"{result.title}" + (f"  [stopped: {result.load.stopped_because}]" if result.load is not None else ""))


class RichProgress:
    """Shows builds, runs and each running engine's requests (on stderr, so --json stays clean)."""

    def __init__(self, total_runs: int | None):  # None: not known ahead (a duration budget)
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
        self.progress.console.log(run_line(result))


class PlainProgress:
    """--ci: one plain line per stage and per finished run on stderr; no bars, no live display."""

    def __init__(self, total_runs: int | None):  # None: not known ahead (a duration budget)
        self.total = total_runs
        self.done = 0

    def stage(self, text: str) -> None:
        plain(text)

    def detail(self, text: str) -> None:
        pass  # setup chatter (pip, patch output) would drown the lines that matter in a CI log

    def run_started(self, build: str, rep: int, budget: int | None) -> None:
        plain(f"build {build} rep {rep}: started")

    def requests_done(self, build: str, rep: int, done: int, failed: int) -> None:
        pass

    def run_finished(self, result: RunResult) -> None:
        self.done += 1
        plain(f"[{self.done}{'' if self.total is None else f'/{self.total}'}] " + run_line(result))


def progress_for(total_runs: int | None, ci: bool) -> RichProgress | PlainProgress:
    return PlainProgress(total_runs) if ci else RichProgress(total_runs)


class BisectProgress(RichProgress):
    """Runs as they finish, and one line per decided step (stderr; --json stays clean)."""

    def __init__(self) -> None:  # noqa: D107 - how many runs a bisection takes is not known ahead
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed} done"),
                                 TimeElapsedColumn(), console=err, transient=False)
        self.runs = self.progress.add_task("runs", total=None)
        self.active: dict[tuple[str, int], Any] = {}

    def step(self, step: BisectStep) -> None:
        from .bisection import step_line

        self.progress.console.log(step_line(step))


def live(progress: RichProgress | PlainProgress) -> Any:
    """The context a progress display runs in: rich's live bars, or nothing for plain lines."""
    import contextlib

    return progress.progress if isinstance(progress, RichProgress) else contextlib.nullcontext()


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


def run_program(app: Any) -> None:
    """The `kvrepro` program around its Typer ``app``: every error is one line and its exit code
    (kvrepro/errors.py; usage errors 2, an environment without a package 3), signals stop it the
    way kvrepro/stopping.py says, and the temp folder goes whatever happens. Exits."""
    from .. import scratch, stopping
    from ..errors import KvreproError, describe_os_error

    try:  # the click Typer parses with: its own copy (typer >= 0.2x), else click itself
        from typer._click.exceptions import ClickException
    except ImportError:  # pragma: no cover - older typer
        from click.exceptions import ClickException

    stopping.install_default()  # SIGINT, SIGTERM, SIGHUP: one line, exit 130 (kvrepro/stopping.py)
    try:
        try:
            code = app(standalone_mode=False)  # usage errors come here, to be one line (_usage_error)
        except Exception:
            # a stop signal's Interrupted raised inside a library's callback may come out as the
            # library's own error (pydantic-core building a validator: SchemaError): stopped is stopped
            if stopping.last_signal() is None:
                raise
            code = stopping.EXIT_CODE
        sys.exit(stopping.exit_code(code if isinstance(code, int) else 0))
    except ClickException as exc:
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


def show(as_json: bool, value: Any, *shown: Any, highlight: bool | None = None) -> None:
    """A command's answer: ``value`` as JSON with ``--json``, else each of ``shown`` (rich markup or
    a renderable such as a table) on stdout."""
    if as_json:
        emit_json(value)
        return
    for item in shown:
        out.print(item, highlight=highlight)
