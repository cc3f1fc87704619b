"""One row per repetition: verdict, requests, evidence counters."""

from __future__ import annotations


from ...deploy import where_ran
from ...results.store import MatrixRun
from ..pages import Block, Cell, Heading, Table
from ..failures import first_failure
from ..render import TONE, count_text, state_text, build_key
from . import SectionContext

ORDER = 70
DETAILS = True


def _node_text(r) -> str:
    """Where the run ran (its target's words: ray's node and placement group), and the nodes lost
    before (the run was sent again)."""
    text = where_ran(r) or "-"
    if r.retried_after:
        text += f" (after {len(r.retried_after)} lost: {'; '.join(r.retried_after)})"
    return text


def stopped_text(r) -> str:
    """Why the run's load ended; a settled run says by which counts (the stopping rule's words)."""
    if r.load is None:
        return "-"
    if r.load.stopped_because == "settled" and r.load.settled_by:
        return f"settled: {r.load.settled_by}"
    return r.load.stopped_because


def _runs_blocks(run: MatrixRun) -> list[Block]:
    rows = []
    on_nodes = any(r.by_target or r.retried_after for b in run.builds for r in b.runs)
    for b in run.builds:
        for r in b.runs:
            first = first_failure(r)
            row = (build_key(run, b), str(r.rep), Cell(r.label, TONE.get(r.verdict.value, "")),
                   Cell(first.text() if first else "-", "bad" if first and first.failed else ""),
                   str(r.requests), f"{r.load_seconds:.1f}", str(r.trigger_count), state_text(r),
                   r.kv_check, count_text(r.offload_load_jobs), str(r.external_hit_calls), stopped_text(r))
            rows.append(row + ((_node_text(r),) if on_nodes else ()))
    if not rows:
        return []
    return [Heading(2, "Runs"), Table(
        ("build", "rep", "verdict", "first failure", "requests", "seconds under load", "trigger count", "bug state (groups)",
         "KV check", "offload loads", "offload-hit calls", "stopped because") + (("node",) if on_nodes else ()),
        tuple(rows), align="lrllrrrrlrrl" + ("l" if on_nodes else ""))]


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    return _runs_blocks(run)
