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
