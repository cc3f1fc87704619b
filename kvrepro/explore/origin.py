"""Whose failure is it: the patch's or the base's (issue 51).

`kvrepro explore --base X --patch P` asks whether P brings a failure X does not have. The catalogue
cannot answer that: on a release with a known stall every stall would be that entry's, whatever P
did. So each failing run of a campaign with patches is run again, the same spec and seeds, on X
without the patches (and on X with them once more, for flakiness), and each of its failures judged:

* ``patch``: it failed so with the patches at least twice (the run and its replay, or two runs) and
  never in the base's replays of the same specs: the patch's, *new* whatever its catalogue title;
* ``base``: a replay on the base without the patches failed the same way (the same key: for a stall,
  the same place the engine waits, judge.stall_failure): already in the base;
* ``undecided``: neither (not replayed yet, the replay share spent, a replay that could not be judged
  or that ended early on a failure the run did not have, or a failure its own replay with the
  patches did not show again), with the counts.

The replay of a spec serves every failure its run showed (a stall with a leak and a stranded request:
one replay), and a spec is replayed once however many runs made it (:func:`spec_key`). The base's
replay comes first; the one with the patches only when the base did not show every failure. What
the replays cost is bounded by ``CampaignRequest.replay_share`` of the budget (campaign.py).

Everything here is pure: it reads the campaign's records and replays (explore.json), so it is tested
on recorded folders without an engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

from .generator import RunSpec
from .state import CampaignState, FindingRecord, ReplayRecord, RunRecord

PATCH, BASE, UNDECIDED = "patch", "base", "undecided"
BASE_BUILD, PATCHED_BUILD = "base", "patched"
ORIGINS = (PATCH, BASE, UNDECIDED)


def spec_key(spec: RunSpec) -> str:
    """A spec's identity, its index aside: the same changes and seeds are the same run."""
    return json.dumps([[list(c) for c in spec.changes], spec.load_seed, spec.sim_seed], sort_keys=True, default=str)


def decide(with_failed: int, without_failed: int, without_runs: int) -> str:
    """The rule: the base showed it -> base; it failed twice with the patches and the base was asked
    at least once -> patch; else undecided."""
    if without_failed > 0:
        return BASE
    if without_runs > 0 and with_failed >= 2:
        return PATCH
    return UNDECIDED


def run_counts(key: str, replays: dict[str, ReplayRecord], run_keys: frozenset[str] = frozenset()
               ) -> tuple[int, int, int, int]:
    """(with_failed, with_runs, without_failed, without_runs) of one failing run's ``key``: the run
    itself and its spec's replays that could be judged. A base replay that ended early on a failure
    the run (keys ``run_keys``) did not have does not count as a run without ``key``: it never got
    as far (0.26.0's target crash ends a load before the corruption a fix exposes)."""
    patched, base = replays.get(PATCHED_BUILD), replays.get(BASE_BUILD)
    with_ok = patched is not None and patched.judged
    base_ok = base is not None and base.judged and (
        key in base.keys or base.ended_by is None or base.ended_by in run_keys)
    return (1 + int(with_ok and key in patched.keys), 1 + int(with_ok),
            int(base_ok and key in base.keys), int(base_ok))


def needs(record: RunRecord, replays: dict[str, ReplayRecord]) -> list[str]:
    """The replays ``record``'s spec still needs: the base's first; the patches' again only when the
    base did not show every failure of the run (a failure the base shows is the base's either way)."""
    keys = {f.key for f in record.failures}
    base = replays.get(BASE_BUILD)
    if base is None:
        return [BASE_BUILD]
    if base.judged and keys <= set(base.keys):
        return []
    return [] if PATCHED_BUILD in replays else [PATCHED_BUILD]


