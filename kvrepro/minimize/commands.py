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
    from .upstream_emit import UPSTREAM_PATH

    loaded = _matrix_of(load_matrix(matrix), run_id, build, results_root)
    with err.status("minimizing") as status:
        summary = shrink(loaded, results_root, run_id, build, fixed=fixed, rep=rep, emit_pytest=emit_pytest,
                         confirm=confirm, violation=violation, on_line=lambda line: status.update(line[:120]))
    if as_json:
        terminal.emit_json(summary.to_json())
    else:
        fails = (f"reads wrong KV ({summary.violation}) on {build} at request {summary.violation_at}"
                 if summary.violation else f"stalls {build} (one request over half the pool after its failed load)"
                 if summary.failure == "stall" else f"crashes {build} at request {summary.crash_at}")
        out.print(f"minimized: {summary.requests_before} -> [bold]{summary.requests}[/] requests, "
                  f"{summary.tokens_before} -> {summary.tokens} prompt tokens; {fails}"
                  + (f"; {fixed}: {summary.fixed_result}" if fixed else ""))
        if summary.first_violation:
            out.print(f"first violation: {escape(summary.first_violation)}")
        out.print(f"trace: {summary.trace}")
        if summary.emitted is not None and summary.failure == "stall":
            out.print(f"pytest: {summary.emitted.pytest} (for vLLM's {UPSTREAM_PATH}: vLLM's test helpers and a mock "
                      "connector; run with vLLM's pytest from the release sdist)")
            for name, check in summary.emitted.pytest_check.items():
                out.print(f"  with build {name}'s vLLM: {escape(check.result)}")
        elif summary.emitted is not None:
            out.print(f"pytest: {summary.emitted.pytest} (drives vLLM's scheduler; imports vLLM and torch only)")
            for name, check in summary.emitted.pytest_check.items():
                out.print(f"  with build {name}'s vLLM: {escape(check.result)}")
        for line in summary.confirmed:
            out.print(f"  {'seen' if summary.failure == 'stall' else 'replay'}: {line}")
    return 0 if summary.ok else 1


def _matrix_of(loaded, run_id: str, build: str, results_root: Path):
    """``--matrix``, or, when it has no build ``build`` and the run recorded its own matrix (a suite
    run's build is its catalogue entry), the run's matrix with its patches read from ``--matrix``'s
    builds/ (the run folder holds none)."""
    from ..errors import BadInputError
    from ..matrix import parse_matrix
    from ..results.store import run_path

    if build.partition("@")[0] in loaded.matrix.builds:
        return loaded
    try:
        recorded = run_path(results_root, run_id) / "matrix.yaml"
    except BadInputError:  # no such run: the minimizer names it
        return loaded
    if not recorded.is_file():
        return loaded
    return parse_matrix(recorded.read_text(), loaded.path.parent / recorded.name)

