"""The matrix as a person reads it and as a machine reads it.

* :func:`matrix_table` -- the terminal table (rich);
* :func:`matrix_json` -- ``--json``;
* the formatting the report's sections share (rates, verdict labels, what the matrix proved);
  the report itself is :mod:`kvrepro.report.document` (``report.md``, ``report.html``), one
  section per file in ``kvrepro/report/sections/``;
* a bisection's display is :mod:`kvrepro.report.bisection` (its blocks can go into the report);
* :func:`mismatches` -- which repetitions differ from ``expect:`` (decided in :mod:`.expectations`).

Everything is made from what ``results.load_run`` reads back from disk as typed records, so a
report of an old or an interrupted run says exactly what was recorded.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table as RichTable
from rich.text import Text

from . import stack, stats
from .. import versions
# runs that say nothing about how long the engine lives under load (the pictures leave them out)
from .failures import NOT_TIMED  # noqa: F401
# whether a run meets expect: is decided in report/expectations.py (re-exported for the report's users)
from .expectations import Mismatch, meets_expectation, mismatches  # noqa: F401
from ..records import RunResult, Verdict
from ..results.store import BuildResults, MatrixRun

_STYLE = {"CRASH": "bold red", "CORRUPT": "bold red", "SURVIVED": "bold green", "VACUOUS": "yellow",
          "UNREACHED": "yellow", "STALL": "yellow", "INFRA": "magenta", "INTERRUPTED": "dim",
          "INCOMPLETE": "dim", "DAMAGED": "bold magenta"}
TONE = {"CRASH": "bad", "CORRUPT": "bad", "SURVIVED": "good", "VACUOUS": "warn", "UNREACHED": "warn",
         "STALL": "warn", "INFRA": "warn", "INTERRUPTED": "muted",
         "DAMAGED": "warn"}
REPORT_MD = "report.md"
REPORT_HTML = "report.html"
SURVIVAL_PNG = "survival.png"
# A Kaplan-Meier "curve" of one run is that run's verdict drawn as a step: the report draws the
# survival figure when some build has at least this many timed runs. Drawing it (and importing
# matplotlib and scipy.stats for it) costs about 3 CPU s, more than a one-repetition `matrix run`
# spends on everything else of its own.
MIN_TIMED_RUNS = 2


def verdict_label(run: RunResult) -> str:
    """CRASH(target) / CRASH(other) / CORRUPT / SURVIVED / UNREACHED / VACUOUS / STALL / INFRA / INTERRUPTED."""
    return run.label


# --- numbers ---------------------------------------------------------------------------------

def build_key(run: MatrixRun, build: BuildResults) -> str:
    """How the report names a (base, build): its cell name (``A``, or ``A@0.30.0`` when the run
    spans several releases), with the base added if two cells would otherwise share a name."""
    if sum(b.name == build.name for b in run.builds) > 1:
        return f"{build.name}@{build.base}"
    return build.name


def effects_by_base(run: MatrixRun, kind: stats.FailureKind = stats.ANY_FAILURE
                     ) -> tuple[list[stats.PatchEffect], list[stats.Factorial]]:
    """Patch effects compare builds on the same base only: across bases more than a patch differs."""
    effects, factorials = [], []
    for base in dict.fromkeys(b.base for b in run.builds):
        members = [b for b in run.builds if b.base == base]
        stacks = {build_key(run, b): list(b.patches) for b in members}
        runs = {build_key(run, b): list(b.runs) for b in members}
        effects += stats.patch_effects(stacks, runs, kind=kind) + stats.stack_effects(stacks, runs, kind=kind)
        factorials += stats.factorials(stacks, runs, kind=kind)
    return effects, factorials


def failure_kinds(run: MatrixRun) -> list[stats.FailureKind]:
    """The questions the statistics answer one by one: the target crash, then every corruption
    defect some repetition showed (by name); "any failure" comes on top of these."""
    target = next((r for b in run.builds for r in b.runs if r.verdict is Verdict.CRASH
                   and r.signature is not None and r.title and r.outcome.value == "target"), None)
    label = "the target crash"
    if target is not None and target.signature is not None:
        label = f"the target crash ({target.signature.exception} in {target.signature.function.rsplit('.', 1)[-1]})"
    kinds = [stats.FailureKind(stats.TARGET_CRASH.name, label, stats.TARGET_CRASH.outcome)]
    names = sorted({name for b in run.builds for r in b.runs for name in r.kv_defects})
    kinds += [stats.corruption_kind(name, name) for name in names]
    return kinds


def ratio_text(r: stats.Rate) -> str:
    return f"{r.crashes}/{r.trials}" if r.trials else "-"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def proved(run: MatrixRun) -> list[str]:
    """What the matrix proved, in words: per patch, which failures it removes (Fisher p <= 0.05),
    brings in, or leaves; then every build that is clean. The first lines of report.md and of the
    terminal output."""
    kinds = failure_kinds(run)
    by_patch: dict[str, list[stats.PatchEffect]] = {}
    for kind in kinds:
        for e in effects_by_base(run, kind)[0]:
            by_patch.setdefault(e.patch, []).append(e)
    runs_of = {build_key(run, b): b.runs for b in run.builds}
    lines = []
    for patch, effects in by_patch.items():
        clauses = []
        named: set[str] = set()
        for kind in kinds:
            mine = [e for e in effects if e.kind.name == kind.name and e.measured]
            pairs = "; ".join(f"{e.without} {ratio_text(e.without_rate)} → {e.with_} {ratio_text(e.with_rate)}"
                              + (f", p = {min(e.p_value, e.p_raised):.2g}" if e.lowered or e.raised else "")
                              for e in mine)
            if any(e.lowered for e in mine):
                clauses.append(f"removes {kind.label} ({pairs})")
            elif any(e.raised for e in mine):
                clauses.append(f"brings in {kind.label} ({pairs})")
            elif any(e.with_rate.crashes and e.without_rate.crashes for e in mine):
                clauses.append(f"does not remove {kind.label} ({pairs})")
            elif any(e.with_rate.crashes or e.without_rate.crashes for e in mine):
                clauses.append(f"changes {kind.label} by no significant amount ({pairs})")
            else:
                continue
            named.add(kind.name)
        # what the builds with this patch fail with that no clause named (its builds without the
        # patch crashed before it could show): a fix that turns a crash into wrong KV says so here
        left = []
        for kind in kinds[1:]:
            failing = [e.with_ for e in effects if e.kind.name == kind.name and e.with_rate.crashes]
            if failing and kind.name not in named:
                left.append(f"{kind.name} in " + ", ".join(f"{b} {ratio_text(stats.rate(runs_of[b], kind))}"
                                                           for b in failing))
        together = " (added together)" if " + " in patch else ""
        sentence = f"`{patch}`{together} " + ("; ".join(clauses) if clauses else "shows no measurable effect")
        if left:
            sentence += "; with it the engine still reads wrong KV: " + "; ".join(left)
        lines.append(sentence + ".")
    for b in run.builds:
        if b.runs and all(r.verdict in (Verdict.SURVIVED, Verdict.UNREACHED) and r.kv_check == "ok"
                          for r in b.runs):
            labels = ", ".join(f"{n}x {label}" for label, n in Counter(r.label for r in b.runs).items())
            lines.append(f"{build_key(run, b)} is clean: no crash and no wrong KV read in {len(b.runs)} of "
                         f"{len(b.runs)} runs ({labels}; shadow-KV checks passed).")
    return lines


def count_text(value: int | None) -> str:
    """A counter for a table: "unknown" when it was not known (not the same as 0)."""
    return "unknown" if value is None else str(value)


def offload_loads_text(run: RunResult) -> str:
    """A repetition's completed offload load jobs, or "unknown" when they were not read."""
    return count_text(run.offload_load_jobs)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def rate_text(r: stats.Rate) -> str:
    """`3/3 = 100% (29-100%)`, `0/3 = 0% (0-71%, <= 63%)`: rate, exact 95% CI, zero-event bound."""
    if not r.trials:
        return "no counted run"
    low, high = r.clopper_pearson()
    text = f"{r.crashes}/{r.trials} = {_pct(r.value)} ({100 * low:.0f}-{100 * high:.0f}%)"
    bound = r.zero_event_upper()
    return text + (f", <= {100 * bound:.0f}%" if bound is not None else "")


