"""Each distinct crash or corruption title with its traceback excerpt."""

from __future__ import annotations

from pathlib import Path

from ...records import Verdict
from ...results.store import MatrixRun
from ..pages import Block, Code, Details, Heading, Para
from ..render import build_key
from . import SectionContext
from ...classify import crash_excerpt

ORDER = 60
DETAILS = True


def _crash_blocks(run: MatrixRun) -> list[Block]:
    blocks: list[Block] = []
    for b in run.builds:
        seen: set[str] = set()
        for r in b.runs:
            if r.verdict not in (Verdict.CRASH, Verdict.CORRUPT) or r.title in seen:
                continue
            seen.add(r.title)
            count = sum(x.title == r.title for x in b.runs)
            lines = crash_excerpt(Path(r.run_dir) / "engine.log") if r.run_dir else []
            inner: list[Block] = [Code("\n".join(lines))] if lines else [Para("(no traceback in the log)")]
            if r.run_dir:
                inner.append(Para(f"log: `{r.run_dir}/engine.log`"))
            blocks.append(Details(f"{build_key(run, b)} ({count}x): {r.title}", tuple(inner)))
    return [Heading(2, "Crashes"), *blocks] if blocks else []


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    return _crash_blocks(run)
