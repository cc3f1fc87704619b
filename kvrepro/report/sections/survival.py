"""Time to crash: Kaplan-Meier curves per build, in requests and in seconds under load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...results.store import MatrixRun, write_atomic
from ..pages import Block, Heading, Image, Para
from ..render import MIN_TIMED_RUNS, NOT_TIMED, SURVIVAL_PNG, build_key
from . import SectionContext

ORDER = 50
DETAILS = False


def _survival_blocks(run: MatrixRun, out_dir: Path | None) -> list[Block]:
    timed = max((sum(r.verdict not in NOT_TIMED for r in b.runs) for b in run.builds), default=0)
    if timed == 0:
        return []
    if timed < MIN_TIMED_RUNS:
        return [Heading(2, "Time to crash"),
                Para(f"No curve: a build needs {MIN_TIMED_RUNS} timed runs (repetitions) for one, and every "
                     "build here has one; where each run ended is in the verdict table.")]
    from ..plots import survival_curve, survival_figure

    by_axis: dict[str, list[Any]] = {"requests": [], "seconds": []}
    for b in run.builds:
        for axis in by_axis:
            curve = survival_curve(build_key(run, b), list(b.runs), axis)
            if curve is not None:
                by_axis[axis].append(curve)
    if not by_axis["requests"]:
        return []
    svg, png = survival_figure(by_axis)
    if out_dir is not None:
        write_atomic(out_dir / SURVIVAL_PNG, png)
    return [Heading(2, "Time to crash"),
            Image("time-to-crash curves per build, in requests and in seconds under load", svg, SURVIVAL_PNG),
            Para("Kaplan-Meier: a crashed run is an event when it died; any other run is censored where its "
                 "budget ended.")]


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    return _survival_blocks(run, context.out_dir)