def state_rate_text(s: stats.StateRate) -> str:
    if not s.occurrences:
        return "-"
    interval = s.interval()
    assert interval is not None
    return f"{s.per_1000:.1f} ({interval[0]:.1f}-{interval[1]:.1f})"


def summary_labels(runs: tuple[RunResult, ...]) -> str:
    labels = [r.label for r in runs]
    if not labels:
        return "(not run)"
    if len(set(labels)) == 1:
        return (f"{len(labels)}x " if len(labels) > 1 else "") + labels[0]
    return " ".join(labels)


def state_text(r: RunResult) -> str:
    if not r.state_groups:
        return str(r.state_count)
    return f"{r.state_count} (" + ", ".join(f"{k} {v}" for k, v in sorted(r.state_groups.items())) + ")"


# --- JSON ------------------------------------------------------------------------------------

def _run_json(r: RunResult) -> dict[str, Any]:
    return {
        "rep": r.rep, "base": r.base, "verdict": r.verdict.value, "label": r.label, "outcome": r.outcome.value,
        "title": r.title, "trigger_count": r.trigger_count, "external_hit_calls": r.external_hit_calls,
        "state_count": r.state_count, "state_groups": dict(r.state_groups), "kv_check": r.kv_check,
        "kv_violations": r.kv_violations, "kv_defects": dict(r.kv_defects),
        "kv_violations_by_class": dict(r.kv_violations_by), "kv_first_violation": r.kv_first_violation,
        "offload_load_jobs": r.offload_load_jobs, "requests": r.requests, "seconds": r.seconds,
        "load_seconds": r.load_seconds, "engine_start_s": r.engine_start_s, "run_dir": r.run_dir,
        # why the load ended: budget, settled (with the stopping rule's words), engine_dead, stall, ...
        "stopped_because": r.load.stopped_because if r.load is not None else None,
        "settled_by": r.load.settled_by if r.load is not None else None,
        # the target's own part (ray: the node and placement group), and the attempts lost before it
        "by_target": dict(r.by_target),
        "retried_after": list(r.retried_after),
    }


