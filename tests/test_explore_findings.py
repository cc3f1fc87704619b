"""kvrepro explore's findings and campaign lock: a new failure's folder gets a minimized trace and an
emitted pytest that fails on the build; a second process on a running campaign gets one line and
exit 2 and writes nothing. The engine is the GPU-free one (the real vLLM scheduler, KV-cache manager
and connector; the model executor faked: no GPU here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from kvrepro.explore.campaign import CampaignBusy, new_campaign, take_lock
from kvrepro.explore.findings import violation_of
from kvrepro.explore.state import CampaignRequest, CampaignState

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)


def kvrepro(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def test_a_corruption_is_minimized_by_its_defect_or_its_group_kind():
    assert violation_of("corruption:mamba-null-state") == "mamba-null-state"
    assert violation_of("corruption:unknown:mamba+offload/missing") == "mamba+offload"
    assert violation_of("corruption:unknown:full_attention/foreign") == "full_attention"


def test_a_second_process_on_a_running_campaign_gets_one_line_and_exit_2(tmp_path):
    """The lock is an flock held by the running process (this test plays it): `--resume` from a second
    process must stop before it writes anything, and name the holder's pid."""
    root = tmp_path / "results"
    state, folder = new_campaign(root, CampaignRequest(base="0.26.0", budget_runs=1))
    before = (folder / "explore.json").read_text()
    fd = take_lock(folder, state.campaign_id)
    try:
        with pytest.raises(CampaignBusy, match=f"pid {os.getpid()}"):
            take_lock(folder, state.campaign_id)
        proc = kvrepro("explore", "--resume", state.campaign_id, "--results", str(root))
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and f"{state.campaign_id} is still running (pid {os.getpid()})" in errors[0]
        assert f"--resume {state.campaign_id}" in errors[0] and "Traceback" not in proc.stderr
        assert (folder / "explore.json").read_text() == before
    finally:
        os.close(fd)
    os.close(take_lock(folder, state.campaign_id))  # let go: the next one takes it


def test_a_new_crash_becomes_a_minimized_finding_with_a_failing_pytest(tmp_path, runtime_python):
    """0.26.0's base load crashes at request 8. With a catalogue that does not know that crash and a
    base matrix whose target_signature names another one (so the run itself says CRASH(other)), the
    crash is NEW: its folder's matrix names it as the target, the minimizer shrinks its trace and the
    emitted scheduler-level test fails on 0.26.0 with it; `--ci` exits 1."""
    catalogue = tmp_path / "defects"
    shutil.copytree(ROOT / "defects", catalogue)
    for name in ("offload-boundary-assert", "offload-boundary-assert-all-mode", "cross-group-eviction-assert"):
        (catalogue / f"{name}.yaml").unlink()
    base = tmp_path / "base"
    shutil.copytree(ROOT / "builds", base / "builds")
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data["target_signature"] = {"exception": "KeyError", "function": "schedule", "file": "vllm/v1/core/sched/scheduler.py"}
    (base / "matrix.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    root = tmp_path / "results"
    proc = kvrepro("explore", "--base", "0.26.0", "--budget", "1", "--requests", "30", "--seed", "1",
                   "--matrix", str(base / "matrix.yaml"), "--catalogue", str(catalogue), "--results", str(root),
                   "--json", "--ci")
    assert proc.returncode == 1, proc.stderr[-3000:]
    state = CampaignState.from_json(json.loads(proc.stdout)["state"])
    assert state.runs[0].verdict == "CRASH(other)"
    (finding,) = state.new_findings
    assert finding.key == "crash:offload_update_state_after_alloc"
    folder = root / state.campaign_id / finding.folder
    target = yaml.safe_load((folder / "matrix.yaml").read_text())["target_signature"]
    assert (target["exception"], target["function"]) == ("AssertionError", "update_state_after_alloc")
    record = json.loads((folder / "finding.json").read_text())["minimized"]
    assert record["ok"] and record["deterministic"] and record["pytest_fails"], record
    assert record["requests"] < record["requests_before"] == 8
    assert finding.minimized == record["note"] and "fails with the target signature" in record["note"]
    lines = (folder / "minimized.trace.jsonl").read_text().splitlines()
    assert len(lines) == 1 + record["requests"]  # the header and the requests
    assert "def test_" in (folder / "test_finding.py").read_text()


def test_a_request_the_load_aborted_is_an_end_not_a_broken_invariant(tmp_path):
    """load.events aborts (a vocabulary knob) are recorded ok with the tokens seen, 0 for a queued
    abort: the invariant must not call that "ok without completion"; a real empty answer still is."""
    from kvrepro.explore.judge import invariant_failures
    from kvrepro.explore.vocabulary import knob

    assert any(v and "abort" in v[0] for v in knob("load.events").values)
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps({"index": i}) + "\n" for i in range(3)))
    (tmp_path / "load.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"index": 0, "ok": True, "completion_tokens": 8},
        {"index": 1, "ok": True, "status": "aborted", "aborted": 0, "completion_tokens": 0, "error": None},
        {"index": 2, "ok": True, "completion_tokens": 0}]))
    assert [f.key for f in invariant_failures(tmp_path, "budget")] == ["invariant:ok-without-completion"]


def test_an_emitted_test_named_by_a_relative_path_runs_that_file(tmp_path, monkeypatch):
    """A campaign under the default `--results results` names its finding's test_finding.py by a
    relative path, and the emitted test runs in its own folder: it must still run that file (it once
    ran `results/.../test_finding.py` inside the finding's folder: exit 2, no such file)."""
    from kvrepro.minimize.pytest_emit import run_emitted

    finding = tmp_path / "results" / "finding"
    finding.mkdir(parents=True)
    (finding / "test_finding.py").write_text("assert 1 == 2, 'the bug'\n")
    monkeypatch.chdir(tmp_path)
    got = run_emitted(Path("results/finding/test_finding.py"), sys.executable, "")
    assert (got.exit, got.exception) == (1, "AssertionError"), got.output
