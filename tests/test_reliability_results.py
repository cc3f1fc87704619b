"""Recorded results read back: damaged or impossible run.json files are DAMAGED in one line, `results list`
follows its folder through an index and says what it omits (issue 8's faults, injected for real:
tests/reliability.py says how).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from conftest import planned_run
from reliability import kvrepro, one_clear_line


def test_damaged_run_json_and_verdict_json(tmp_path):
    """A truncated run.json fails only `show` of that run (one line naming the file, exit 2). An
    empty or truncated verdict.json degrades that repetition only: `results show`, `report` and
    `results list` show it as DAMAGED, the other repetitions as recorded, exit 0 (README)."""
    from kvrepro.results import store as results
    from kvrepro.records import Outcome, RunResult, Verdict

    good = results.create_run(tmp_path, "builds: {A: []}\n", planned_run(**{"build_order": ["A"], "builds": {"A": {"patches": []}}}))
    good.rep_dir("A", 0)
    good.update(status="complete")
    time.sleep(1.1)  # run ids are per second
    broken = results.create_run(tmp_path, "builds: {A: []}\n", planned_run(**{"build_order": ["A"]}))
    text = (broken.path / "run.json").read_text()
    (broken.path / "run.json").write_text(text[: len(text) // 2])
    time.sleep(1.1)
    damaged = results.create_run(tmp_path, "builds: {A: []}\n", planned_run(**{"build_order": ["A"], "builds": {"A": {"patches": []}}}))
    for rep in range(3):
        results.write_json(damaged.rep_dir("A", rep) / "verdict.json", RunResult(
            build="A", rep=rep, verdict=Verdict.CRASH, outcome=Outcome.TARGET, title="boom", trigger_count=1,
            external_hit_calls=1, requests=4, seconds=1.0, run_dir=str(damaged.rep_dir("A", rep))))
    damaged.update(status="complete")
    full = (damaged.rep_dir("A", 1) / "verdict.json").read_text()
    (damaged.rep_dir("A", 1) / "verdict.json").write_text(full[: len(full) // 3])  # truncated
    (damaged.rep_dir("A", 2) / "verdict.json").write_text("")  # empty

    one_clear_line(kvrepro("results", "show", broken.run_id, "--results", str(tmp_path)), 2,
                   "run.json: unreadable", "damaged")
    shown = kvrepro("results", "show", damaged.run_id, "--json", "--results", str(tmp_path))
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    runs = json.loads(shown.stdout)["builds"][0]["runs"]
    assert [r["verdict"] for r in runs] == ["CRASH", "DAMAGED", "DAMAGED"]
    assert "verdict.json" in runs[1]["title"] and "unreadable" in runs[1]["title"]
    table = kvrepro("results", "show", damaged.run_id, "--results", str(tmp_path))
    assert table.returncode == 0 and "DAMAGED" in table.stdout and "Traceback" not in table.stderr, table.stderr
    made = kvrepro("report", damaged.run_id, "--results", str(tmp_path))
    assert made.returncode == 0 and "Traceback" not in made.stderr, made.stderr
    assert "DAMAGED" in (damaged.path / "report.md").read_text()
    for index in ("1", "0"):  # the same rows from the index and from reading every run
        listed = kvrepro("results", "list", "--json", "--results", str(tmp_path),
                         env=dict(os.environ, KVREPRO_RESULTS_INDEX=index))
        assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
        rows = json.loads(listed.stdout)
        assert [r["status"] for r in rows] == ["complete", "unreadable", "complete"]
        assert rows[0]["run_id"] == good.run_id
        assert rows[2]["builds"] == {"A": ["CRASH(target)", "DAMAGED", "DAMAGED"]}


def test_latest_hint_lists_runs_only(tmp_path):
    from kvrepro.results import store as results

    (tmp_path / "README.md").write_text("about results\n")
    run = results.create_run(tmp_path, "builds: {A: []}\n", planned_run(**{"build_order": []}))
    proc = kvrepro("results", "show", "nope", "--results", str(tmp_path))
    flat = one_clear_line(proc, 2, f"latest: {run.run_id}")
    assert "README.md" not in flat


def test_results_list_index_follows_the_folder(tmp_path):
    """The index (results/.index.json) lists exactly what reading every run lists, after runs are
    added, finish, are interrupted, edited or deleted by hand, and when a running run's owner
    is gone; a damaged index is rebuilt."""
    from kvrepro import lifetime
    from kvrepro.results import store as results
    from kvrepro.records import Outcome, RunResult, Verdict

    def listing() -> list:
        rows = []
        for index in ("1", "0"):
            proc = kvrepro("results", "list", "--json", "--results", str(tmp_path),
                           env=dict(os.environ, KVREPRO_RESULTS_INDEX=index), timeout=120)
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
            rows.append(json.loads(proc.stdout))
        assert rows[0] == rows[1], rows
        assert (tmp_path / ".index.json").is_file()
        return rows[0]

    def verdict(folder, rep: int, v=Verdict.SURVIVED) -> None:
        results.write_json(folder.rep_dir("A", rep) / "verdict.json", RunResult(
            build="A", rep=rep, verdict=v, outcome=Outcome.NONE, title="", trigger_count=1,
            external_hit_calls=1, requests=4, seconds=1.0))

    info = {"build_order": ["A"], "builds": {"A": {"patches": []}}}
    one = results.create_run(tmp_path, "builds: {A: []}\n", planned_run(**info))
    assert [r["status"] for r in listing()] == ["running"]
    verdict(one, 0)
    assert listing()[0]["builds"] == {"A": ["SURVIVED"]}
    verdict(one, 1, Verdict.CORRUPT)
    one.update(status="complete")
    assert listing()[0] == {"run_id": one.run_id, "status": "complete", "target": "", "base": "",
                            "builds": {"A": ["SURVIVED", "CORRUPT"]}}
    time.sleep(1.1)
    two = results.create_run(tmp_path, "builds: {A: []}\n", planned_run(**info))
    (two.rep_dir("A", 0) / "engine.log").write_text("started\n")
    two.update(status="interrupted")
    assert [(r["run_id"], r["status"], r["builds"]) for r in listing()][1] == (two.run_id, "interrupted",
                                                                               {"A": ["INCOMPLETE"]})
    gone = subprocess.Popen(["true"])
    gone.wait()
    time.sleep(1.1)
    three = results.create_run(tmp_path, "builds: {A: []}\n", planned_run(**info))
    assert listing()[2]["status"] == "running"
    three.update(owner={"pid": str(gone.pid), "host": lifetime.hostname(), "start": "1"})
    assert listing()[2]["status"] == "aborted"
    path = one.rep_dir("A", 1) / "verdict.json"
    path.write_text(path.read_text()[:10])  # edited in place by hand
    assert listing()[0]["builds"] == {"A": ["SURVIVED", "DAMAGED"]}
    shutil.rmtree(two.path)  # deleted by hand
    assert [r["run_id"] for r in listing()] == [one.run_id, three.run_id]
    (tmp_path / ".index.json").write_text("{not json")
    assert [r["run_id"] for r in listing()] == [one.run_id, three.run_id]
    assert json.loads((tmp_path / ".index.json").read_text())["version"] == 2


def _recorded_run(root: Path, verdicts: dict[int, str]):
    """A recorded run of build A with the given repetitions (as `matrix run` writes them)."""
    from kvrepro.results import store as results
    from kvrepro.records import Outcome, RunResult, Verdict

    folder = results.create_run(root, "builds: {A: []}\n", planned_run(**{"build_order": ["A"], "builds": {"A": {"patches": []}}}))
    for rep, label in verdicts.items():
        verdict = Verdict.CRASH if label.startswith("CRASH") else Verdict(label)
        outcome = Outcome.TARGET if label == "CRASH(target)" else Outcome.NONE
        run_dir = folder.rep_dir("A", rep)
        (run_dir / "trace.jsonl").write_text(json.dumps({"trace": 1, "rep": rep}) + "\n")
        results.write_json(run_dir / "verdict.json", RunResult(
            build="A", rep=rep, verdict=verdict, outcome=outcome, title="t", trigger_count=1, external_hit_calls=1,
            requests=4, seconds=1.0, run_dir=str(run_dir)))
    folder.update(status="complete")
    return folder


def test_run_json_with_an_impossible_number_is_damaged(tmp_path):
    for where in ('"schema": 1e999999', '"started": 1e999999'):
        folder = _recorded_run(tmp_path / where[1:7], {0: "CRASH(target)"})
        text = (folder.path / "run.json").read_text()
        key = where.split(":")[0]
        start = text.index(key)
        end = text.index(",", start)
        (folder.path / "run.json").write_text(text[:start] + where + text[end:])
        flat = one_clear_line(kvrepro("results", "show", folder.run_id, "--results", str(folder.root)), 2,
                              "run.json: unreadable", "damaged")
        assert "newer" not in flat and "older" not in flat


def test_minimize_rep_that_does_not_exist_or_did_not_crash(tmp_path):
    folder = _recorded_run(tmp_path, {0: "CRASH(target)", 1: "SURVIVED"})
    flat = one_clear_line(kvrepro("minimize", folder.run_id, "--build", "A", "--rep", "7", "--results", str(tmp_path)),
                          2, f"--rep 7: run {folder.run_id} has no repetition 7 of build A (it has 0, 1)",
                          "crashed with the target signature or were CORRUPT: 0")
    assert "no repetition crashed" not in flat
    one_clear_line(kvrepro("minimize", folder.run_id, "--build", "A", "--rep", "1", "--results", str(tmp_path)),
                   2, "--rep 1: repetition 1 of build A", "is SURVIVED: only a target crash or a corruption")


def test_results_list_says_what_it_omits(tmp_path):
    _recorded_run(tmp_path, {0: "CRASH(target)"})
    (tmp_path / "bisect-20260101-000000-abcd").mkdir()
    (tmp_path / "bisect-20260101-000000-abcd" / "bisect.json").write_text("{}")
    (tmp_path / "half-made").mkdir()
    for extra in ((), ("--json",)):
        proc = kvrepro("results", "list", "--results", str(tmp_path), *extra)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        flat = " ".join(proc.stderr.split())
        assert "1 bisection(s) not listed: bisect-20260101-000000-abcd" in flat, flat
        assert "1 folder(s) that are not runs (no run.json): half-made" in flat, flat
    assert len(json.loads(proc.stdout)) == 1
