"""A bisection as a person reads it (terminal, report.md/html) and as a machine reads it (``--json``).

One table of the steps (:func:`step_rows`) feeds the terminal (:func:`bisection_table`, which
`kvrepro bisect ...` and `kvrepro results show <bisection>` print) and the page model
(:func:`bisection_blocks`, for :func:`kvrepro.report.document.write_report` or
:func:`write_bisection_report`); :func:`step_line` is the progress line of one decided step.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Group
from rich.markup import escape
from rich.table import Table as RichTable
from rich.text import Text

from ..records import to_jsonable
from .records import BisectResult, BisectStep
from ..results.store import write_atomic
from .pages import Block, Cell, Heading, Para, Table, to_html, to_markdown

COLUMNS = ("#", "role", "point", "verdict", "runs (verdict counts)", "good needs")
_TONE = {"good": "good", "bad": "bad", "skip": "warn"}


def _counts(step: BisectStep) -> str:
    return ", ".join(f"{n}x {label}" for label, n in step.counts.items())


def _verdict(step: BisectStep) -> str:
    return step.verdict.upper() + (f" ({step.state})" if step.state else "")


def step_rows(result: BisectResult) -> list[tuple[str, ...]]:
    """One row per step, in the order they were decided (the columns of :data:`COLUMNS`)."""
    return [(str(i), s.role, s.label, _verdict(s), _counts(s), str(s.runs_needed_for_good or "-"))
            for i, s in enumerate(result.steps, 1)]


def answer_lines(result: BisectResult) -> list[str]:
    """What was found (or why nothing was), the detail, and where it is recorded (plain text)."""
    if result.answer is not None:
        answer = ", ".join(result.answer) if isinstance(result.answer, list) else result.answer
        conf = f", confidence {result.confidence:.3f}" if result.confidence is not None else ""
        lines = [f"answer: {answer} (p_bad {result.p_bad}, alpha {result.alpha}{conf})"]
        lines += [f"  {key}: {value}" for key, value in result.detail.items()]
    else:
        lines = [f"no answer: {result.reason}"]
    return lines + [f"recorded: {result.path}"]


def title(result: BisectResult) -> str:
    return f"kvrepro bisect {result.kind} {result.bisection_id} ({result.status})"


def bisection_table(result: BisectResult) -> Group:
    """The terminal form: the steps' table, then the answer."""
    table = RichTable(title=title(result))
    for col in COLUMNS:
        table.add_column(col)
    for row in step_rows(result):
        table.add_row(*(escape(cell) for cell in row))
    lines = answer_lines(result)
    first = Text(lines[0], style="bold" if result.answer is not None else "")
    if result.answer is None:
        first = Text.assemble(("no answer", "yellow"), lines[0][len("no answer"):])
    return Group(table, first, *(Text(line) for line in lines[1:]))


def step_line(step: BisectStep) -> str:
    """One decided step, as the progress shows it (rich markup)."""
    state = f" ({step.state})" if step.state else ""
    return (f"[bold]{escape(step.role)} {escape(step.label)}: {step.verdict.upper()}{state}[/]  {escape(_counts(step))}"
            + (f"  [dim]{escape(step.reason)}[/]" if step.reason else ""))


def bisection_json(result: BisectResult) -> dict[str, object]:
    """``--json``: the answer and the reason first, then the steps and the rest of the record."""
    data = to_jsonable(result)
    ordered = {"answer": data.pop("answer"), "reason": data.pop("reason") or None, "steps": data.pop("steps")}
    ordered.update(data)
    return ordered


def bisection_blocks(result: BisectResult) -> list[Block]:
    """The page-model form (Markdown / HTML): the steps' table with each call toned, then the answer."""
    rows = tuple((r[0], r[1], Cell(r[2], code=True), Cell(r[3], _TONE.get(s.verdict, "")), r[4], r[5])
                 for r, s in zip(step_rows(result), result.steps))
    blocks: list[Block] = [Heading(2, "Bisection"), Table(COLUMNS, rows, align="rlllll")]
    lines = answer_lines(result)
    blocks.append(Para(f"**{lines[0]}**", tone="good" if result.answer is not None else "warn"))
    blocks += [Para(line.strip()) for line in lines[1:]]
    return blocks


def write_bisection_report(result: BisectResult, out_dir: Path) -> tuple[Path, Path]:
    """report.md and report.html of a bisection alone."""
    blocks: list[Block] = [Heading(1, title(result)), *bisection_blocks(result)]
    md_path, html_path = out_dir / "report.md", out_dir / "report.html"
    write_atomic(md_path, to_markdown(blocks))
    write_atomic(html_path, to_html(title(result), blocks))
    return md_path, html_path
