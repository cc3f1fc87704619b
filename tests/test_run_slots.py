"""How a matrix's runs share its slots: a run frees its slot when its load ends, and each
repetition's builds go longest first.

The end-to-end test runs real vLLM 0.26.0 engines (GPU-free: the model executor and the offload
worker's data movement are faked, nothing else) and reads the timing of each run from its files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvrepro.matrix.runner import longest_first
from kvrepro.builds.records import BuildArtifact
from kvrepro.records import Outcome, RunResult, Verdict
from kvrepro.spec.records import BuildPlan

ROOT = Path(__file__).resolve().parents[1]


def _artifact(name: str) -> BuildArtifact:
    return BuildArtifact(plan=BuildPlan(name=name, base="0.26.0", patches=()), ref=None, manifest={})


def _took(name: str, seconds: float) -> RunResult:
    return RunResult(build=name, rep=0, verdict=Verdict.CRASH, outcome=Outcome.TARGET, title="", trigger_count=0,
                     external_hit_calls=0, requests=0, seconds=seconds, run_dir="")


def test_each_repetition_orders_its_builds_by_the_time_their_runs_took():
    artifacts = [_artifact(n) for n in "ABCDE"]
    recorded: dict[str, list[RunResult]] = {n: [] for n in "ABCDE"}
    order = longest_first(artifacts, recorded, range(3))
    first = [next(order) for _ in range(5)]
    assert [(a.plan.name, rep) for a, rep in first] == [(n, 0) for n in "ABCDE"]  # nothing known: matrix order
    # what repetition 0 took (D still running: it goes first, its length unknown)
    for name, seconds in (("A", 5.0), ("B", 12.0), ("C", 4.0), ("E", 9.0)):
        recorded[name].append(_took(name, seconds))
    second = [next(order) for _ in range(5)]
    assert [(a.plan.name, rep) for a, rep in second] == [("D", 1), ("B", 1), ("E", 1), ("A", 1), ("C", 1)]
    recorded["D"].append(_took("D", 1.0))
    recorded["B"].append(_took("B", 2.0))  # B's mean is now 7 s
    third = [(a.plan.name, rep) for a, rep in order]
    assert third == [("E", 2), ("B", 2), ("A", 2), ("C", 2), ("D", 2)]


@pytest.mark.parametrize("jobs, reps", [(2, 2), (1, 1)], ids=["two-slots", "one-slot"])
def test_a_run_frees_its_slot_when_its_load_ends(tmp_path, overlays, jobs, reps, shared_zygotes_here):
    """Crash runs of A and C on two slots (and on one, as a suite runs each entry): the next engine
    starts while an earlier run is still being stopped and judged (more runs in flight than slots),
    yet never more than ``jobs`` engines start or take load at once; the verdicts are what the
    matrix expects. (The engines fork from the worker's shared zygote: what is timed here is the
    runner's slots, not a zygote's start.)"""
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "--build", "A", "--build", "C",
                           "--reps", str(reps), "--jobs", str(jobs), "--json", "--results", str(tmp_path / "r")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout)
    assert [r["label"] for b in run["builds"].values() for r in b["runs"]] == ["CRASH(target)"] * 2 * reps
    spans = []
    for folder in (tmp_path / "r").glob("*/[AC]/[01]"):
        verdict = json.loads((folder / "verdict.json").read_text())
        begun = (folder / "manifest.json").stat().st_mtime
        load_ended = begun + verdict["engine_start_s"] + verdict["load"]["seconds"]
        spans.append((begun, load_ended, (folder / "verdict.json").stat().st_mtime))
    assert len(spans) == 2 * reps

    def most_at_once(intervals: list[tuple[float, float]]) -> int:
        edges = sorted([(t, 1) for t, _ in intervals] + [(t, -1) for _, t in intervals], key=lambda e: (e[0], e[1]))
        now = peak = 0
        for _, step in edges:
            now += step
            peak = max(peak, now)
        return peak

    # a run's tail (its engine's stop, its verdict) overlaps the next run: more runs in flight than
    # slots, at most twice as many (tails and the runs that started in their place)
    assert jobs < most_at_once([(b, v) for b, _, v in spans]) <= 2 * jobs
    # the engine's start and load of a run (its tail excluded): ``jobs``; 50 ms for the files' clocks
    assert most_at_once([(b + 0.05, e - 0.05) for b, e, _ in spans]) <= jobs
