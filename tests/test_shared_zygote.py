"""Shared engine zygotes (KVREPRO_SHARED_ZYGOTES, kvrepro/deploy/sim.py): a runtime's zygote is
started once by the first command, outlives it, serves the next command's engines, and is stopped
by whoever set the variable (here: conftest.stop_shared_zygotes, as the test session does).

Real parts: two real `kvrepro matrix run` processes, real vLLM engines forked from one real zygote.
The variable points at this test's own folder, not at the session's shared one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, alive, stop_shared_zygotes
from kvrepro.deploy.sim import SHARED_ZYGOTES_ENV, ZYGOTE_ENV

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
