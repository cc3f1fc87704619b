"""Time to crash: Kaplan-Meier curves per build, in requests and in seconds under load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...results.store import MatrixRun, write_atomic
from ..pages import Block, Heading, Image, Para
from ..render import SURVIVAL_PNG, build_key
from . import SectionContext

ORDER = 50
DETAILS = False


def _survival_blocks(run: MatrixRun, out_dir: Path | None) -> list[Block]:
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
