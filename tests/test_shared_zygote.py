"""Shared engine zygotes (KVREPRO_SHARED_ZYGOTES, kvrepro/deploy/sim.py): a runtime's zygote is
started once by the first command, outlives it, serves the next command's engines, and is stopped
by whoever set the variable (here: kvrepro.deploy.sim.stop_shared_zygotes, as the test session does).

Real parts: two real `kvrepro matrix run` processes, real vLLM engines forked from one real zygote.
The variable points at this test's own folder, not at the session's shared one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, alive
from kvrepro.deploy.sim import SHARED_ZYGOTES_ENV, ZYGOTE_ENV, stop_shared_zygotes

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def matrix_run_a(results: Path, zygotes: Path) -> dict:
    env = dict(os.environ, **{SHARED_ZYGOTES_ENV: str(zygotes)})
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "--build", "A", "--reps", "1",
                           "--json", "--results", str(results)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["builds"]["A"]["runs"][0]


def test_two_commands_fork_their_engines_from_one_zygote_that_outlives_them_until_stopped(tmp_path, overlays):
    zygotes = tmp_path / "zygotes"
    zygotes.mkdir()
    try:
        first = matrix_run_a(tmp_path / "r1", zygotes)
        pid_files = list(zygotes.glob("*.pid"))
        assert len(pid_files) == 1, pid_files  # one runtime, one zygote
        pid = int(pid_files[0].read_text())
        assert alive(pid), "the shared zygote ended with the command that started it"

        second = matrix_run_a(tmp_path / "r2", zygotes)
        assert [p.read_text() for p in zygotes.glob("*.pid")] == [f"{pid}\n"]  # no second zygote
        # both engines were forked by that zygote: its log names one fork per engine
        forks = [line for line in (zygotes / pid_files[0].name.replace(".pid", ".log")).read_text().splitlines()
                 if "forked engine" in line]
        assert len(forks) == 2, forks
        for run in (first, second):  # and a forked engine is the same engine: A still dies on the target
            assert run["verdict"] == "CRASH" and run["outcome"] == "target", run
    finally:
        stopped = stop_shared_zygotes(zygotes)
    assert stopped and not any(alive(p) for p in stopped)


def test_the_minimizers_offline_engine_forks_from_the_shared_zygote_and_crashes_alike(tmp_path, overlays,
                                                                                   default_matrix, monkeypatch):
    """`kvrepro minimize`'s oracle (kvrepro.engine.offline behind OfflineEngine) with the variable set:
    forked by the shared zygote (its log names the fork; the engine's parent is the zygote, not the
    thin client), and the shipped minimized A trace crashes it on the target assertion at the same
    request as an engine started on its own."""
    from kvrepro.loadgen.trace import read_trace
    from kvrepro.minimize.shrink import OfflineEngine

    job = list(read_trace(ROOT / "tests" / "data" / "traces" / "minimized-A.trace.jsonl").requests)
    zygotes = tmp_path / "zygotes"
    zygotes.mkdir()
    monkeypatch.setenv(SHARED_ZYGOTES_ENV, str(zygotes))
    try:
        forked = OfflineEngine(default_matrix, "A", 0)
        try:
            (pid_file,) = zygotes.glob("*.pid")
            zygote_pid = int(pid_file.read_text())
            log = pid_file.with_suffix(".log").read_text()
            (engine_pid,) = [int(line.split()[-1]) for line in log.splitlines() if "forked engine" in line]
            stat = Path(f"/proc/{engine_pid}/stat").read_text()
            assert int(stat[stat.rindex(")") + 2:].split()[1]) == zygote_pid  # ppid: the zygote itself
            assert forked.env[ZYGOTE_ENV] == str(pid_file.with_suffix(".sock"))
            by_zygote = forked.run(job)
        finally:
            forked.close()
        assert not alive(engine_pid)  # closing the oracle ends the forked engine, the zygote stays
        assert alive(zygote_pid)
    finally:
        stopped = stop_shared_zygotes(zygotes)
    assert stopped and not any(alive(p) for p in stopped)
    monkeypatch.delenv(SHARED_ZYGOTES_ENV)
    alone = OfflineEngine(default_matrix, "A", 0)
    try:
        assert ZYGOTE_ENV not in alone.env  # without the variable: a plain `python -m kvrepro.engine.offline`
        by_itself = alone.run(job)
    finally:
        alone.close()
    assert by_zygote.crashed and by_zygote.function == "update_state_after_alloc", by_zygote
    assert (by_zygote.crash_at, by_zygote.statement) == (by_itself.crash_at, by_itself.statement)


def test_engines_of_one_build_fork_from_one_build_zygote_and_judge_as_engines_that_import_vllm(tmp_path, overlays):
    """Build zygotes (kvrepro/engine/zygote.py): the runtime zygote forks one child per build that
    imports the build's vLLM once; both engines of build A fork from it, and each engine's own log
    still has what the classifier and a reader need (the plugin's lines, the probe's `installed` line
    from the engine's own process, the EngineCore). The same runs with KVREPRO_BUILD_ZYGOTES=0 (each
    engine imports vLLM itself) give the same verdicts. Stopping the zygotes leaves no process.
    Real parts: real `kvrepro matrix run` commands, real vLLM engines; only the GPU is faked."""
    from kvrepro.deploy.sim import stop_shared_zygotes as stop
    from kvrepro.engine.zygote import BUILD_ZYGOTES_ENV

    zygotes = tmp_path / "zygotes"
    zygotes.mkdir()

    def run_a(results: Path, **variables: str) -> list[dict]:
        env = dict(os.environ, **{SHARED_ZYGOTES_ENV: str(zygotes)}, **variables)
        proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "--build", "A", "--reps", "2",
                               "--jobs", "1", "--json", "--results", str(results)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)["builds"]["A"]["runs"]

    try:
        forked = run_a(tmp_path / "forked")
        (pid_file,) = zygotes.glob("*.pid")
        zygote_pid = int(pid_file.read_text())
        log = pid_file.with_suffix(".log").read_text()
        (started,) = [line for line in log.splitlines() if "started build zygote" in line]
        build_pid = int(started.split()[5])
        assert alive(build_pid)  # it stays for the next engine of A, as the shared zygote does
        own = run_a(tmp_path / "own", **{BUILD_ZYGOTES_ENV: "0"})
        tree = {build_pid} | {int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == zygote_pid}
    finally:
        stopped = stop(zygotes)
    assert stopped and not any(alive(p) for p in [*stopped, *tree])

    for run in forked:
        text = Path(run["run_dir"], "engine.log").read_text(errors="replace")
        assert f"kvrepro zygote: forked from build zygote {build_pid}" in text
        assert "Platform plugin kvrepro_sim is activated" in text  # printed by the build zygote's import
        probe = [line for line in text.splitlines() if "kvrepro-probe: installed" in line]
        assert len(probe) == 1 and probe[0].startswith("(APIServer pid=")  # from this engine, not the zygote
        assert "(EngineCore" in text and "Sim executor: no GPU" in text
    for run in own:
        text = Path(run["run_dir"], "engine.log").read_text(errors="replace")
        assert "forked from build zygote" not in text and "kvrepro-probe: installed" in text
    assert [(r["verdict"], r["outcome"]) for r in forked] == [(r["verdict"], r["outcome"]) for r in own] \
        == [("CRASH", "target")] * 2
    assert all(r["trigger_count"] >= 1 for r in forked + own)  # the probe counted in every engine


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


RUNTIME_SCRIPT = """
import json, os, sys
preloaded = "torch" in sys.modules  # before this script imports anything heavy
first = {"vllm": "vllm" in sys.modules, "probe": "kvrepro_probe" in sys.modules}
import vllm
print(json.dumps({"preloaded": preloaded, "first": first, "argv": sys.argv[1:], "cwd": os.getcwd(),
                  "marker": os.environ.get("KVREPRO_TEST_MARKER"), "stdin": sys.stdin.read(),
                  "vllm": os.path.dirname(vllm.__file__), "parent": os.getppid()}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_runtime_scripts_fork_from_the_workers_zygote_and_run_as_a_fresh_interpreter_would(
        tmp_path, runtime_python, runtime_scripts, pristine_vllm):
    """conftest's ``runtime_scripts`` (what tests/test_probe.py and others run their vLLM scripts
    with): forked from the worker's shared zygote (torch already imported there, vLLM and the probe
    not), with the caller's argv, environment, working directory, stdin, stdout, stderr and exit code;
    and the same script in a fresh interpreter gives the same answer but for the preload."""
    if os.environ.get("KVREPRO_TEST_OWN_ZYGOTES"):
        pytest.skip("KVREPRO_TEST_OWN_ZYGOTES: every script runs in a fresh interpreter")
    env = dict(os.environ, PYTHONPATH=str(pristine_vllm), KVREPRO_TEST_MARKER="m1")
    forked_before = runtime_scripts.forked
    proc = runtime_scripts.run(runtime_python, ["-c", RUNTIME_SCRIPT, "a b", "c"], env=env, timeout=300,
                               input="from stdin", cwd=tmp_path)
    assert runtime_scripts.forked == forked_before + 1, proc.stderr[-2000:]
    fresh = subprocess.run([str(runtime_python), "-c", RUNTIME_SCRIPT, "a b", "c"], env=env, input="from stdin",
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    got, plain = json.loads(proc.stdout.splitlines()[-1]), json.loads(fresh.stdout.splitlines()[-1])
    assert proc.returncode == fresh.returncode == 3, (proc.stderr[-2000:], fresh.stderr[-2000:])
    assert proc.stderr.strip().splitlines()[-1] == "to stderr" == fresh.stderr.strip().splitlines()[-1]
    assert got["preloaded"] and not plain["preloaded"]  # the fork is what saves the import
    assert got["parent"] != os.getpid()  # forked by the zygote, not started by this test
    for key in ("first", "argv", "cwd", "marker", "stdin", "vllm"):
        assert got[key] == plain[key], (key, got, plain)
    assert got["first"] == {"vllm": False, "probe": False}
    assert got["argv"] == ["a b", "c"] and got["marker"] == "m1" and got["vllm"] == str(pristine_vllm / "vllm")


def test_a_zygote_whose_socket_folder_is_removed_stops_with_its_engines(tmp_path, overlays):
    """A zygote no one can reach any more stops by itself: its owner died (SIGKILL: the janitor
    removes the owner's scratch folder; a killed test session's temporary folder goes), so no
    SIGTERM will come. Without the check, the zygote and its build zygotes (torch and vLLM
    preloaded, ~0.5 GB each) stayed up: 9 of them 75-87 min after their test sessions were killed
    (measured 2026-12-05). Real parts: a real `kvrepro matrix run` leaves a real shared zygote."""
    import shutil
    import time

    zygotes = tmp_path / "zygotes"
    zygotes.mkdir()
    matrix_run_a(tmp_path / "r1", zygotes)
    pid = int(next(zygotes.glob("*.pid")).read_text())
    group = os.getpgid(pid)
    try:
        assert alive(pid), "the shared zygote ended with the command that started it"
        shutil.rmtree(zygotes)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.2)
        assert not alive(pid), "the zygote outlived its socket's folder"
        deadline = time.monotonic() + 30  # and what it started: its build zygotes, its engines
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"process group {group} still has members after its zygote stopped")
    finally:
        if alive(pid):
            os.killpg(group, 9)
