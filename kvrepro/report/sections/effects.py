"""Patch effects per kind of failure (Fisher p, lowered and raised) and the 2x2 factorials."""

from __future__ import annotations


from ...results.store import MatrixRun
from .. import stats
from ..pages import Block, Cell, Heading, Para, Table
from ..render import ratio_text, effects_by_base, failure_kinds
from . import SectionContext

ORDER = 30
DETAILS = False


def _effect_blocks(run: MatrixRun) -> list[Block]:
    kinds = [stats.ANY_FAILURE, *failure_kinds(run)]
    rows = []
    factorials: list[stats.Factorial] = []
    for kind in kinds:
        effects, kind_factorials = effects_by_base(run, kind)
        factorials += kind_factorials
        for e in effects:
            rows.append((Cell(e.patch, code=True), kind.name, f"{e.without} → {e.with_}", ratio_text(e.without_rate),
                         ratio_text(e.with_rate),
                         Cell(f"{e.p_value:.3g}" if e.measured else "-", "good" if e.lowered else ""),
                         Cell(f"{e.p_raised:.3g}" if e.measured else "-", "bad" if e.raised else "")))
    blocks: list[Block] = []
    if rows:
        blocks += [Heading(2, "Patch effects, per kind of failure"), Table(
            ("patch", "failure", "without → with", "failed without", "failed with", "p (lowered)", "p (raised)"),
            tuple(rows), align="lllrrrr"),
            Para("Each kind of failure is counted on its own: `any` is CRASH or CORRUPT against SURVIVED; "
                 "`target` is the target crash (a run that served its budget did not hit it; another crash "
                 "ended the run first and is not counted); each corruption defect is a run that showed it "
                 "against one that served its budget under the shadow-KV check without it (a crash that "
                 "did not show it is not counted). p: the probability that adding the patch lowered (or "
                 "raised) that failure rate this much by chance (Fisher's exact test, one-sided); 3/3 "
                 "against 0/3 is p = 0.05; `-`: a side has no counted run.")]
    for f in factorials:
        def row(name: str, c: stats.Contrast) -> tuple[str, str, str]:
            return (name, f"{100 * c.estimate:+.0f} pts", f"{100 * c.low:+.0f} to {100 * c.high:+.0f} pts")
        blocks += [Heading(3, f"2x2 ({f.kind.name}): `{f.patch_p}` x `{f.patch_q}` "
                              f"({f.none}, {f.p}, {f.q}, {f.both})"), Table(
            ("effect on the failure rate", "estimate", "95% CI (adjusted Wald)"),
            (row(f"`{f.patch_p}` (average over `{f.patch_q}`)", f.effect_p),
             row(f"`{f.patch_p}` without `{f.patch_q}` ({f.none} → {f.p})", f.p_alone),
             row(f"`{f.patch_p}` with `{f.patch_q}` ({f.q} → {f.both})", f.p_with_q),
             row(f"`{f.patch_q}` (average over `{f.patch_p}`)", f.effect_q),
             row(f"`{f.patch_q}` without `{f.patch_p}` ({f.none} → {f.q})", f.q_alone),
             row(f"`{f.patch_q}` with `{f.patch_p}` ({f.p} → {f.both})", f.q_with_p),
             row("interaction (does one patch change what the other does?)", f.interaction)),
            align="lrr")]
    return blocks


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    return _effect_blocks(run)
