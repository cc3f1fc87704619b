"""bisect.json as typed records: files written before the records existed are read, resumed and
written back in the same form."""

from __future__ import annotations

import json

import pytest

from kvrepro import bisect
from kvrepro.bisect.points import CommitPoint, PatchSetPoint, ReleasePoint, point_from_json
from kvrepro.bisect.rules import RunSummary
from kvrepro.bisect.state import SessionState
from kvrepro.errors import SpecError

# exactly what kvrepro wrote when the state was a dict (bisect releases, finished)
OLD = {
    "bisection_id": "bisect-20260101-000000-abcd", "kind": "releases", "status": "complete", "started": 1767225600.0,
    "request": {"matrix": "/w/matrix.yaml", "bad": "0.26.0", "good": "0.30.0", "build": None, "target": "sim",
                "title": None, "alpha": 0.05, "calibrate": 3, "max_runs": None, "requests": 600, "jobs": None},
    "points": {
        "release:0.26.0": {"point": {"kind": "release", "release": "0.26.0"},
                           "runs": [{"verdict": "CRASH", "outcome": "target", "title": "AssertionError in x: y",
                                     "rep": 0, "trigger_count": 1, "state_count": 1, "requests": 12,
                                     "kv_check": "ok", "kv_violations": 0, "seconds": 3.5,
                                     "run_dir": "probes/r1/A/0", "stopped_because": None}],
                           "probe_runs": ["probes/r1"], "verdict": "bad"},
        "release:0.27.0": {"point": {"kind": "release", "release": "0.27.0"}, "runs": [], "probe_runs": ["probes/r2"],
                           "build_error": "patch p: hunk #1 does not apply", "verdict": "skip"},
    },
    "steps": [
        {"point": {"kind": "release", "release": "0.26.0"}, "label": "0.26.0", "role": "bad end", "verdict": "bad",
         "counts": {"CRASH(target)": 1}, "runs_needed_for_good": None, "state": None, "reason": "",
         "probe_runs": ["probes/r1"], "seconds": 4.1},
        {"point": {"kind": "release", "release": "0.27.0"}, "label": "0.27.0", "role": "midpoint", "verdict": "skip",
         "counts": {}, "runs_needed_for_good": 2, "state": None, "reason": "build failed: patch p",
         "probe_runs": ["probes/r2"], "seconds": 0.3},
    ],
    "answer": "0.28.0", "reason": "", "p_bad": 0.8, "alpha": 0.05, "confidence": 0.96,
    "detail": {"direction": "fixed", "last_bad": "0.27.1", "first_good": "0.28.0"},
    "owner": {"pid": "123", "host": "h", "start": "9"}, "finished": 1767225700.0, "seconds": 100.0,
}


def test_an_old_state_file_is_read_as_records_and_written_back_the_same(tmp_path):
    folder = tmp_path / OLD["bisection_id"]
    folder.mkdir()
    (folder / "bisect.json").write_text(json.dumps(OLD))
    state = bisect.load_state(tmp_path, "latest")
    assert isinstance(state, SessionState) and state.request.requests == 600 and state.request.target == "sim"
    record = state.points["release:0.26.0"]
    assert record.point == ReleasePoint("0.26.0") and record.verdict == "bad"
    assert record.runs == [RunSummary(verdict="CRASH", outcome="target", title="AssertionError in x: y", rep=0,
                                      trigger_count=1, state_count=1, requests=12, kv_check="ok", kv_violations=0,
                                      seconds=3.5, run_dir="probes/r1/A/0")]
    assert state.points["release:0.27.0"].build_error.startswith("patch p")
    written = state.to_json()
    assert written["request"].items() >= OLD["request"].items()  # plus the other commands' fields, unset
    assert {**written, "request": OLD["request"]} == OLD  # nothing lost or renamed

    result = bisect.resume(tmp_path, "latest", "releases")  # complete: read, not run again
    assert result.answer == "0.28.0" and result.status == "complete" and result.detail["first_good"] == "0.28.0"
    assert [s.point for s in result.steps] == [ReleasePoint("0.26.0"), ReleasePoint("0.27.0")]
    assert result.steps[1].probe_runs == ("probes/r2",)


def test_older_files_missing_optional_keys_and_with_unknown_ones_are_read(tmp_path):
    old = {k: v for k, v in OLD.items() if k not in ("owner", "finished", "seconds", "detail", "confidence")}
    old["request"] = {**OLD["request"], "some_future_flag": True}
    old["steps"] = [{k: v for k, v in OLD["steps"][0].items() if k not in ("probe_runs", "seconds")}]
    state = SessionState.from_json(old)
    assert state.detail == {} and state.owner is None and state.steps[0].probe_runs == ()
    with pytest.raises(SpecError, match="not a bisection's state"):
        SessionState.from_json({"kind": "releases"})


def test_points_keep_their_json_form():
    for point in (ReleasePoint("0.27.1"), CommitPoint("a" * 40), PatchSetPoint(("pr-1", "pr-2"))):
        assert point_from_json(point.to_json()) == point
    assert PatchSetPoint(("pr-1", "pr-2")).to_json() == {"kind": "patches", "patches": ["pr-1", "pr-2"]}
    assert (PatchSetPoint(("pr-1",)).key, CommitPoint("a" * 40).label) == ("patches:pr-1", "a" * 12)
    assert PatchSetPoint(tuple(f"patch-number-{i}" for i in range(9))).build_name.startswith("patch-number-0_and_8_more_")


def test_a_wrong_value_is_named_by_its_field_not_misread():
    """Read typed, field by field (kvrepro.records.from_jsonable, as run.json and the manifests are):
    a value of the wrong type is reported where it is, instead of travelling on as a string."""
    wrong = {**OLD, "request": {**OLD["request"], "requests": "many"}}
    with pytest.raises(SpecError, match=r"request\.requests: expected an integer"):
        SessionState.from_json(wrong)
    bad_point = {**OLD, "steps": [{**OLD["steps"][0], "point": {"kind": "nonsense"}}]}
    with pytest.raises(SpecError, match=r"steps\[0\]\.point: not a bisection point"):
        SessionState.from_json(bad_point)
    runs = json.loads(json.dumps(OLD))
    runs["points"]["release:0.26.0"]["runs"][0]["trigger_count"] = 1.0  # a counter scraped as a float
    assert SessionState.from_json(runs).points["release:0.26.0"].runs[0].trigger_count == 1