def _rate_json(r: stats.Rate) -> dict[str, Any]:
    return {"failed": r.crashes, "counted": r.trials, "rate": r.value,
            "clopper_pearson_95": list(r.clopper_pearson()), "wilson_95": list(r.wilson()),
            "zero_event_upper_95": r.zero_event_upper()}


def _contrast_json(c: stats.Contrast) -> dict[str, float]:
    return {"estimate": round(c.estimate, 4), "low": round(c.low, 4), "high": round(c.high, 4)}


def matrix_json(run: MatrixRun) -> dict[str, Any]:
    builds = {}
    for b in run.builds:
        s = stats.state_rate(b.runs)
        builds[build_key(run, b)] = {
            "name": b.name,
            "base": b.base,
            "patches": list(b.patches),
            "expect": b.expect,
            "build_error": b.build_error,
            "runs": [_run_json(r) for r in b.runs],
            "failure_rate": _rate_json(stats.rate(b.runs)),
            "failures_per_1000_states": {"failures": s.failures, "state_occurrences": s.occurrences,
                                         "per_1000": s.per_1000, "poisson_95": list(s.interval() or []) or None},
        }
    kinds = [stats.ANY_FAILURE, *failure_kinds(run)]
    effects, factorials = [], []
    for kind in kinds:
        kind_effects, kind_factorials = effects_by_base(run, kind)
        effects += kind_effects
        factorials += kind_factorials
    for b in run.builds:
        builds[build_key(run, b)]["failure_rates"] = {k.name: _rate_json(stats.rate(b.runs, k)) for k in kinds}
    return {
        "run_id": run.run_id,
        "proved": proved(run),
        # each build's failures against its base build: introduced by its stack or not (issue 51)
        "introduced": stack.as_json(stack.stack_failures(run, build_key)),
        "failure_kinds": {k.name: k.label for k in kinds},
        "status": run.status,
        "target": run.info.target,
        "base": run.info.base,
        # releases run with the newest known release's settings (kvrepro/versions.py: is_unported)
        "unported": [base for base in dict.fromkeys(b.base for b in run.builds) if versions.is_unported(base)],
        "path": str(run.path),
        "builds": builds,
        "mismatches": [vars(m) for m in mismatches(run)],
        "patch_effects": [
            {"patch": e.patch, "kind": e.kind.name, "without": e.without, "with": e.with_,
             "crashes_without": [e.without_rate.crashes, e.without_rate.trials],
             "crashes_with": [e.with_rate.crashes, e.with_rate.trials],
             "p_value": round(e.p_value, 4), "p_raised": round(e.p_raised, 4)}
            for e in effects
        ],
        "factorials": [
            {"kind": f.kind.name, "patches": [f.patch_p, f.patch_q], "builds": {"none": f.none, "p": f.p, "q": f.q, "both": f.both},
             "effect_p": _contrast_json(f.effect_p), "effect_q": _contrast_json(f.effect_q),
             "p_alone": _contrast_json(f.p_alone), "p_with_q": _contrast_json(f.p_with_q),
             "q_alone": _contrast_json(f.q_alone), "q_with_p": _contrast_json(f.q_with_p),
             "interaction": _contrast_json(f.interaction)}
            for f in factorials
        ],
    }


