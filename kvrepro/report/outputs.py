"""The files a finished run leaves for people and CI: report.md/report.html, JUnit XML when asked,
$GITHUB_STEP_SUMMARY in CI mode; and the check of ``--junit`` before anything runs."""

from __future__ import annotations

import tempfile
from pathlib import Path

from rich.markup import escape

from ..errors import BadInputError, InfraError, describe_os_error
from ..results.store import MatrixRun, checked_root, load_run
from ..secrets import redact
from .terminal import emit_json, err, out


def junit_problem(path: Path, exc: OSError) -> str:
    return f"--junit {path}: cannot write it: {exc.strerror or exc}; give a path in a writable folder"


def check_junit(path: Path | None) -> None:
    """--junit checked before anything runs: a folder is bad input (2); a place that cannot be
    written (read-only, no permission) is the environment (3). Either way one line, no run spent."""
    if path is None:
        return
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
        raise InfraError(junit_problem(path, exc)) from None
    if path.exists() and not path.is_file():
        raise BadInputError(f"--junit {path}: not a regular file; give a file path")


def write_outputs(run: MatrixRun, junit_path: Path | None, ci: bool) -> bool:
    """report.md/report.html always, JUnit when asked, $GITHUB_STEP_SUMMARY in CI mode. A failure
    here is one line: the verdicts are recorded and the exit code must still say what they are.
    False when something was not written (the exit code then says infrastructure, 3, never 0)."""
    from .document import write_report
    from .render import append_step_summary

    ok = True
    try:
        md_path, html_path = write_report(run)
        err.print(f"report: {html_path} (markdown: {md_path.name})", highlight=False)
        if ci:
            summary = append_step_summary(md_path.read_text())
            if summary is not None:
                err.print(f"appended the report to $GITHUB_STEP_SUMMARY ({summary})", highlight=False)
    except OSError as exc:
        err.print("[red]error:[/] report not written: " + escape(redact(describe_os_error(exc))), highlight=False)
        ok = False
    except ValueError as exc:
        err.print(f"[red]error:[/] report not written: {escape(redact(str(exc)))}", highlight=False)
        ok = False
    if junit_path is not None:
        from .junit import write_junit

        try:
            write_junit(run, junit_path)
            err.print(f"junit: {junit_path}", highlight=False)
        except OSError as exc:
            err.print("[red]error:[/] " + escape(redact(junit_problem(junit_path, exc))), highlight=False)
            ok = False
    return ok


def write_recorded(run: MatrixRun, junit: Path | None) -> dict[str, str | None]:
    """`kvrepro report`: report.md/report.html (and JUnit: checked with :func:`check_junit` before
    the run is read) for a recorded run; where they went."""
    from .document import write_report
    from .junit import write_junit

    md_path, html_path = write_report(run)
    if junit is not None:
        try:
            write_junit(run, junit)
        except OSError as exc:
            raise InfraError(junit_problem(junit, exc)) from None
    return {"run_id": run.run_id, "markdown": str(md_path), "html": str(html_path),
            "junit": str(junit) if junit else None}


def show_run(run: MatrixRun, as_json: bool) -> None:
    """`results show RUN`: the verdict table and every repetition's folder (or all of it as JSON)."""
    from .render import build_key, matrix_table
    if as_json:
        emit_json({"info": run.info, "path": str(run.path),
                   "builds": [{"name": b.name, "base": b.base, "patches": b.patches, "expect": b.expect,
                               "build": b.build, "manifest": b.manifest, "runs": b.runs} for b in run.builds]})
        return
    out.print(matrix_table(run))
    for b in run.builds:
        for r in b.runs:
            out.print(f"  {build_key(run, b)}/{r.rep}: {r.run_dir}")


def show_runs(results_root: Path, as_json: bool) -> None:
    """`results list`: the table of recorded runs (or JSON); what it leaves out, said on stderr."""
    from ..results.index import omitted_notes, rows as indexed_rows
    from .tables import runs_table
    rows = indexed_rows(checked_root(results_root))  # results/.index.json: only changed runs are read
    if as_json:
        emit_json(rows)
    else:
        out.print(runs_table(rows, results_root, out.width))
    for note in omitted_notes(results_root, rows):  # on stderr, so --json stays a list
        err.print(f"note: {escape(note)}", highlight=False)


def show_comparison(results_root: Path, before: str, after: str, as_json: bool) -> None:
    """`results compare`: which verdicts changed between two recorded runs."""
    from .compare import compare, comparison_json
    from .tables import compare_table
    c = compare(load_run(results_root, before), load_run(results_root, after))
    if as_json:
        emit_json(comparison_json(c))
        return
    table, changed = compare_table(c)
    out.print(table)
    out.print(changed)


def report_recorded(results_root: Path, run_id: str, junit: Path | None, as_json: bool) -> None:
    """`kvrepro report`: write a recorded run's report (and JUnit) and say where."""
    check_junit(junit)
    written = write_recorded(load_run(results_root, run_id), junit)
    if as_json:
        emit_json(written)
    else:
        out.print("\n".join(p for p in (written["html"], written["markdown"], written["junit"]) if p), highlight=False)
