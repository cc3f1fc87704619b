"""A campaign on a patch tells the patch's failures from the base's (issue 51; kvrepro/explore/origin.py).

The rule is judged on recorded campaign states (no engine): a failure the base's replay of the same
spec shows is the base's; one that failed twice with the patch and never without is the patch's,
new whatever the catalogue calls it; the rest is undecided, with the counts. The campaign's loop is
run with stand-ins for the matrix runner and the replays (what is under test is which replays it
asks for, how often, within which bound)."""

from __future__ import annotations

import json

import pytest

from kvrepro.explore import campaign as campaign_module
from kvrepro.explore import origin
from kvrepro.explore.campaign import new_campaign, run_campaign, summary
from kvrepro.explore.generator import RunSpec
from kvrepro.explore.render import lines
from kvrepro.explore.state import (CampaignRequest, CampaignState, FindingRecord, JudgedRecord, ReplayRecord,
                                   RunRecord)
from kvrepro.suite.run import load as load_catalogue

RECOMPUTE = "stall:refused:WAITING+self-reserved+async-load/reserved-by-self"
LEAK_STALL = "stall:refused:WAITING|blocks-held-by-no-request"
LEAK = "invariant:block-leak"


def _spec(index: int, seed: int | None = None) -> RunSpec:
    return RunSpec(index=index, changes=(("load.concurrency", 4),), load_seed=seed or index, sim_seed=seed or index)


def _judged(key: str, status: str = "new", entry: str | None = None) -> JudgedRecord:
    return JudgedRecord(kind=key.split(":", 1)[0], key=key, title=key.upper(), status=status, entry=entry)


def _state(runs: list[tuple[RunSpec, list[JudgedRecord]]], **request) -> CampaignState:
    state = CampaignState(campaign_id="explore-t", request=CampaignRequest(
        base="0.30.0", patches=("leak",), budget_seconds=600, **request))
    for spec, judged in runs:
        state.runs.append(RunRecord(spec=spec, run_id=f"r{spec.index}", verdict="STALL" if judged else "UNREACHED",
                                    seconds=10.0, failures=tuple(judged)))
        for j in judged:
            old = state.findings.get(j.key)
            state.findings[j.key] = (FindingRecord(j.key, j.kind, j.title, j.status, j.entry, spec.index)
                                     if old is None else FindingRecord(**{**old.__dict__, "runs": old.runs + 1}))
    return state


def _replay(spec: RunSpec, build: str, *keys: str, verdict: str = "STALL") -> ReplayRecord:
    return ReplayRecord(origin.spec_key(spec), build, f"x-{build}-{spec.index}", verdict if keys else "UNREACHED",
                        5.0, keys=keys)


def test_the_base_showing_it_makes_it_the_bases_and_the_patch_alone_makes_it_new_whatever_its_title():
    """The recompute stall (a known entry on 0.30.0) shows on the base too: the base's. The leak's
    stall and invariant do not: the patch's, and the stall is `new` although a stall entry is known."""
    s1, s2 = _spec(1), _spec(2)
    state = _state([(s1, [_judged(RECOMPUTE, "known", "recompute-failed-load-stall")]),
                    (s2, [_judged(LEAK_STALL, "known", "recompute-failed-load-stall"), _judged(LEAK)])])
    state.replays = {origin.spec_key(s1): {"base": _replay(s1, "base", RECOMPUTE)},
                     origin.spec_key(s2): {"base": _replay(s2, "base"), "patched": _replay(s2, "patched", LEAK_STALL, LEAK)}}
    assert origin.refresh(state) == [LEAK_STALL, LEAK]
    f = state.findings
    assert (f[RECOMPUTE].origin, f[RECOMPUTE].status, f[RECOMPUTE].entry) == ("base", "known", "recompute-failed-load-stall")
    assert (f[LEAK_STALL].origin, f[LEAK_STALL].status, f[LEAK_STALL].catalogue_status) == ("patch", "new", "known")
    assert (f[LEAK].with_failed, f[LEAK].with_runs, f[LEAK].without_failed, f[LEAK].without_runs) == (2, 2, 0, 1)
    assert [j.origin for j in state.runs[1].failures] == ["patch", "patch"]
    assert [x.key for x in state.introduced] == [LEAK_STALL, LEAK] == [x.key for x in state.failing]
    # the base's evidence wins later: the same key shown by the base in another spec is the base's
    s3 = _spec(3)
    state.runs.append(RunRecord(spec=s3, run_id="r3", verdict="STALL", seconds=1.0, failures=(_judged(LEAK_STALL),)))
    state.replays[origin.spec_key(s3)] = {"base": _replay(s3, "base", LEAK_STALL)}
    assert origin.refresh(state) == []
    assert (state.findings[LEAK_STALL].origin, state.findings[LEAK_STALL].status) == ("base", "known")


