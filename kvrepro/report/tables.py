"""The terminal tables of the commands that list things: a matrix's plan, the recorded runs, two
runs compared, the known signatures. The verdict table itself is render.matrix_table."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from ..results.index import RunRow


def plan_table(plan: dict[str, Any]) -> Table:
    """`matrix plan`: each build's patch stack, in order, with its expectation."""
    table = Table(title=f"{plan['matrix']}: vLLM {', '.join(plan['bases'])} on target {plan['target']}, "
                        f"{plan['repetitions']} repetition(s) of {plan['budget']['requests'] or '-'} requests / "
                        f"{plan['budget']['duration_s'] or '-'} s")
    table.add_column("build")
    table.add_column("patch stack (in order)")
    table.add_column("expect")
    for b in plan["builds"]:
        table.add_row(b["name"], " -> ".join(f"{x['name']} ({x['sha256'][:12]})" for x in b["patches"]) or "(base)",
                      b["expect"] or "")
    return table


def _compact(labels: list[str]) -> str:
    if not labels:
        return "-"
    return f"{len(labels)}x {labels[0]}" if len(set(labels)) == 1 and len(labels) > 1 else " ".join(labels)


def _counted(labels: list[str]) -> str:
    """`2x CRASH(target) 1x INFRA`: each verdict once with its count."""
    if not labels:
        return "-"
    return " ".join(f"{n}x {label}" for label, n in Counter(labels).items())


def runs_table(rows: list[RunRow], results_root: Path, width: int) -> Table:
    """`results list`'s table, folded to ``width``: when a run's verdicts do not fit on one line (an
    80-column terminal), each build gets a line of its own, its verdicts counted; target and base
    move into the title when every run shares them. No verdict is cut in the middle."""
    readable = [r for r in rows if not r.unreadable]
    one_line = {r.run_id: "  ".join(f"{n}: {_compact(v)}" for n, v in r.builds.items()) for r in readable}
    shared = {k: {getattr(r, k) for r in readable} for k in ("target", "base")}

    def room(keys: tuple[str, ...]) -> int:  # what the verdicts column has beside the others
        return width - 4 - 3 * len(keys) - sum(max((len(getattr(r, k) or "") for r in readable), default=0)
                                               for k in keys) - (2 if len(readable) < len(rows) else 0)

    keys: tuple[str, ...] = ("run_id", "status", "target", "base")
    narrow = any(len(text) > room(keys) for text in one_line.values())
    title = f"runs under {results_root}/"
    if narrow and readable and all(len(v) == 1 for v in shared.values()):
        keys = ("run_id", "status")
        title += f" (target {next(iter(shared['target'])) or '-'}, vLLM {next(iter(shared['base'])) or '-'})"
    table = Table(title=title)
    for key in keys:
        table.add_column(key.replace("_", " "))
    table.add_column("verdicts")
    for r in rows:
        if r.unreadable:
            table.add_row("", "unreadable", *([""] * (len(keys) - 2)), r.error)
            continue
        text = one_line[r.run_id]
        if narrow and len(text) > room(keys):
            text = "\n".join(f"{n}: {_counted(v)}" for n, v in r.builds.items())
        cells = [getattr(r, k) or "" for k in keys]
        if r.recorded_id:  # a copied run folder: its folder name, and the run it is a copy of
            cells[0] = f"{cells[0]}\n(run.json: {r.recorded_id})"
        table.add_row(*cells, text)
    return table


def compare_table(c: Any) -> tuple[Table, str]:
    """`results compare`: each build's verdict before and after, and a line naming what changed."""
    table = Table(title=f"{c.before.run_id} (vLLM {c.before.info.base_text}) -> {c.after.run_id} "
                        f"(vLLM {c.after.info.base_text})", title_justify="left")
    for col in ("build", "before", "after", "failed", "Fisher p (two-sided)"):
        table.add_column(col)
    for b in c.builds:
        table.add_row(b.build, b.before or "(absent)", b.after or "(absent)",
                      f"{b.before_rate.crashes}/{b.before_rate.trials} -> {b.after_rate.crashes}/{b.after_rate.trials}",
                      "-" if b.p_value is None else f"{b.p_value:.3g}",
                      style="bold" if b.changed else "dim")
    line = f"{len(c.changed)} build(s) changed" + (": " + ", ".join(b.build for b in c.changed) if c.changed else "")
    return table, line


def signatures_table(rows: list[dict[str, Any]]) -> Table:
    """`kvrepro signatures`: kind, name and what each known signature says."""
    table = Table(title="known signatures (kvrepro/classify/signatures/, corruptions/, infra/)",
                  title_justify="left")
    for column in ("kind", "name", "what"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["kind"], row["name"], escape(row["title"]))
    return table
