"""End to end: a real tiny matrix (builds A and C of the default, one repetition each, on the
GPU-free engine: real vLLM 0.26.0 code, real HTTP, real files) in CI mode, with C's `expect:`
flipped. Only the GPU is missing (the engine's fake executor, as everywhere). A and C both die on
the target assertion within a few hundred requests, so the run is short and its verdicts sure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import xmlschema
import yaml
import pytest

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

ROOT = Path(__file__).resolve().parents[1]
XSD = ROOT / "tests" / "data" / "junit" / "junit.xsd"


def test_ci_mode_writes_report_junit_and_step_summary_and_fails_exactly_the_flipped_testcase(
        tmp_path, matrix_copy, overlays):
    spec = yaml.safe_load(matrix_copy.read_text())
    spec["builds"] = {"A": [], "C": ["pr-52771"]}
    spec["expect"] = {"A": "CRASH(target)", "C": "SURVIVED"}  # C really crashes: flipped
    matrix_copy.write_text(yaml.safe_dump(spec))
    summary = tmp_path / "step-summary.md"
    junit_path = tmp_path / "junit.xml"
    env = dict(os.environ, GITHUB_STEP_SUMMARY=str(summary))
    proc = subprocess.run(
        [sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(matrix_copy), "--reps", "1", "--ci",
         "--junit", str(junit_path), "--results", str(tmp_path / "results")],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "build C rep 0: CRASH(target), expected SURVIVED" in proc.stderr
    assert "━" not in proc.stderr and "\x1b[" not in proc.stderr  # no progress bars, no colours
    assert "[2/2] build" in proc.stderr

    xml_text = junit_path.read_text()
    xmlschema.XMLSchema(XSD).validate(xml_text)
    cases = {c.get("name"): c for c in ET.fromstring(xml_text).iter("testcase")}
    assert set(cases) == {"A rep 0", "C rep 0"}
    assert cases["A rep 0"].find("failure") is None
    failure = cases["C rep 0"].find("failure")
    assert failure is not None and failure.get("message") == "expected SURVIVED, got CRASH(target)"
    assert "trigger count:" in cases["C rep 0"].findtext("system-out")
    assert 'scheduler.py", line' in cases["A rep 0"].findtext("system-out")  # the traceback's lines

    (run_dir,) = (tmp_path / "results").iterdir()
    md = (run_dir / "report.md").read_text()
    assert "**1 verdict(s) differ from `expect:`**" in md
    assert "| 0.26.0 | C | pr-49146 → pr-52771 | SURVIVED | CRASH(target) ✗ (expected SURVIVED) |" in md
    # one repetition a build: no survival curve (a build needs two), and the report says so
    assert not (run_dir / "survival.png").exists() and "No curve: a build needs 2 timed runs" in md
    page = (run_dir / "report.html").read_text()
    assert "<svg" not in page and "<table>" in page and "<script" not in page  # no figure drawn
    assert "vllm serve qwen3-next-tiny" in page and "a944ee59939f" in page  # what ran: args, patch sha
    assert summary.read_text() == md  # appended to the job summary

    # the same run read back later gives the same report
    again = subprocess.run([sys.executable, "-m", "kvrepro.cli", "report", str(run_dir)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert (run_dir / "report.md").read_text() == md