# --- terminal --------------------------------------------------------------------------------

def _verdict_summary(runs: tuple[RunResult, ...]) -> Text:
    """`3x CRASH(target)`, or each repetition's verdict in order when they differ."""
    text = Text()
    if not runs:
        return Text("(not run)", style="dim")
    labels = [r.label for r in runs]
    if len(set(labels)) == 1:
        text.append(f"{len(labels)}x " if len(labels) > 1 else "")
        text.append(labels[0], style=_STYLE.get(runs[0].verdict.value, ""))
        return text
    for i, r in enumerate(runs):
        text.append(" " if i else "")
        text.append(r.label, style=_STYLE.get(r.verdict.value, ""))
    return text


def crash_titles(b: BuildResults) -> list[tuple[str, int]]:
    if b.build_error:
        return [(b.build_error, len(b.runs))]
    counted = Counter(r.title for r in b.runs if r.verdict is not Verdict.SURVIVED and r.title)
    return counted.most_common()


def _grouped_labels(runs: tuple[RunResult, ...]) -> Text:
    """`2x CRASH(target) 1x INFRA`: each verdict once with its count (the narrow table's verdicts)."""
    if len({r.label for r in runs}) <= 1:
        return _verdict_summary(runs)
    text = Text()
    firsts: dict[str, RunResult] = {}
    for r in runs:
        firsts.setdefault(r.label, r)
    for i, (label, n) in enumerate(Counter(r.label for r in runs).items()):
        text.append(" " if i else "")
        text.append(f"{n}x {label}", style=_STYLE.get(firsts[label].verdict.value, ""))
    return text


def _short_rate_text(r: stats.Rate) -> str:
    """`3/3 (29-100%)`: the rate's counts and exact 95% CI, for the narrow table."""
    if not r.trials:
        return "none counted"
    low, high = r.clopper_pearson()
    return f"{r.crashes}/{r.trials} ({100 * low:.0f}-{100 * high:.0f}%)"


def _range_text(values: list[int | None]) -> str:
    """`185-379` (or `199` when all agree): one counter over the repetitions, for the narrow table."""
    known = [v for v in values if v is not None]
    if not values:
        return "-"
    if not known:
        return "unknown"
    low, high = min(known), max(known)
    text = str(low) if low == high else f"{low}-{high}"
    return text + ("?" if len(known) < len(values) else "")


@dataclass(frozen=True)
class _Layout:
    """How much of the run table a console width holds (richest first; see :class:`MatrixTable`)."""
    name: str
    patches_in_table: bool = True      # else a legend under the table: `B = pr-49146 + pr-52807`
    grouped_verdicts: bool = False     # `2x CRASH(target) 1x INFRA` instead of each repetition in order
    short_rate: bool = False           # `3/3 (29-100%)` instead of `3/3 = 100% (29-100%)`
    counts: str = "each"               # each repetition's / "range" (min-max) / "none" (dropped)
    edges: bool = True                 # the table's outer border


_LAYOUTS = (
    _Layout("full"),
    _Layout("legend", patches_in_table=False),
    _Layout("grouped", patches_in_table=False, grouped_verdicts=True, short_rate=True),
    _Layout("ranges", patches_in_table=False, grouped_verdicts=True, short_rate=True, counts="range"),
    _Layout("ranges-no-edge", patches_in_table=False, grouped_verdicts=True, short_rate=True, counts="range",
            edges=False),
    _Layout("no-counts", patches_in_table=False, grouped_verdicts=True, short_rate=True, counts="none",
            edges=False),
)


