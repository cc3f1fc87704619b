"""A campaign outlives whatever its runs and its minimizer do (issue 48): a run the matrix runner
fails (it sets its stop event and raises, as it does for any error in a run), a bug of kvrepro's
inside a run, a minimizer that raises: each is recorded, and the campaign goes on to its budget,
``complete``; ``interrupted`` is for a signal only. No engine runs here: the matrix runner and the
judge are replaced by stand-ins that fail on purpose (what is under test is the campaign's loop)."""

from __future__ import annotations

import threading

import pytest

from kvrepro.errors import InfraError
from kvrepro.explore import campaign as campaign_module
from kvrepro.explore.campaign import new_campaign, run_campaign
from kvrepro.records import Verdict
from kvrepro.explore.state import CampaignRequest, FindingRecord, RunRecord
from kvrepro.suite.run import load as load_catalogue


class _Target:
    """Stands in for the sim target the campaign's runs share: counts interrupts."""

    name = "sim"
    runs_remotely = False
    starts_during_stop = True

    def __init__(self) -> None:
        self.interrupts = 0

    def interrupt(self) -> None:
        self.interrupts += 1

    def close(self) -> None:
        pass


class _Run:
    verdict = Verdict.CRASH
    label = "CRASH(other)"
    seconds = 1.0
    run_dir = None


class _MatrixRun:
    run_id = "r"

    def runs(self):
        return [_Run()]


def test_a_failing_run_and_a_failing_minimizer_do_not_end_the_campaign(tmp_path, monkeypatch):
    calls: list[int] = []
    stops: list[threading.Event] = []

    def run_matrix(loaded, options, progress, stop, target=None):
        calls.append(len(calls))
        stops.append(stop)
        # what the matrix runner does for a run that fails: stop its other slots, interrupt its
        # target (its watcher thread), raise
        stop.set()
        target.interrupt()
        if len(calls) == 1:
            raise InfraError("the engine's log could not be read")
        if len(calls) == 2:
            raise IndexError("list index out of range")  # a bug of kvrepro's inside a run
        return _MatrixRun()

    def record_run(state, folder, catalogue, spec, loaded, run, run_id, targets=None):
        key = f"crash:new-{spec.index}"
        (folder / "findings" / key).mkdir(parents=True)
        state.findings[key] = FindingRecord(key=key, kind="crash", title=key, status="new", entry=None,
                                            first_run=spec.index, folder=f"findings/{key}")
        return RunRecord(spec=spec, run_id=run_id, verdict=run.label, seconds=run.seconds)

    def minimize_finding(*args, **kwargs):
        raise RuntimeError("the minimizer fell over")

    monkeypatch.setattr(campaign_module, "run_matrix", run_matrix)
    monkeypatch.setattr(campaign_module, "record_run", record_run)
    monkeypatch.setattr(campaign_module, "minimize_finding", minimize_finding)
    state, folder = new_campaign(tmp_path, CampaignRequest(base="0.30.0", budget_runs=4, seed=1, requests=10,
                                                           guided=False))
    target = _Target()
    done = run_campaign(state, folder, load_catalogue(), target=target)
    assert done.status == "complete" and len(done.runs) == 4, done.runs
    first, second = done.runs[:2]
    assert first.verdict == "INFRA" and first.error == "the engine's log could not be read"
    assert second.verdict == "INFRA" and second.error == "IndexError: list index out of range"
    assert [r.verdict for r in done.runs[2:]] == ["CRASH(other)", "CRASH(other)"]
    # every finding minimized or marked why not
    assert [f.minimized for f in done.findings.values()] == [
        "not minimized: the minimizer failed (RuntimeError: the minimizer fell over)"] * 2
    # a run's stop is its own: the target the runs share was never interrupted
    assert target.interrupts == 0 and len({id(s) for s in stops}) == len(stops)


def test_a_stop_by_the_caller_is_stopped_and_a_minimization_it_cut_says_so(tmp_path, monkeypatch):
    """The planted-bug benchmark stops a campaign at its first find: `stopped` (not a signal), and the
    finding of the last run is marked with how to minimize it by hand."""
    monkeypatch.setattr(campaign_module, "run_matrix", lambda *a, **k: _MatrixRun())

    def record_run(state, folder, catalogue, spec, loaded, run, run_id, targets=None):
        state.findings["crash:x"] = FindingRecord(key="crash:x", kind="crash", title="x", status="new", entry=None,
                                                  first_run=spec.index, folder="findings/x")
        return RunRecord(spec=spec, run_id=run_id, verdict=run.label, seconds=run.seconds)

    monkeypatch.setattr(campaign_module, "record_run", record_run)
    state, folder = new_campaign(tmp_path, CampaignRequest(base="0.30.0", budget_runs=5, seed=1, requests=10,
                                                           guided=False))
    stop = threading.Event()
    original = campaign_module.save

    def save(state, folder):  # the caller stops as soon as the first run is recorded
        if state.runs:
            stop.set()
        original(state, folder)

    monkeypatch.setattr(campaign_module, "save", save)
    done = run_campaign(state, folder, load_catalogue(), stop=stop, target=_Target())
    assert done.status == "stopped" and len(done.runs) == 1
    assert done.findings["crash:x"].minimized.startswith("not minimized: the campaign was stopped first")
