"""One row per repetition: verdict, requests, evidence counters."""

from __future__ import annotations


from ...results.store import MatrixRun
from ..pages import Block, Cell, Heading, Table
from ..render import TONE, count_text, state_text, build_key
from . import SectionContext

ORDER = 70
DETAILS = True


def _runs_blocks(run: MatrixRun) -> list[Block]:
    rows = []
    for b in run.builds:
        for r in b.runs:
            rows.append((build_key(run, b), str(r.rep), Cell(r.label, TONE.get(r.verdict.value, "")),
                         str(r.requests), f"{r.load_seconds:.1f}", str(r.trigger_count), state_text(r),
                         r.kv_check, count_text(r.offload_load_jobs), str(r.external_hit_calls)))
    if not rows:
        return []
    return [Heading(2, "Runs"), Table(
        ("build", "rep", "verdict", "requests", "seconds under load", "trigger count", "bug state (groups)",
         "KV check", "offload loads", "offload-hit calls"), tuple(rows), align="lrlrrrrlrr")]


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    return _runs_blocks(run)