class MatrixTable:
    """The run table, folded to the console's width.

    At full width every column shows; when that does not fit (an 80-column terminal), it folds step
    by step -- the patch stacks move under the table as a legend, the verdicts are counted, the rate
    keeps its counts and 95% CI, the per-repetition counters become their range, the outer border
    goes, and last the counters are dropped -- taking the first layout whose widest row fits, so that
    no cell wraps. The full table is always in ``--json`` and report.md."""

    def __init__(self, run: MatrixRun):
        self.run = run

    def layout_for(self, console: Console, width: int) -> _Layout:
        options = console.options.update_width(10_000)  # a measurement is clamped to the width it is given
        for layout in _LAYOUTS:
            if Measurement.get(console, options, self._table(layout)).maximum <= width:
                return layout
        return _LAYOUTS[-1]

    def _table(self, layout: _Layout) -> RichTable:
        run = self.run
        last = layout is _LAYOUTS[-1]
        table = RichTable(show_edge=layout.edges)
        multi_base = len({b.base for b in run.builds}) > 1
        # the leanest layout never wraps a cell: what still does not fit is cut with an ellipsis
        cut = {"no_wrap": True, "overflow": "ellipsis"} if last else {"no_wrap": True}
        if multi_base:
            table.add_column("base", **cut)
        table.add_column("build", style="bold", **cut)
        if layout.patches_in_table:
            table.add_column("patches")
        table.add_column("verdicts", **cut)
        table.add_column("failed" if layout.short_rate else "failed (95% CI)", **cut)
        if layout.counts == "each":
            wide = layout.patches_in_table
            table.add_column("trigger count" if wide else "trigger", justify="right", **cut)
            table.add_column("bug state" if wide else "state", justify="right", **cut)
            table.add_column("offload loads" if wide else "loads", justify="right", **cut)
        elif layout.counts == "range":
            table.add_column("trigger", justify="right", **cut)
            table.add_column("state", justify="right", **cut)
            table.add_column("loads", justify="right", **cut)
        sep = " / " if layout.patches_in_table else "/"
        for b in run.builds:
            cells: list[Any] = [versions.label(b.base)] if multi_base else []
            cells.append(b.build_name)
            if layout.patches_in_table:
                cells.append(", ".join(b.patches) or "-")
            cells.append(_grouped_labels(b.runs) if layout.grouped_verdicts else _verdict_summary(b.runs))
            rate = stats.rate(b.runs)
            cells.append(_short_rate_text(rate) if layout.short_rate else rate_text(rate))
            if layout.counts == "each":
                cells += [sep.join(str(r.trigger_count) for r in b.runs),
                          sep.join(str(r.state_count) for r in b.runs),
                          sep.join(count_text(r.offload_load_jobs) for r in b.runs)]
            elif layout.counts == "range":
                cells += [_range_text([r.trigger_count for r in b.runs]),
                          _range_text([r.state_count for r in b.runs]),
                          _range_text([r.offload_load_jobs for r in b.runs])]
            table.add_row(*cells)
        return table

    def _legend(self, layout: _Layout) -> list[Text]:
        lines: list[Text] = []
        if layout.short_rate:
            lines.append(Text("failed: runs that failed / runs counted (95% CI)", style="dim"))
        if not layout.patches_in_table:
            for b in self.run.builds:
                lines.append(Text(f"{build_key(self.run, b)} = " + (" + ".join(b.patches) or "(base)"), style="dim"))
        if layout.counts == "range":
            lines.append(Text("trigger / state / loads: lowest-highest over the runs (? = some unknown)", style="dim"))
        elif layout.counts == "none":
            lines.append(Text("trigger / state / loads counts: in --json, report.md, a wider terminal", style="dim"))
        return lines

    def renderables(self, console: Console, width: int) -> list[Any]:
        layout = self.layout_for(console, width)
        run = self.run
        titles: list[Text] = []
        for b in run.builds:
            for title, n in crash_titles(b):
                titles.append(Text(f"{build_key(run, b)}: {title}" + (f"  ({n}x)" if n > 1 else "")))
        info = run.info
        heading = Text(f"kvrepro matrix {run.run_id}  (vLLM {info.base_text}, target {info.target}, {run.status})",
                       style="italic")
        lines: list[Any] = [heading, self._table(layout), *self._legend(layout), *titles]
        claims = proved(run)
        if claims:
            lines.append(Text("What this matrix proved:", style="bold"))
            lines += [Text(f"  {claim.replace('`', '')}") for claim in claims]
        lines.append(Text(f"results: {run.path}", style="dim"))
        return lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.renderables(console, options.max_width)


def matrix_table(run: MatrixRun) -> MatrixTable:
    """The run table for a terminal; it folds to the console's width when printed (:class:`MatrixTable`)."""
    return MatrixTable(run)


# --- report.md / report.html ------------------------------------------------------------------

def append_step_summary(markdown: str) -> Path | None:
    """Append to ``$GITHUB_STEP_SUMMARY`` when GitHub Actions provides it (the job's summary page)."""
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return None
    with open(target, "a", encoding="utf-8") as fh:
        fh.write(markdown if markdown.endswith("\n") else markdown + "\n")
    return Path(target)
