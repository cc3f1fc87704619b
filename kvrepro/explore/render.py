"""A campaign as lines for the terminal (``--json`` prints :func:`kvrepro.explore.campaign.summary`)."""

from __future__ import annotations

from . import origin
from .state import CampaignState, FindingRecord, RunRecord


def run_line(record: RunRecord) -> str:
    titles = "; ".join(f"{f.title} [{f.status}{' ' + f.entry if f.entry else ''}"
                       f"{', ' + _ORIGIN_WORDS[f.origin] if f.origin in _ORIGIN_WORDS else ''}]" for f in record.failures)
    new = f" +{len(record.new_features)} features" if record.new_features else ""
    why = f" ({record.error})" if record.error else ""
    return (f"run {record.spec.index}: {record.verdict}{why} {record.seconds:.0f}s{new}  {titles}  "
            f"<- {record.spec.describe()}")


def lines(state: CampaignState, folder: str) -> list[str]:
    r = state.request
    budget = f"{r.budget_runs} runs" if r.budget_runs is not None else f"{r.budget_seconds:.0f} s"
    out = [f"campaign {state.campaign_id} ({state.status}): {len(state.runs)} runs in {state.elapsed_s:.0f} s "
           f"(budget {budget}), {'guided' if r.guided else 'unguided'}, seed {r.seed}, "
           f"build {'+'.join((r.base, *r.patches))}; {len(state.coverage)} features reached"]
    if not state.findings:
        out.append("no failures")
    if r.patches:
        return out + origin_lines(state, folder)
    for f in sorted(state.findings.values(), key=lambda f: (f.status == "known", f.first_run)):
        out.extend(_finding(f, folder))
    return out


_ORIGIN_WORDS = {origin.PATCH: "introduced by the patch", origin.BASE: "already in the base",
                 origin.UNDECIDED: "undecided"}


def _finding(f: FindingRecord, folder: str) -> list[str]:
    against = f" (catalogue: {f.entry})" if f.entry else ""
    if f.origin == origin.PATCH and f.catalogue_status == "known":
        against = f" (looks like catalogue entry {f.entry}, but the base does not show it)" if f.entry else ""
    where = f" -> {folder}/{f.folder}" if f.folder else ""
    out = [f"  {f.status.upper():10} {f.title}{against}: {f.runs} run(s), first run {f.first_run}{where}"]
    if f.origin is not None:
        out.append(f"  {'':10} {origin.counts_text(f)}")
    if f.minimized:
        out.append(f"  {'':10} {f.minimized}")
    return out


def origin_lines(state: CampaignState, folder: str) -> list[str]:
    """A campaign on a patch: introduced by the patch / already in the base / undecided, and what
    the replays that told them apart cost (origin.py)."""
    out = []
    groups = origin.grouped(state)
    for name in origin.ORIGINS:
        found = sorted(groups[name], key=lambda f: f.first_run)
        out.append(f"{_ORIGIN_WORDS[name]}: {len(found) or 'none'}")
        for f in found:
            out.extend(_finding(f, folder))
    c = origin.cost(state)
    bound = (f"{c['bound_seconds']:.0f} s" if c["bound_seconds"] is not None else f"{c['bound_runs']} runs")
    share = f", {100 * c['share_of_run_time']:.0f}% of the run time" if c["share_of_run_time"] is not None else ""
    out.append(f"replays: {c['runs']} run(s) of {c['specs_replayed']} spec(s) in {c['seconds']:.0f} s{share} "
               f"(bound: {100 * c['bound']:.0f}% of the budget, {bound}); {c['failing_runs_replayed']} of "
               f"{c['failing_runs']} failing run(s) replayed, {c['failures_served']} failure(s) judged by them"
               + (f"; {c['waiting']} run(s) left unreplayed (the share was spent)" if c["waiting"] else ""))
    return out
