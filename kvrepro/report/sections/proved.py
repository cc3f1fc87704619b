"""What this matrix proved: the claims a maintainer can quote, first (kvrepro.report.render.proved)."""

from __future__ import annotations

from ...results.store import MatrixRun
from ..pages import Block, Bullets, Heading
from ..render import proved
from . import SectionContext

ORDER = 10
DETAILS = False


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    claims = proved(run)
    return [Heading(2, "What this matrix proved"), Bullets(tuple(claims))] if claims else []
