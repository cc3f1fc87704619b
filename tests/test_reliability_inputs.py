"""Bad input at once, in one line: a matrix that is a folder or not UTF-8, a busy or bad port, a missing
source, an empty results folder, a truncated trace, a missing package (issue 8's faults, injected for
real: tests/reliability.py says how).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from reliability import kvrepro, one_clear_line


def test_matrix_pointing_at_a_folder(tmp_path):
    one_clear_line(kvrepro("matrix", "validate", "-m", str(ROOT)), 2, "is a folder", "matrix.yaml")


def test_matrix_not_utf8(tmp_path):
    bad = tmp_path / "matrix.yaml"
    bad.write_bytes(b"base: '0.26.0'\n# caf\xe9\nbuilds: {A: []}\n")
    one_clear_line(kvrepro("matrix", "validate", "-m", str(bad)), 2, f"{bad}:2", "not UTF-8")


def test_engine_serve_bad_port():
    proc = kvrepro("engine", "serve", "--build", "A", "--port", "-1", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--port" in proc.stderr


def test_classify_a_folder(tmp_path):
    one_clear_line(kvrepro("classify", str(tmp_path)), 2, "is a folder", "engine.log")


@pytest.mark.parametrize("args", [("results", "show"), ("report",), ("minimize", "--build", "A"),
                                  ("matrix", "show")], ids=["show", "report", "minimize", "matrix-show"])
def test_commands_on_an_empty_results_folder(tmp_path, args):
    (tmp_path / "r").mkdir()
    one_clear_line(kvrepro(*args, "--results", str(tmp_path / "r")), 2, f"no runs under {tmp_path / 'r'}/")


def test_git_bisect_verdict_on_an_unknown_release_is_bad_input(tmp_path):
    proc = kvrepro("matrix", "verdict", "--release", "9.9.9", "--git-bisect", "--results", str(tmp_path / "r"))
    flat = one_clear_line(proc, 128, "--release 9.9.9: not a vLLM release kvrepro supports")
    assert "runs" not in flat.split("error:")[0]  # nothing drawn before the line
    proc = kvrepro("matrix", "verdict", "--release", "9.9.9", "--results", str(tmp_path / "r"))
    one_clear_line(proc, 2, "--release 9.9.9: not a vLLM release kvrepro supports")
    assert not (tmp_path / "r").exists()


def test_engine_serve_on_a_busy_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        proc = kvrepro("engine", "serve", "--build", "A", "--port", str(port), timeout=120)
        elapsed = time.monotonic() - started
    one_clear_line(proc, 2, f"--port {port}: 127.0.0.1:{port} is in use", "choose another --port")
    assert "serving build" not in proc.stderr and elapsed < 30, elapsed


def test_replay_of_a_trace_whose_only_request_is_truncated(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"trace": 1, "rep": 0, "load": {}}) + "\n"
                     + '{"index": 0, "slot": 0, "sent_s": 0.0, "in_flight": 1, "max_tokens": 8, "tokens": [1, 2, 3')
    results = tmp_path / "r"
    one_clear_line(kvrepro("load", "replay", str(trace), "--build", "A", "--results", str(results)), 2,
                   f"{trace}:2: the only request line is truncated")
    assert not results.exists()  # no engine started, no run folder made
    trace.write_text(json.dumps({"trace": 1, "rep": 0, "load": {}}) + "\n")
    one_clear_line(kvrepro("load", "replay", str(trace), "--build", "A", "--results", str(results)), 2,
                   f"{trace}: no request lines after the header")


def test_classify_source_that_does_not_exist(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("INFO nothing happened\n")
    one_clear_line(kvrepro("classify", str(log), "--source", "/nonexistent"), 2, "--source /nonexistent: no such folder")
    one_clear_line(kvrepro("classify", str(log), "--source", str(log)), 2, "is a file, not a folder")


def test_a_package_missing_from_an_older_environment_is_one_line_not_a_traceback():
    """An environment set up for an older kvrepro lacks a package a later version imports on first use
    (prometheus_client here, made unimportable in the child the way a missing package is: None in
    sys.modules). The command says which package and how to bring the environment up to date; exit 3."""
    root = Path(__file__).resolve().parents[1]
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "sys.argv = ['kvrepro', 'classify', 'tests/data/logs/suite-offload-boundary-assert.log']\n"
            "from kvrepro.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "'prometheus_client' is missing" in proc.stderr and "pip install -e ." in proc.stderr
