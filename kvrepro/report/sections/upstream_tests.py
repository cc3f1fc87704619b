"""vLLM's own tests on this matrix's builds: read from the newest ``kvrepro builds test`` record in
the same results folder whose builds carry the same patch stacks (kvrepro/report/upstream_tests.py)."""

from __future__ import annotations

from ...results.store import MatrixRun
from ..pages import Block
from ..upstream_tests import blocks as upstream_blocks, latest_matching
from . import SectionContext

ORDER = 75
DETAILS = False


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    bases = {b.base for b in run.builds}
    out: list[Block] = []
    for base in sorted(bases):
        stacks = {b.name: tuple(b.patches) for b in run.builds if b.base == base}
        found = latest_matching(run.path.parent, base, stacks)
        if found is not None:
            out += upstream_blocks(found[1], found[0], stacks)
    return out
