"""The matrix report as a document: its heading, then every section of kvrepro/report/sections/ in
order; written as report.md (fits a PR comment) and report.html (everything)."""

from __future__ import annotations

from pathlib import Path

from ..results.store import MatrixRun, write_atomic
from .expectations import mismatches
from .pages import Block, Heading, Para, to_html, to_markdown
from .render import REPORT_HTML, REPORT_MD
from .sections import SectionContext, known_sections

# GitHub refuses comments over 65,536 characters; past this the Markdown leaves out the per-run
# table and the tracebacks (report.html keeps them)
MARKDOWN_LIMIT = 60_000


def document(run: MatrixRun, out_dir: Path | None = None, bisection: list[Block] | None = None,
             details: bool = True) -> list[Block]:
    """The whole report as blocks; ``out_dir`` receives the PNG the Markdown links to."""
    info = run.info
    context = SectionContext(out_dir=out_dir, bisection=tuple(bisection or ()))
    problems = mismatches(run)
    expected = [b for b in run.builds if b.expect]
    blocks: list[Block] = [Heading(1, f"kvrepro {run.run_id}: vLLM {info.base_text}, target {info.target}, {run.status}")]
    if problems:
        blocks.append(Para(f"**{len(problems)} verdict(s) differ from `expect:`**: "
                           + "; ".join(str(p) for p in problems), tone="bad"))
    elif expected:
        blocks.append(Para("**Every verdict as `expect:` says.**", tone="good"))
    if run.status != "complete":
        why = f" ({info.error})" if info.error else ""
        blocks.append(Para(f"The run is **{run.status}**{why}: only the repetitions that finished are shown.",
                           tone="warn"))
    left_out = []
    for section in known_sections():
        if section.DETAILS and not details:
            left_out.append(section)
            continue
        blocks += section.blocks(run, context)
    if left_out:
        blocks.append(Para(f"(tracebacks and the per-run table are left out to fit a PR comment: see "
                           f"`{REPORT_HTML}`)"))
    return blocks


def write_report(run: MatrixRun, bisection: list[Block] | None = None) -> tuple[Path, Path]:
    """Write report.md (+ survival.png it links to) and report.html into the run's folder."""
    blocks = document(run, run.path, bisection)
    md_path, html_path = run.path / REPORT_MD, run.path / REPORT_HTML
    markdown = to_markdown(blocks)
    if len(markdown) > MARKDOWN_LIMIT:
        markdown = to_markdown(document(run, run.path, bisection, details=False))
    write_atomic(md_path, markdown)
    write_atomic(html_path, to_html(f"kvrepro {run.run_id}", blocks))
    return md_path, html_path


