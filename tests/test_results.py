"""results/: atomic files, every finished run readable, interrupted runs keep what they had."""

from __future__ import annotations

import json
import os

import pytest

from kvrepro.report import render as report
from kvrepro.results import store as results
from kvrepro.errors import KvreproError
from kvrepro.records import Outcome, RunResult, Verdict
from conftest import planned_run


def _result(build, rep, verdict=Verdict.CRASH, outcome=Outcome.TARGET):
    return RunResult(build=build, rep=rep, verdict=verdict, outcome=outcome, title="AssertionError in f: x",
                     trigger_count=3, external_hit_calls=7, requests=10, seconds=1.5)


def test_write_atomic_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "a" / "verdict.json"
    results.write_json(target, _result("A", 0))
    results.write_json(target, _result("A", 1))
    assert json.loads(target.read_text())["rep"] == 1
    assert os.listdir(target.parent) == ["verdict.json"]


def test_write_atomic_keeps_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "verdict.json"
    results.write_json(target, {"ok": 1})
    with pytest.raises(TypeError):
        results.write_atomic(target, object())  # type: ignore[arg-type]
    assert json.loads(target.read_text()) == {"ok": 1}
    assert os.listdir(tmp_path) == ["verdict.json"]


def test_run_reads_back_from_disk_including_an_interrupted_one(tmp_path):
    folder = results.create_run(tmp_path, "base: x\n", planned_run(**{"build_order": ["A", "B"], "target": "sim",
                                                        "builds": {"A": {"patches": ["p1"]}, "B": {"patches": []}}}))
    results.write_json(folder.rep_dir("A", 0) / "verdict.json", _result("A", 0))
    results.write_json(folder.rep_dir("A", 1) / "verdict.json", _result("A", 1, Verdict.SURVIVED, Outcome.NONE))
    folder.rep_dir("A", 2)  # started, never finished: no verdict
    folder.update(status="interrupted")
    run = results.load_run(tmp_path, "latest")
    assert run.status == "interrupted"
    assert [r.verdict for r in run.build("A").runs] == [Verdict.CRASH, Verdict.SURVIVED]
    assert run.build("B").runs == ()
    data = report.matrix_json(run)
    assert data["builds"]["A"]["patches"] == ["p1"]
    assert data["builds"]["A"]["runs"][0]["verdict"] == "CRASH"
    assert (folder.path / "matrix.yaml").read_text() == "base: x\n"


def test_unknown_run_is_a_clear_error(tmp_path):
    with pytest.raises(KvreproError, match="no runs under"):
        results.load_run(tmp_path, "latest")
    results.create_run(tmp_path, "", planned_run(**{"build_order": []}))
    with pytest.raises(KvreproError, match="no run 'nope'"):
        results.load_run(tmp_path, "nope")


def test_verdict_labels():
    assert _result("A", 0).label == "CRASH(target)"
    assert _result("A", 0, outcome=Outcome.OTHER_CRASH).label == "CRASH(other)"
    assert _result("A", 0, Verdict.VACUOUS, Outcome.NONE).label == "VACUOUS"
