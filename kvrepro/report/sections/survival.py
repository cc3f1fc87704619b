"""Time to first failure (a crash or a wrong KV read) per build: Kaplan-Meier curves with each
failure's kind marked, and every repetition on its build's row (kvrepro/report/plots.py)."""

from __future__ import annotations

from pathlib import Path

from ...results.store import MatrixRun, write_atomic
from ..pages import Block, Heading, Image, Para
from ..render import MIN_TIMED_RUNS, NOT_TIMED, SURVIVAL_PNG, build_key
from . import SectionContext

ORDER = 50
DETAILS = False
HEADING = "Time to first failure"


def _survival_blocks(run: MatrixRun, out_dir: Path | None) -> list[Block]:
    timed = max((sum(r.verdict not in NOT_TIMED for r in b.runs) for b in run.builds), default=0)
    if timed == 0:
        return []
    if timed < MIN_TIMED_RUNS:
        return [Heading(2, HEADING),
                Para(f"No curve: a build needs {MIN_TIMED_RUNS} timed runs (repetitions) for one, and every "
                     "build here has one; where each run first failed is in the verdict table.")]
    from ..plots import failure_curve, failure_figure

    curves = [c for c in (failure_curve(build_key(run, b), list(b.runs)) for b in run.builds) if c is not None]
    if not curves:
        return []
    svg, png = failure_figure(curves)
    if out_dir is not None:
        write_atomic(out_dir / SURVIVAL_PNG, png)
    return [Heading(2, HEADING),
            Image("time to first failure per build (crash or wrong KV read, kind marked), and every run's "
                  "first failure", svg, SURVIVAL_PNG),
            Para("A run **fails** at its first wrong KV read (the shadow KV names the request) or its crash, "
                 "whichever came first; a run with neither is censored where its load ended. Left: Kaplan-Meier, "
                 "the share of runs with no failure yet. Right: each run, and what followed its first failure.")]


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    return _survival_blocks(run, context.out_dir)
