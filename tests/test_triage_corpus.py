"""kvrepro triage on the real reports of tests/data/triage/real/ (vLLM's tracker, as their threads
pasted them): the goals of issue 45, judged as benchmarks/triage_real_reports.py judges them.

Cheap: every report is a few kilobytes, triaged in-process (the whole corpus in about a second)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from kvrepro.suite.run import load as load_catalogue
from kvrepro.triage import corpus

REAL = ROOT / "tests" / "data" / "triage" / "real"
FAMILY = {"offloading", "kv-cache-manager", "scheduler", "mamba", "spec-decode"}
OTHERS = {"oom", "nccl", "cuda", "kernel", "tokenizer", "lora", "structured-output", "other"}


@pytest.fixture(scope="module")
def judged():
    return corpus.judge(REAL, load_catalogue())


def test_the_corpus_is_what_it_says():
    """At least 30 reports of vLLM's own tracker, family and not, each file there, each with its
    thread, diagnosis and an expectation of a form the judge reads."""
    data = yaml.safe_load((REAL / "manifest.yaml").read_text())
    reports = data["reports"]
    assert len(reports) >= 30
    assert {r["file"] for r in reports} == {p.name for p in REAL.glob("*.log")}
    for r in reports:
        assert r["url"].startswith("https://github.com/vllm-project/vllm/"), r["file"]
        assert r["area"] in FAMILY | OTHERS and r["diagnosis"], r["file"]
        expect = r["expect"]
        assert expect == "unknown" or isinstance(expect, str) or set(expect) == {"cites"}, r["file"]
    areas = {r["area"] for r in reports}
    assert len(areas & FAMILY) >= 4 and len(areas & OTHERS) >= 6


def test_no_refusal_no_false_match_and_the_goals(judged):
    table = judged.table()
    assert table["refusals"] == 0, [j.detail for j in judged.judged if j.verdict == corpus.REFUSED]
    assert table["false matches"] == 0, [(j.report.file, j.got) for j in judged.judged
                                         if j.verdict in (corpus.FALSE_MATCH, corpus.WRONG)]
    entry, unknown = judged.expecting_entry, judged.expecting_unknown
    assert entry and sum(j.verdict == corpus.RIGHT_FIRST for j in entry) >= 0.9 * len(entry)
    assert sum(j.verdict == corpus.KEPT_UNKNOWN for j in unknown) >= 0.9 * len(unknown)


def test_an_expectation_cites_an_entry_that_may_come_later(tmp_path):
    """A report that cites its issue resolves to the entry citing it once one does; none yet: it
    awaits one (and is judged unknown); two citing it: the corpus must name which."""
    cat = load_catalogue()
    assert corpus.resolve({"cites": ["https://github.com/vllm-project/vllm/issues/49118"]}, cat) == (
        "queued-abort-store-assert", False, "")
    assert corpus.resolve({"cites": ["https://github.com/vllm-project/vllm/issues/1"]}, cat) == (None, True, "")
    expected, pending, problem = corpus.resolve({"cites": ["https://github.com/vllm-project/vllm/pull/52807"]}, cat)
    assert expected is None and not pending and "name the one expected" in problem


def test_a_runtime_report_is_never_did_not_start(judged):
    """The tracebacks of a serving engine in the corpus (cut or whole) never read as a failed start."""
    from kvrepro.triage import triage_file

    cat = load_catalogue()
    for name in ("vllm-43884.log", "vllm-pr41282.log", "vllm-45856.log", "vllm-27711.log", "vllm-15039.log"):
        found = triage_file(Path(REAL / name), cat)
        assert found.failure.kind == "crash" and found.failure.phase == "runtime", (name, found.failure)
        assert "did not start" not in found.failure.title


def test_every_report_reads_in_80_columns_and_as_json():
    from kvrepro.triage import render, triage_file

    cat = load_catalogue()
    for path in sorted(REAL.glob("*.log")):
        found = triage_file(path, cat)
        assert max(map(len, render.plain(found))) <= 80, path.name
        data = render.as_json(found)
        assert set(data["config"]["not_in_log"]) == {k for k in data["config"]["not_in_log"]
                                                      if data["config"][k] is None}, path.name