def test_undecided_with_its_counts_when_the_patch_does_not_fail_again_or_nothing_was_replayed():
    s1, s2, s3 = _spec(1), _spec(2), _spec(3)
    state = _state([(s1, [_judged("crash:x")]), (s2, [_judged("stall")]), (s3, [_judged(LEAK)])])
    state.replays = {origin.spec_key(s1): {"base": _replay(s1, "base"), "patched": _replay(s1, "patched")},
                     # a replay that could not be judged says nothing
                     origin.spec_key(s3): {"base": ReplayRecord(origin.spec_key(s3), "base", None, "INFRA", 1.0,
                                                                error="engine start timed out")}}
    origin.refresh(state)
    got = {k: (f.origin, origin.counts_text(f)) for k, f in state.findings.items()}
    assert got == {"crash:x": ("undecided", "with the patches 1/2 run(s), without 0/1"),
                   "stall": ("undecided", "with the patches 1/1 run(s), without 0/0"),
                   LEAK: ("undecided", "with the patches 1/1 run(s), without 0/0")}
    assert state.introduced == [] and state.failing == []


def test_one_replay_per_spec_and_the_patched_one_only_when_the_base_did_not_show_all():
    a = _spec(1, seed=7)
    same = _spec(9, seed=7)  # another run of the same changes and seeds: the same replay
    assert origin.spec_key(a) == origin.spec_key(same) != origin.spec_key(_spec(2, seed=8))
    record = RunRecord(spec=a, run_id="r1", verdict="STALL", seconds=1.0,
                       failures=(_judged(RECOMPUTE), _judged(LEAK)))
    assert origin.needs(record, {}) == ["base"]
    assert origin.needs(record, {"base": _replay(a, "base", RECOMPUTE, LEAK)}) == []
    assert origin.needs(record, {"base": _replay(a, "base", RECOMPUTE)}) == ["patched"]
    assert origin.needs(record, {"base": _replay(a, "base"), "patched": _replay(a, "patched")}) == []


def test_the_replays_are_bounded_by_their_share_of_the_budget():
    state = _state([], replay_share=0.25)
    assert origin.replay_allowance(state) == (150.0, None) and origin.may_replay(state)
    state.replay_s = 150.0
    assert not origin.may_replay(state)
    runs = CampaignState("explore-t", CampaignRequest(base="0.30.0", patches=("p",), budget_runs=10, replay_share=0.5))
    assert origin.replay_allowance(runs) == (None, 5)
    off = CampaignState("explore-t", CampaignRequest(base="0.30.0", patches=("p",), budget_runs=10, replay_share=0))
    assert not origin.may_replay(off)


def test_the_report_lists_introduced_already_in_the_base_and_undecided(tmp_path):
    s1, s2 = _spec(1), _spec(2)
    state = _state([(s1, [_judged(RECOMPUTE, "known", "recompute-failed-load-stall")]),
                    (s2, [_judged(LEAK)])])
    state.elapsed_s = 100.0
    state.replay_s = 10.0
    state.replays = {origin.spec_key(s1): {"base": _replay(s1, "base", RECOMPUTE)},
                     origin.spec_key(s2): {"base": _replay(s2, "base"), "patched": _replay(s2, "patched", LEAK)}}
    origin.refresh(state)
    text = "\n".join(lines(state, str(tmp_path)))
    assert "introduced by the patch: 1\n  NEW        INVARIANT:BLOCK-LEAK" in text
    assert "already in the base: 1\n  KNOWN      " in text and "undecided: none" in text
    assert "with the patches 2/2 run(s), without 0/1" in text
    assert "replays: 3 run(s) of 2 spec(s) in 10 s, 10% of the run time (bound: 50% of the budget, 300 s)" in text
    out = summary(state)
    assert [f["key"] for f in out["origin"]["patch"]] == [LEAK] and out["replays"]["failures_served"] == 2
    # the state, replays included, survives explore.json
    back = CampaignState.from_json(json.loads(json.dumps(state.to_json())))
    assert back.replays == state.replays and back.findings == state.findings


# --- the campaign's loop, with stand-ins --------------------------------------------------------------


class _Target:
    name = "sim"
    runs_remotely = False
    starts_during_stop = True

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Run:
    def __init__(self, index):
        self.verdict, self.label, self.seconds, self.run_dir, self.index = None, "STALL", 1.0, None, index


class _MatrixRun:
    def __init__(self, index):
        self.run_id, self.index = f"r{index}", index

    def runs(self):
        return [_Run(self.index)]


