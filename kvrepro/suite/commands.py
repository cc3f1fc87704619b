"""The `kvrepro suite ...` commands' work, called by kvrepro/cli.py: list the catalogue, run it
(under the Ctrl-C rule of kvrepro/stopping.py), judge a recorded suite run again; the tables,
JUnit and exit codes of kvrepro/suite/report.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from rich.markup import escape

from ..report import stack, terminal
from ..report.outputs import check_junit, junit_problem
from ..report.terminal import err, out
from ..results.store import checked_root
from ..secrets import redact
from . import report as suite_report
from .run import check_entries, load as load_catalogue, load_suite, parse_builds, run_suite
from ..stopping import name, stop_on_signals


def list_entries(catalogue: Path | None, as_json: bool) -> None:
    cat = load_catalogue(catalogue)
    if as_json:
        terminal.emit_json(suite_report.entries_json(cat))
    else:
        out.print(suite_report.entries_table(cat))


def outputs(suite: Any, as_json: bool, ci: bool, junit: Path | None, reporting: bool = False) -> int:
    """The suite's table (or JSON), its JUnit file, what differs from the catalogue; the exit code."""
    if as_json:
        terminal.emit_json(suite_report.as_json(suite))
    else:
        (terminal.ci_console() if ci else out).print(suite_report.table(suite))
        for line in stack.lines(suite.introduced):  # --patch: what the stack brings (report/stack.py)
            (terminal.ci_console() if ci else out).print(escape(line), highlight=False, soft_wrap=True)
        for note in suite.notes:
            err.print(f"[yellow]note[/]: {escape(note)}", highlight=False)
        err.print(f"recorded: {suite.path}", highlight=False)
    if junit is not None:
        try:
            suite_report.write_junit(suite, junit)
            err.print(f"junit: {junit}", highlight=False)
        except OSError as exc:
            err.print("[red]error:[/] " + escape(redact(junit_problem(junit, exc))), highlight=False)
            return 3
    for row in suite.mismatches:
        err.print(f"[red]differs from the catalogue[/]: {row.entry} on {row.build}: expected {row.expected}, "
                  f"got {row.state} ({escape(row.detail)})", highlight=False)
    return suite_report.exit_code(suite, reporting)


def run(*, base: list[str], patch: list[str] | None, entry: list[str] | None, reps: int | None, jobs: int | None,
        catalogue: Path | None, target: str | None, ci: bool, full_load: bool, junit: Path | None,
        results_root: Path, as_json: bool) -> int:
    """`suite run` with its options, by name; the exit code."""
    bases, patches, entries = base, list(patch or []), entry
    check_junit(junit)
    results_root = checked_root(results_root)
    cat = load_catalogue(catalogue)
    chosen = cat.select(entries)
    builds_ = parse_builds(bases, patches)
    matrices = check_entries(chosen, builds_, target)  # before the progress bar: bad input is one line
    total = sum(len(m.matrix.bases) * m.matrix.runs.count(reps) for m in matrices.values())
    command = "kvrepro suite run " + " ".join(
        [f"--base {b}" for b in bases] + [f"--patch {p}" for p in patches] + [f"--entry {e}" for e in entries or []]
        + ([f"--reps {reps}"] if reps else []) + ([f"--target {target}"] if target else [])
        + (["--full-load"] if full_load else []))
    stop = threading.Event()

    def on_first(signum: int) -> None:
        err.print(f"[yellow]{name(signum)}: stopping; engines are being stopped and finished runs recorded[/]")

    started = time.monotonic()
    with stop_on_signals(stop, on_first):
        progress = terminal.progress_for(total, ci)
        with terminal.live(progress):
            suite = run_suite(cat, chosen, builds_, results_root, reps, jobs, progress, stop, command,
                              target=target, full_load=full_load)
    err.print(f"wall time: {time.monotonic() - started:.0f} s", highlight=False)
    return outputs(suite, as_json, ci, junit)


def report_again(suite_dir: Path, catalogue: Path | None, ci: bool, junit: Path | None, results_root: Path,
                 as_json: bool) -> int:
    check_junit(junit)
    return outputs(load_suite(suite_dir, load_catalogue(catalogue), results_root), as_json, ci, junit, reporting=True)
