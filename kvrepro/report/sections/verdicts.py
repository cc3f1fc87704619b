"""The verdict table: every build's verdicts, failure rate and evidence, and each crash title."""

from __future__ import annotations


from ...results.store import BuildResults, MatrixRun
from .. import stats
from ..expectations import meets_expectation
from ..failures import build_text, first_failures
from ..pages import Block, Cell, Para, Table
from ..render import TONE, summary_labels, crash_titles, build_key, rate_text, state_rate_text
from . import SectionContext

ORDER = 20
DETAILS = False


def _verdict_cell(b: BuildResults) -> Cell:
    text = summary_labels(b.runs)
    tones = {TONE.get(r.verdict.value, "") for r in b.runs}
    tone = tones.pop() if len(tones) == 1 else "warn"
    if b.expect and b.runs:
        ok = all(meets_expectation(r, b.expect) for r in b.runs)
        text += " ✓" if ok else " ✗ (expected " + b.expect + ")"
        tone = tone if ok else "bad"
    return Cell(text, tone)


def _first_failure_cell(b: BuildResults) -> Cell:
    """Where each run first failed, by kind (kvrepro/report/failures.py): red when any did."""
    failures = first_failures(b.runs)
    return Cell(build_text(failures), "bad" if any(f.failed for f in failures) else ("good" if failures else ""))


def _verdict_blocks(run: MatrixRun) -> list[Block]:
    rows = []
    for b in run.builds:
        r = stats.rate(b.runs)
        rows.append((
            b.base, Cell(b.build_name), " → ".join(b.patches) or "(base)", b.expect or "-", _verdict_cell(b),
            rate_text(r),
            _first_failure_cell(b),
            " / ".join(str(x.trigger_count) for x in b.runs) or "-",
            " / ".join(str(x.state_count) for x in b.runs) or "-",
            state_rate_text(stats.state_rate(b.runs)),
            " / ".join(x.kv_check for x in b.runs) or "-",
        ))
    blocks: list[Block] = [Table(
        ("base", "build", "patch stack", "expect", "verdicts", "failed = rate (95% CI, zero-event bound)",
         "first failure (request)", "trigger count", "bug state", "failures / 1,000 states (95% CI)", "KV check"),
        tuple(rows), align="lllllrlrrrl")]
    for b in run.builds:
        for title, n in crash_titles(b):
            blocks.append(Para(f"**{build_key(run, b)}**: `{title}`" + (f" ({n}x)" if n > 1 else "")))
    blocks.append(Para(
        "A run **fails** when it is CRASH or CORRUPT and **passes** when it SURVIVED; its first failure is its "
        "first wrong KV read or its crash, whichever came first; VACUOUS, UNREACHED, "
        "STALL, INFRA and INTERRUPTED prove nothing either way and are not counted. Intervals are exact "
        "(Clopper-Pearson) 95%; `<= x%` is the one-sided 95% upper bound 1 - 0.05^(1/n) when nothing failed."))
    return blocks


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    return _verdict_blocks(run)
