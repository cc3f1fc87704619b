"""`kvrepro minimize`'s work, called by kvrepro/cli.py: shrink a recorded trace and say what is left."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from ..report import terminal
from ..report.terminal import err, out


def minimize(run_id: str, build: str, *, fixed: str | None, rep: int | None, emit_pytest: Path | None,
             confirm: bool, violation: str | None, matrix: Path, results_root: Path, as_json: bool) -> int:
    from ..matrix import load_matrix
    from .shrink import minimize as shrink

    loaded = load_matrix(matrix)
    with err.status("minimizing") as status:
        summary = shrink(loaded, results_root, run_id, build, fixed=fixed, rep=rep, emit_pytest=emit_pytest,
                         confirm=confirm, violation=violation, on_line=lambda line: status.update(line[:120]))
    if as_json:
        terminal.emit_json(summary.to_json())
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
    return 0 if summary.ok else 1
