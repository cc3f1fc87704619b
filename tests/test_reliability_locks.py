"""Owners and locks: a bisection signalled, locked against a second and resumed; a run or a temp folder
whose kvrepro vanished is told apart from a live one's (issue 8's faults, injected for real:
tests/reliability.py says how).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import alive, planned_run
from reliability import (
    Cmd, assert_clean_end, kvrepro, left_in_temp, requests_sent, sim_matrix, spawn, synthetic_trace,
    wait_until
)
from reliability import _remove_spawned_tmp  # noqa: F401 - autouse: each spawned command's TMPDIR goes


def test_a_run_whose_process_vanished_is_aborted(tmp_path):
    """run.json says running, its owner process is gone: shown as aborted (a real exited pid)."""
    from kvrepro import lifetime
    from kvrepro.results import store as results

    gone = subprocess.Popen(["true"])
    gone.wait()
    folder = results.create_run(tmp_path, "builds: {A: []}\n", planned_run(**{"build_order": ["A"]}))
    folder.update(owner={"pid": str(gone.pid), "host": lifetime.hostname(), "start": "1"})
    assert results.load_run(tmp_path, folder.run_id).status == "aborted"
    folder.update(owner=lifetime.owner())  # this process: still running
    assert results.load_run(tmp_path, folder.run_id).status == "running"


def probe_mid_load(bisection: Path, sent_before: int) -> bool:
    """The newest probe of `bisection` still says "running" and has sent requests since `sent_before`
    was counted (over the whole bisection folder): its load is under way now."""
    runs = sorted(bisection.glob("probes/*/run.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        return False
    try:
        running = json.loads(runs[-1].read_text()).get("status") == "running"
    except ValueError:  # caught mid-write
        return False
    return running and requests_sent(bisection) > sent_before


@pytest.mark.slow
def test_bisection_signals_lock_and_resume(tmp_path, overlays):
    """`bisect patches`: a second `--resume latest` while it runs refuses with one line (exit 2,
    nothing started); SIGKILL leaves it `aborted` with a lock nobody holds, so `--resume` takes
    it over; SIGTERM to that marks the bisection and its probe run interrupted (were: "running"
    forever), exit 130, nothing left running or in the temp folder."""
    matrix = sim_matrix(tmp_path, requests=600)
    results = tmp_path / "r"
    first = spawn(tmp_path, "bisect", "patches", "--calibrate", "1", "-m", str(matrix), "--results", str(results),
                  name="first")

    def probing(proc: Cmd) -> bool:
        proc.watch()
        return requests_sent(results) >= 1 or proc.poll() is not None
    assert wait_until(lambda: probing(first), 600)
    assert first.poll() is None, first.stderr_text()[-3000:]
    (folder,) = [p.parent for p in results.glob("bisect-*/bisect.json")]

    second = spawn(tmp_path, "bisect", "patches", "--resume", "latest", "-m", str(matrix), "--results", str(results),
                   name="second")
    second.finish(120)
    text = assert_clean_end(second, code=2)
    assert "still running" in text and f"pid {first.pid}" in text, text
    assert len([ln for ln in text.splitlines() if ln.strip()]) <= 2, text  # one line (rich may wrap it)

    # SIGKILL lands while a probe is sending its load (else a probe that finished while `second` ran
    # leaves nothing to abort: seen in CI, ['complete', 'complete', 'interrupted'])
    sent = requests_sent(results)
    assert wait_until(lambda: probe_mid_load(folder, sent) or first.poll() is not None, 600)
    assert first.poll() is None, first.stderr_text()[-3000:]
    first.watch()
    first.send_signal(signal.SIGKILL)
    first.finish()
    assert wait_until(lambda: not any(alive(p) for p in first.seen), 60)
    assert wait_until(lambda: not left_in_temp(first), 60), left_in_temp(first)
    shown = kvrepro("results", "show", folder.name, "--json", "--results", str(results))
    assert shown.returncode == 0 and json.loads(shown.stdout)["status"] == "aborted", shown.stdout[-2000:]

    third = spawn(tmp_path, "bisect", "patches", "--resume", "latest", "-m", str(matrix), "--results", str(results),
                  name="third")
    assert wait_until(lambda: (json.loads((folder / "bisect.json").read_text()).get("owner") or {}).get("pid")
                      == str(third.pid) or third.poll() is not None, 120)
    sent = requests_sent(results)
    assert wait_until(lambda: probing(third) and requests_sent(results) > sent, 600)
    assert third.poll() is None, third.stderr_text()[-3000:]
    third.watch()
    third.send_signal(signal.SIGTERM)
    third.finish()
    assert_clean_end(third)
    state = json.loads((folder / "bisect.json").read_text())
    assert state["status"] == "interrupted"
    from kvrepro.results.store import load_run

    # as read back: the SIGKILLed owner's probe is "aborted", the SIGTERMed one's "interrupted"
    probes = [load_run(folder / "probes", p.parent.name).status for p in sorted(folder.glob("probes/*/run.json"))]
    assert "running" not in probes and probes[-1] == "interrupted" and "aborted" in probes, probes


def test_clean_removes_only_dead_owners_temp_leftovers(tmp_path):
    """What a SIGKILL could leave in the temp folder (a kvrepro's folder whose owner is gone, an
    older kvrepro's zygote folder, vLLM IPC sockets nobody listens on) is removed by `kvrepro
    clean --temp-only`; a live owner's folder and a socket some process listens on stay."""
    from kvrepro import lifetime

    temp = Path(tempfile.mkdtemp(prefix="kc", dir="/tmp"))
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = temp / f"kvrepro-{gone.pid}-abcdef"
    live = temp / f"kvrepro-{os.getpid()}-123456"
    for folder, owner in ((dead, {"pid": str(gone.pid), "host": lifetime.hostname(), "start": "1"}),
                          (live, lifetime.owner())):
        (folder / "engine-tmp").mkdir(parents=True)
        (folder / "owner.json").write_text(json.dumps(owner))
    legacy = temp / "kvrepro-zygote-oldxyz"
    legacy.mkdir()
    (legacy / "zygote.log").write_text("old\n")
    os.utime(legacy, (time.time() - 3600, time.time() - 3600))
    stale = temp / "1b4e28ba-2fa1-41d2-883f-0016d3cca427"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # closed again: the file stays, nobody listens (what a killed engine leaves)
    listening = temp / "6fa459ea-ee8a-4ca4-894e-db77e160355e"
    other = temp / "unrelated.txt"
    other.write_text("not ours\n")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(listening))
    server.listen(1)
    env = dict(os.environ, TMPDIR=str(temp))
    try:
        dry = kvrepro("clean", "--temp-only", "--dry-run", "--json", env=env, timeout=120)
        assert dry.returncode == 0 and "Traceback" not in dry.stderr, dry.stderr
        assert dead.exists() and legacy.exists() and stale.exists()
        proc = kvrepro("clean", "--temp-only", "--json", env=env, timeout=120)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        report = json.loads(proc.stdout)[0]
        assert {i["path"] for i in report["removed"]} == {str(dead), str(legacy), str(stale)}
        assert str(live) in {i["path"] for i in report["kept_temp"]}
        assert sorted(p.name for p in temp.iterdir()) == sorted([live.name, listening.name, other.name])
        human = kvrepro("clean", "--temp-only", env=env, timeout=120)
        assert human.returncode == 0 and "removed 0 leftover" in human.stdout and "kept" in human.stdout
    finally:
        server.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_a_finished_replay_leaves_nothing_in_the_temp_folder(tmp_path, overlays):
    """A replay that runs to its end (exit 0): vLLM's 3 IPC socket files per engine, the zygote's
    socket and log all lived under kvrepro's own temp folder, which is gone with the command
    (was: 3 socket files per engine and a kvrepro-zygote-* folder left in /tmp by every run)."""
    trace = synthetic_trace(tmp_path / "trace.jsonl", requests=5)
    proc = spawn(tmp_path, "load", "replay", str(trace), "-b", "D", "-m", str(sim_matrix(tmp_path)),
                 "--results", str(tmp_path / "r"), "--json")
    sockets: set[str] = set()

    def running() -> bool:
        proc.watch()
        try:
            sockets.update(str(p.relative_to(proc.tmp)) for p in proc.tmp.rglob("*") if p.is_socket())
        except FileNotFoundError:  # a folder went while we walked it: the command's own cleanup at its end
            pass
        return proc.poll() is not None
    assert wait_until(running, 600, every=0.1)
    assert_clean_end(proc, code=0)
    assert json.loads(proc.stdout_text())["requests"] == 5
    engine_sockets = [s for s in sockets if "/engine-tmp/" in s]
    assert len(engine_sockets) >= 3 and all(s.startswith("kvrepro-") for s in sockets), sorted(sockets)
