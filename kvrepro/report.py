"""The matrix as a person reads it (a rich table) and as a machine reads it (JSON).

Both are made from what ``results.load_run`` reads back from disk, so a report of an old or an
interrupted run says exactly what was recorded.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from . import stats

_STYLE = {"CRASH": "bold red", "CORRUPT": "bold red", "SURVIVED": "bold green", "UNREACHED": "yellow",
          "VACUOUS": "yellow", "STALL": "yellow", "INFRA": "magenta", "INTERRUPTED": "dim"}


def verdict_label(run: dict[str, Any]) -> str:
    """CRASH(target) / CRASH(other) / SURVIVED / VACUOUS / STALL / INFRA / INTERRUPTED."""
    verdict = run.get("verdict", "?")
    if verdict == "CRASH":
        return "CRASH(target)" if run.get("outcome") == "target" else "CRASH(other)"
    return verdict


def matrix_json(run: dict[str, Any]) -> dict[str, Any]:
    builds = {}
    for name, build in run.get("builds_results", {}).items():
        builds[name] = {
            "base": build.get("base"),
            "patches": build.get("patches", []),
            "build_error": (build.get("build") or {}).get("error"),
            "runs": [
                {
                    "verdict": r.get("verdict"),
                    "outcome": r.get("outcome"),
                    "title": r.get("title"),
                    "trigger_count": r.get("trigger_count", 0),
                    "state_count": r.get("state_count", 0),
                    "state_groups": r.get("state_groups") or {},
                    "kv_check": r.get("kv_check", "off"),
                    "external_hit_calls": r.get("external_hit_calls", 0),
                    "offload_load_jobs": (r.get("extra") or {}).get("offload_load_jobs"),
                    "base": r.get("base") or build.get("base"),
                    "requests": r.get("requests", 0),
                    "seconds": r.get("seconds", 0.0),
                    "engine_start_s": (r.get("extra") or {}).get("engine_start_s"),
                    "run_dir": r.get("run_dir"),
                }
                for r in build.get("runs", [])
            ],
        }
    effects = _effects(run)
    return {
        "run_id": run.get("run_id"),
        "status": run.get("status"),
        "target": run.get("target"),
        "base": run.get("base"),
        "path": run.get("path"),
        "builds": builds,
        "patch_effects": [
            {"patch": e.patch, "without": e.without, "with": e.with_,
             "crashes_without": [e.without_rate.crashes, e.without_rate.trials],
             "crashes_with": [e.with_rate.crashes, e.with_rate.trials],
             "p_value": round(e.p_value, 4)}
            for e in effects
        ],
    }


def _effects(run: dict[str, Any]) -> list[stats.PatchEffect]:
    results = run.get("builds_results", {})
    stacks = {n: b.get("patches", []) for n, b in results.items()}
    bases = {n: str(b.get("base")) for n, b in results.items()}
    return stats.patch_effects(stacks, {n: b.get("runs", []) for n, b in results.items()}, bases)


def _count(value) -> str:
    """A counter for the table: "?" when it was not known (not the same as 0)."""
    return "?" if value is None else str(int(value))


def _verdict_summary(runs: list[dict[str, Any]]) -> Text:
    """`3x CRASH(target)`, or each repetition's verdict in order when they differ."""
    text = Text()
    labels = [verdict_label(r) for r in runs]
    if not labels:
        return Text("(not run)", style="dim")
    if len(set(labels)) == 1:
        text.append(f"{len(labels)}x " if len(labels) > 1 else "")
        text.append(labels[0], style=_STYLE.get(runs[0].get("verdict"), ""))
        return text
    for i, (label, r) in enumerate(zip(labels, runs)):
        text.append(" " if i else "")
        text.append(label, style=_STYLE.get(r.get("verdict"), ""))
    return text


def _state(run: dict[str, Any]) -> str:
    """`37 (full_attention 37)`: calls in which the bug's state occurred, by kind of group."""
    groups = run.get("state_groups") or {}
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(groups.items()))
    return f"{run.get('state_count', 0)}" + (f" ({kinds})" if kinds else "")


def matrix_table(run: dict[str, Any]) -> Group:
    table = Table(title=f"kvrepro matrix {run.get('run_id')}  (vLLM {run.get('base')}, target {run.get('target')}, "
                        f"{run.get('status')})", title_justify="left")
    table.add_column("build", style="bold", no_wrap=True)
    table.add_column("patches")
    table.add_column("verdicts", no_wrap=True)
    table.add_column("trigger count", justify="right")
    table.add_column("bug state (group kinds)", justify="right")
    table.add_column("KV check")
    table.add_column("offload loads", justify="right")
    titles: list[Text] = []
    for name, build in run.get("builds_results", {}).items():
        runs = build.get("runs", [])
        table.add_row(
            name,
            ", ".join(build.get("patches", [])) or "-",
            _verdict_summary(runs),
            " / ".join(str(r.get("trigger_count", 0)) for r in runs),
            " / ".join(_state(r) for r in runs),
            " / ".join(r.get("kv_check", "off") for r in runs),
            " / ".join(_count((r.get("extra") or {}).get("offload_load_jobs")) for r in runs),
        )
        build_error = (build.get("build") or {}).get("error")
        counted = Counter(r.get("title") for r in runs if r.get("verdict") != "SURVIVED" and r.get("title"))
        for title, n in ([(build_error, len(runs))] if build_error else counted.most_common()):
            titles.append(Text(f"{name}: {title}" + (f"  ({n}x)" if n > 1 else "")))
    lines: list[Any] = [table, *titles]
    for e in _effects(run):
        lines.append(Text(
            f"{e.patch}: {e.without} {e.without_rate.crashes}/{e.without_rate.trials} crashed -> "
            f"{e.with_} {e.with_rate.crashes}/{e.with_rate.trials}  (one-sided Fisher p = {e.p_value:.3g})"
        ))
    lines.append(Text(f"results: {run.get('path')}", style="dim"))
    return Group(*lines)