@pytest.mark.parametrize("patched_only", [True, False], ids=["planted", "clean"])
def test_a_campaign_replays_each_failing_spec_once_and_names_the_patchs_failures(tmp_path, monkeypatch, patched_only):
    """Every run stalls at the recompute stall; run 2 and run 3 also leak. The planted patch: the base
    never leaks, so the leak is the patch's and the stall the base's. The clean patch: the base shows
    both (they are the base's). The base's replay of the recompute stall is asked for once: runs with
    only decided failures wait for the campaign's end, where the share decides how many get one."""
    from kvrepro.records import Verdict

    _Run.verdict = Verdict.STALL
    made: list[int] = []

    def run_matrix(loaded, options, progress, stop, target=None):
        made.append(len(made))
        return _MatrixRun(len(made) - 1)

    def record_run(state, folder, catalogue, spec, loaded, run, run_id, targets=None):
        keys = [RECOMPUTE] + ([LEAK] if spec.index in (2, 3) else [])
        judged = [_judged(RECOMPUTE, "known", "recompute-failed-load-stall")] + [_judged(k) for k in keys[1:]]
        for j in judged:
            old = state.findings.get(j.key)
            state.findings[j.key] = (FindingRecord(j.key, j.kind, j.title, j.status, j.entry, spec.index)
                                     if old is None else FindingRecord(**{**old.__dict__, "runs": old.runs + 1}))
        return RunRecord(spec=spec, run_id=run_id, verdict="STALL", seconds=1.0, failures=tuple(judged))

    asked: list[tuple[int, str]] = []

    def replay(spec, build, data, request, path, target, name, folder, progress, stop):
        asked.append((spec.index, build))
        keys = [RECOMPUTE] + ([LEAK] if spec.index in (2, 3) and (build == "patched" or not patched_only) else [])
        return ReplayRecord(origin.spec_key(spec), build, f"x{spec.index}{build}", "STALL", 2.0, keys=tuple(keys))

    monkeypatch.setattr(campaign_module, "run_matrix", run_matrix)
    monkeypatch.setattr(campaign_module, "record_run", record_run)
    monkeypatch.setattr(campaign_module, "_replay", replay)
    state, folder = new_campaign(tmp_path, CampaignRequest(base="0.30.0", patches=("pr-52807",), budget_runs=5,
                                                           seed=1, requests=10, guided=False, minimize=False,
                                                           replay_share=0.8))
    done = run_campaign(state, folder, load_catalogue(), target=_Target())
    assert done.status == "complete" and len(done.runs) == 5
    # between runs: run 0 (its stall has no origin yet), run 2 (the leak is new); runs 1, 3, 4 wait for
    # the end, where the share (4 replay runs of a 5-run budget at 0.8) leaves room for one more run's
    if patched_only:
        assert asked == [(0, "base"), (2, "base"), (2, "patched"), (1, "base")]
        assert (done.findings[LEAK].origin, done.findings[LEAK].status) == ("patch", "new")
        assert [f.key for f in done.introduced] == [LEAK]
    else:
        assert asked == [(0, "base"), (2, "base"), (1, "base"), (3, "base")]
        assert done.findings[LEAK].origin == "base" and done.introduced == []
    assert (done.findings[RECOMPUTE].origin, done.findings[RECOMPUTE].status) == ("base", "known")
    assert done.replay_s == 2.0 * len(asked) and len(done.replay_queue) == 5 - len({i for i, _ in asked})
    # the campaign's own runs are those a campaign without patches would make (the replays are apart)
    assert [r.spec.index for r in done.runs] == [0, 1, 2, 3, 4] and made == [0, 1, 2, 3, 4]


def test_a_base_replay_cut_short_by_another_failure_says_nothing_of_what_came_later():
    """The base stalls at the release's own place before the patch's leak could show: undecided, not
    the patch's; the base stalling at the same place as the run did still counts for the leak."""
    s1, s2 = _spec(1), _spec(2)
    state = _state([(s1, [_judged(LEAK)]), (s2, [_judged(RECOMPUTE), _judged(LEAK)])])
    state.replays = {
        origin.spec_key(s1): {"base": ReplayRecord(origin.spec_key(s1), "base", "b1", "STALL", 1.0, (RECOMPUTE,),
                                                   ended_by=RECOMPUTE),
                              "patched": _replay(s1, "patched", LEAK)},
        origin.spec_key(s2): {"base": ReplayRecord(origin.spec_key(s2), "base", "b2", "STALL", 1.0, (RECOMPUTE,),
                                                   ended_by=RECOMPUTE),
                              "patched": _replay(s2, "patched", RECOMPUTE, LEAK)}}
    origin.refresh(state)
    assert [j.origin for j in state.runs[0].failures] == ["undecided"]
    assert [j.origin for j in state.runs[1].failures] == ["base", "patch"]
    leak = state.findings[LEAK]
    assert (leak.origin, leak.with_failed, leak.with_runs, leak.without_failed, leak.without_runs) == (
        "patch", 4, 4, 0, 1)
