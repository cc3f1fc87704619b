"""A bisection's steps, when the report is a bisection's (kvrepro.report.bisection makes the blocks)."""

from __future__ import annotations

from ...results.store import MatrixRun
from ..pages import Block
from . import SectionContext

ORDER = 40
DETAILS = False


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    return list(context.bisection)
