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

_STYLE = {"CRASH": "bold red", "SURVIVED": "bold green", "VACUOUS": "yellow", "STALL": "yellow",
          "INFRA": "magenta", "INTERRUPTED": "dim"}


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
            "patches": build.get("patches", []),
            "build_error": (build.get("build") or {}).get("error"),
            "runs": [
                {
                    "verdict": r.get("verdict"),
                    "outcome": r.get("outcome"),
                    "title": r.get("title"),
                    "trigger_count": r.get("trigger_count", 0),
                    "external_hit_calls": r.get("external_hit_calls", 0),
                    "offload_load_jobs": (r.get("extra") or {}).get("offload_load_jobs", 0),
                    "requests": r.get("requests", 0),
                    "seconds": r.get("seconds", 0.0),
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
    return stats.patch_effects(stacks, {n: b.get("runs", []) for n, b in results.items()})


def matrix_table(run: dict[str, Any]) -> Group:
    table = Table(title=f"kvrepro matrix {run.get('run_id')}  (vLLM {run.get('base')}, target {run.get('target')}, "
                        f"{run.get('status')})", title_justify="left")
    table.add_column("build", style="bold")
    table.add_column("patches")
    table.add_column("verdict per repetition")
    table.add_column("trigger count", justify="right")
    table.add_column("offload loads", justify="right")
    table.add_column("title", overflow="fold")
    for name, build in run.get("builds_results", {}).items():
        runs = build.get("runs", [])
        verdicts = Text()
        for i, r in enumerate(runs):
            if i:
                verdicts.append(" ")
            verdicts.append(verdict_label(r), style=_STYLE.get(r.get("verdict"), ""))
        if not runs:
            verdicts.append("(not run)", style="dim")
        titles = Counter(r.get("title") for r in runs if r.get("verdict") != "SURVIVED" and r.get("title"))
        build_error = (build.get("build") or {}).get("error")
        title = build_error or (titles.most_common(1)[0][0] if titles else "")
        table.add_row(
            name,
            ", ".join(build.get("patches", [])) or "-",
            verdicts,
            " / ".join(str(r.get("trigger_count", 0)) for r in runs),
            " / ".join(str(int((r.get("extra") or {}).get("offload_load_jobs", 0))) for r in runs),
            title,
        )
    lines = [table]
    for e in _effects(run):
        lines.append(Text(
            f"{e.patch}: {e.without} {e.without_rate.crashes}/{e.without_rate.trials} crashed -> "
            f"{e.with_} {e.with_rate.crashes}/{e.with_rate.trials}  (one-sided Fisher p = {e.p_value:.3g})"
        ))
    lines.append(Text(f"results: {run.get('path')}", style="dim"))
    return Group(*lines)