def refresh(state: CampaignState) -> list[str]:
    """Judge every failure of a campaign with patches from the replays recorded so far: each run's
    failures (JudgedRecord.origin) and each finding (its origin, counts and status: ``new`` for the
    patch's, the catalogue's otherwise). Returns the keys that became the patch's now."""
    if not state.request.patches:
        return []
    totals: dict[str, list[int]] = {}
    for i, record in enumerate(state.runs):
        if not record.failures:
            continue
        replays = state.replays.get(spec_key(record.spec), {})
        failures = []
        keys = frozenset(f.key for f in record.failures)
        for f in record.failures:
            counts = run_counts(f.key, replays, keys)
            got = totals.setdefault(f.key, [0, 0, 0, 0])
            for n, c in enumerate(counts):
                got[n] += c
            failures.append(replace(f, origin=decide(counts[0], counts[2], counts[3])))
        state.runs[i] = replace(record, failures=tuple(failures))
    became = []
    for key, finding in list(state.findings.items()):
        with_failed, with_runs, without_failed, without_runs = totals.get(key, (0, 0, 0, 0))
        origin = decide(with_failed, without_failed, without_runs)
        catalogue = finding.catalogue_status or finding.status
        # the patch's failure is new whatever its catalogue title: the base does not show it under the
        # same spec (a regression stays one: the catalogue says this very build is fixed)
        status = "new" if origin == PATCH and catalogue == "known" else catalogue
        if origin == PATCH and finding.origin != PATCH:
            became.append(key)
        state.findings[key] = replace(finding, origin=origin, status=status, catalogue_status=catalogue,
                                      with_failed=with_failed, with_runs=with_runs, without_failed=without_failed,
                                      without_runs=without_runs)
    return became


def undecided_keys(state: CampaignState, record: RunRecord) -> bool:
    """Whether some failure of ``record`` has no origin yet (so its replay is worth most now)."""
    return any((state.findings.get(f.key) or FindingRecord(f.key, f.kind, f.title, f.status, None, 0)).origin
               in (None, UNDECIDED) for f in record.failures)


def replay_allowance(state: CampaignState) -> tuple[float | None, int | None]:
    """What the replays may take in all: (seconds, runs), one of them None. The share of a duration
    budget in seconds, of a run budget in runs (at least one run's two replays when the share is
    not 0); None, None: no bound (no budget, which a campaign does not have)."""
    r = state.request
    if r.replay_share <= 0:
        return 0.0, 0
    if r.budget_seconds is not None:
        return r.replay_share * r.budget_seconds, None
    if r.budget_runs is not None:
        return None, max(2, math.ceil(r.replay_share * r.budget_runs))
    return None, None


def replay_runs(state: CampaignState) -> int:
    return sum(len(v) for v in state.replays.values())


def may_replay(state: CampaignState) -> bool:
    """The replays so far leave room for another run's (checked before each failing run's replays)."""
    seconds, runs = replay_allowance(state)
    if seconds is not None and state.replay_s >= seconds:
        return False
    return not (runs is not None and replay_runs(state) >= runs)


def next_to_replay(state: CampaignState, eager: bool) -> RunRecord | None:
    """The queued failing run to replay next: one with a failure of no origin yet first (oldest
    first); ``eager`` (between runs) only such runs, the rest wait for the campaign's end."""
    by_index = {r.spec.index: r for r in state.runs}
    queued = [by_index[i] for i in state.replay_queue if i in by_index]
    for record in queued:
        if undecided_keys(state, record):
            return record
    return None if eager or not queued else queued[0]


def cost(state: CampaignState) -> dict[str, object]:
    """What the replays took, against what they may take and what the campaign ran: for the report."""
    seconds, runs = replay_allowance(state)
    failing = [r for r in state.runs if r.failures]
    replayed = [r for r in failing if spec_key(r.spec) in state.replays]
    return {"runs": replay_runs(state), "seconds": round(state.replay_s, 1),
            "share_of_run_time": round(state.replay_s / state.elapsed_s, 3) if state.elapsed_s else None,
            "bound": state.request.replay_share, "bound_seconds": round(seconds, 1) if seconds is not None else None,
            "bound_runs": runs, "failing_runs": len(failing), "failing_runs_replayed": len(replayed),
            "specs_replayed": len(state.replays),
            # a replay serves every failure its run showed and every run of its spec
            "failures_served": sum(len(r.failures) for r in replayed), "waiting": len(state.replay_queue)}


def grouped(state: CampaignState) -> dict[str, list[FindingRecord]]:
    """The report's three lists: introduced by the patch, already in the base, undecided."""
    out: dict[str, list[FindingRecord]] = {o: [] for o in ORIGINS}
    for f in state.findings.values():
        out[f.origin or UNDECIDED].append(f)
    return out


def counts_text(f: FindingRecord) -> str:
    return (f"with the patches {f.with_failed}/{f.with_runs} run(s), without {f.without_failed}/{f.without_runs}")
