"""A campaign as lines for the terminal (``--json`` prints :func:`kvrepro.explore.campaign.summary`)."""

from __future__ import annotations

from .state import CampaignState, RunRecord


def run_line(record: RunRecord) -> str:
    titles = "; ".join(f"{f.title} [{f.status}{' ' + f.entry if f.entry else ''}]" for f in record.failures)
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
    for f in sorted(state.findings.values(), key=lambda f: (f.status == "known", f.first_run)):
        against = f" (catalogue: {f.entry})" if f.entry else ""
        where = f" -> {folder}/{f.folder}" if f.folder else ""
        out.append(f"  {f.status.upper():10} {f.title}{against}: {f.runs} run(s), first run {f.first_run}{where}")
        if f.minimized:
            out.append(f"  {'':10} {f.minimized}")
    return out
