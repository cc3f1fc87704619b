"""What each build's stack introduced: its failures its base build does not show (issue 51;
kvrepro/report/stack.py), per failure key, with the counts and Fisher's p."""

from __future__ import annotations

from ...results.store import MatrixRun
from .. import stack
from ..pages import Block, Cell, Heading, Para, Table
from ..render import build_key
from . import SectionContext

ORDER = 31
DETAILS = False


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    found = stack.stack_failures(run, build_key)
    if not found:
        return []
    tone = {stack.INTRODUCED: "bad", stack.IN_BASE: "", stack.UNDECIDED: "warn"}
    rows = tuple((f.build, f.base_build or "-", Cell(f.key, code=True), Cell(f.origin, tone[f.origin]),
                  f"{f.with_failed}/{f.with_runs}", f"{f.without_failed}/{f.without_runs}" if f.base_build else "-",
                  f"{f.p_value:.3g}" if f.p_value is not None else "-") for f in found)
    return [Heading(2, "Introduced by each build's stack"), Table(
        ("build", "against", "failure", "whose", "with the stack", "on the base", "p (raised)"), rows,
        align="lllllrr"),
        Para("Each failure keyed as `kvrepro explore` keys it (a stall by where the engine waits, an invariant "
             "by its name) and compared with the base build of the same release (the build whose stack every "
             "other contains), the same load and seeds: introduced when the base showed it in none of its runs "
             "that could (a base run cut short by a failure the build never had is not counted), in the base "
             "when it showed it too, undecided when no base run could. p: one-sided Fisher, that the stack "
             "raised the rate this much by chance.")]
