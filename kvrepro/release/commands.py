"""The `kvrepro release ...` commands' work, called by kvrepro/cli.py (which only wires options)."""

from __future__ import annotations

import threading
from pathlib import Path

from rich.markup import escape

from ..report import terminal
from ..report.terminal import err, out


def port(release: str, requests: int, results_root: Path, ci: bool, as_json: bool) -> int:
    """`kvrepro release port X`: exit 0 runs without a code change, 1 a porting step is needed (named),
    2 bad input, 3 the wheel or the build could not be had, 130 interrupted."""
    from ..stopping import name, stop_on_signals
    from .port import check_release, run_port

    check_release(release)
    stop = threading.Event()

    def on_first(signum: int) -> None:
        err.print(f"[yellow]{name(signum)}: stopping; the engine is being stopped[/]")

    with stop_on_signals(stop, on_first):
        progress = terminal.progress_for(1, ci)
        with terminal.live(progress):
            result = run_port(release, requests, results_root, progress, stop,
                              on_line=lambda line: err.print(f"[dim]{escape(line)}[/]", highlight=False))
    if stop.is_set():
        return 130
    if as_json:
        terminal.emit_json(result.as_json())
    else:
        console = terminal.ci_console() if ci else out
        for line in result.lines():
            console.print(escape(line), highlight=False)
    if result.error and result.verdict is None:
        return 3
    return 0 if result.ported else 1


def check(release: str, budget: str, seed: int, repo: Path | None, jobs: int | None, reps: int | None,
          test_jobs: int, only: list[str] | None, skip: list[str] | None, catalogue: Path | None, ci: bool,
          junit: Path | None, results_root: Path, as_json: bool) -> int:
    """`kvrepro release check X`; the exit code of kvrepro.release.check.exit_code (2 bad input)."""
    import time

    from ..errors import BadInputError
    from ..results.store import checked_root, write_atomic
    from ..stopping import name, stop_on_signals
    from . import changes
    from .check import JUNIT, STAGES, check_options, exit_code, run_check

    check_options(release, budget, repo, junit)
    bad = [s for s in skip or [] if s not in STAGES or s == "fetch"]
    if bad:
        raise BadInputError(f"--skip {', '.join(bad)}: stages that can be skipped: {', '.join(STAGES[1:])}")
    results_root = checked_root(results_root)
    stop = threading.Event()

    def on_first(signum: int) -> None:
        err.print(f"[yellow]{name(signum)}: stopping; engines are being stopped and what finished is recorded[/]")

    started = time.monotonic()
    command = "kvrepro release check " + release + f" --budget {budget}" + (f" --repo {repo}" if repo else "") + \
        "".join(f" --skip {s}" for s in skip or [])

    def say(line: str) -> None:
        if ci:
            terminal.plain(line)
        else:
            err.print(f"[dim]{escape(line)}[/]", highlight=False)

    with stop_on_signals(stop, on_first):
        result = run_check(release, budget=budget, seed=seed, repo=repo, jobs=jobs, reps=reps, test_jobs=test_jobs,
                           only=list(only or []), catalogue_dir=catalogue, results_root=results_root,
                           skip=tuple(skip or ()), progress_for=lambda total: terminal.progress_for(total, ci),
                           stop=stop, say=say, command=command)
    if junit is not None:
        write_atomic(junit, changes.junit_xml(result))
        write_atomic(result.folder / JUNIT, changes.junit_xml(result))
    if as_json:
        terminal.emit_json(result.as_json())
    else:
        console = terminal.ci_console() if ci else out
        console.print((result.folder / "report.md").read_text(), markup=False, highlight=False, soft_wrap=True)
    err.print(f"recorded: {result.folder} ({time.monotonic() - started:.0f} s)", highlight=False)
    return exit_code(result)
