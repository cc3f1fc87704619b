"""`bisect patches` over a pool with a decoy, with the engine runs scripted.

What is faked, and why: the one boundary that starts engines (``Session._run_batch``, and the
background build prefetch) answers every point from a table written from what the default matrix
measured on vLLM 0.26.0 (A crashes, the boundary fix alone reads stale KV, the backports together
are clean). This machine has the engine, but the table also holds an outcome no real build gives
on demand (pr-48425 alone: wrong KV, then a death of something else), which is the case the
search's rules must get right; and a real 5-patch search is tens of engine runs. The search, the
rules, the session and its record (``bisect.json``) are real. Real engines run the same kind of
search in tests/test_bisect_e2e.py (`bisect patches` names the boundary fix on the default matrix;
`bisect commits` on a real git history), and the 5-patch search is in docs/first-case.md ("Build E").
"""

from __future__ import annotations

import pytest

from kvrepro import bisect
from kvrepro.bisect.points import PatchSetPoint
from kvrepro.bisect.rules import RunSummary
from kvrepro.bisect.state import BisectRequest
from kvrepro.bisect.session import Session

from conftest import ROOT

POOL = ["pr-52771", "pr-52807", "pr-48425", "pr-50344", "decoy-docstring"]


def scripted(patches: list[str]) -> dict:
    """One run of the point with these candidates on 0.26.0 + pr-49146."""
    have = set(patches)
    if {"pr-48425", "pr-50344"} <= have:
        return {"verdict": "UNREACHED", "outcome": "none", "kv_check": "ok", "trigger_count": 199}
    if "pr-48425" in have:
        # the FA-deeper hit reaches the connector; the run reads wrong KV, then dies of something else
        return {"verdict": "CRASH", "outcome": "other_crash", "kv_check": "corrupt", "trigger_count": 50,
                "title": "RuntimeError in something_unrelated: x"}
    if "pr-52807" in have:
        return {"verdict": "CORRUPT", "outcome": "none", "kv_check": "corrupt", "trigger_count": 199}
    return {"verdict": "CRASH", "outcome": "target", "kv_check": "corrupt", "trigger_count": 1,
            "title": "AssertionError in update_state_after_alloc: num_locally_computed_tokens <= x"}


@pytest.fixture
def scripted_engine(monkeypatch):
    asked: list[list[str]] = []

    def run_batch(self, point, record, count):
        asked.append(list(point.patches))
        if "pr-50344" in point.patches and "pr-48425" not in point.patches:
            record.build_error = "patch pr-50344: vllm/v1/core/sched/scheduler.py: hunk #2 does not apply"
            return
        first = len(record.runs)
        for rep in range(first, first + count):
            record.runs.append(RunSummary(**scripted(list(point.patches)), rep=rep, requests=600))
        self.save()

    monkeypatch.setattr(Session, "_run_batch", run_batch)
    monkeypatch.setattr(Session, "prefetch", lambda self, points: None)
    return asked


def test_names_the_backports_never_the_decoy_and_says_what_each_removes(tmp_path, scripted_engine):
    request = BisectRequest(matrix=str(ROOT / "matrix.yaml"), patches=POOL, alpha=0.05, calibrate=3)
    result = bisect.start("patches", request, tmp_path)
    assert result.answer == ["pr-48425", "pr-50344"], result
    assert "decoy-docstring" not in result.answer
    # 3/3 crashes at the bad end: p_bad 0.8, two clean runs per good point, each good step right
    # with probability 1 - 0.2^2
    goods = [s for s in result.steps if s.verdict == "good"]
    assert result.p_bad == 0.8 and all(sum(s.counts.values()) == 2 for s in goods)
    assert result.confidence == pytest.approx((1 - 0.2 ** 2) ** len(goods), abs=1e-4)
    # each member: what the answer without it showed
    members = result.detail["member_removes"]
    assert members["pr-50344"] == "bad again: 2x CRASH(other)+CORRUPT", members
    assert members["pr-48425"].startswith("undecided (skip): build failed: patch pr-50344"), members
    without = result.detail["without_each"]
    assert without["decoy-docstring"].startswith("still clean"), without
    assert without["pr-52771"].startswith("still clean") and without["pr-52807"].startswith("still clean")
    assert without["pr-48425"].startswith("undecided (skip)") and without["pr-50344"].startswith("bad again")
    # a point whose only runs were wrong KV ending in an unrelated crash was decided bad, not skipped
    steps = {s.label: s for s in result.steps}
    assert steps["pr-48425"].verdict == "bad"
    assert steps["pr-52771 + pr-52807"].verdict == "bad"  # build D: CORRUPT is bad without --title
    print("\n".join(f"{s.role:9} {s.label:55} {s.verdict} {s.counts}" for s in result.steps))
    # no recorded point was run again
    keys = [PatchSetPoint(tuple(p)).key for p in scripted_engine]
    assert len(keys) == len(set(keys))


def test_with_the_title_the_boundary_fix_alone_removes_the_assertion(tmp_path, scripted_engine):
    request = BisectRequest(matrix=str(ROOT / "matrix.yaml"), patches=POOL,
                            title="AssertionError in update_state_after_alloc", alpha=0.05, calibrate=3)
    result = bisect.start("patches", request, tmp_path)
    # CORRUPT counts as clean for this question; the first half of the pool already has no assertion
    assert result.answer == ["pr-52807"], result
