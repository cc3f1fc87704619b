"""End to end on the GPU-free engine: real vLLM 0.26.0 code, real HTTP, real files.

Nothing is faked here beyond what the engine itself fakes (no GPU: the model executor and the
offload worker's data movement).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
import pytest

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

ROOT = Path(__file__).resolve().parents[1]


def kvrepro(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def test_builds_a_and_d_give_target_crash_and_silent_corruption(tmp_path, overlays):
    """A dies on the target assertion; D (both fixes) serves every request, the bug's state occurs
    in it (in the full-attention group), and the shadow KV catches forwards reading wrong KV."""
    proc = kvrepro("matrix", "run", "--build", "A", "--build", "D", "--reps", "1", "--json",
                   "--results", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout)
    a = run["builds"]["A"]["runs"][0]
    d = run["builds"]["D"]["runs"][0]
    assert a["verdict"] == "CRASH" and a["outcome"] == "target", a
    assert a["title"].startswith("AssertionError in update_state_after_alloc: num_locally_computed_tokens <=")
    assert a["trigger_count"] > 0  # the crashing call itself is counted
    assert a["state_count"] >= 1 and set(a["state_groups"]) == {"full_attention"}, a  # ... in its state
    assert d["verdict"] == "CORRUPT" and d["kv_check"] == "corrupt", d
    assert d["title"].startswith("silent KV corruption: "), d["title"]
    assert "fa-hole-below-boundary" in d["kv_defects"], d  # named: the boundary fix's hole
    assert d["trigger_count"] > 0 and d["state_count"] > 0, d
    assert set(d["state_groups"]) == {"full_attention"}, d
    # it did not crash, and its verdict was settled before the budget (docs/statistics.md): the bug's
    # state survived 29 times and the corruption was named
    assert d["stopped_because"] == "settled" and 0 < d["requests"] < 600, d
    assert "corruption seen: " in d["settled_by"] and "fa-hole-below-boundary" in d["settled_by"], d
    assert d["offload_load_jobs"] > 0  # the fixed build still loads from the offload

    run_dir = Path(d["run_dir"])
    for name in ("engine.log", "load.jsonl", "metrics.txt", "manifest.json", "verdict.json"):
        assert (run_dir / name).is_file(), name
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert [p["name"] for p in manifest["patches"]] == ["pr-49146", "pr-52771", "pr-52807"]
    lines = (run_dir / "load.jsonl").read_text().splitlines()
    assert len(lines) == d["requests"] and all(json.loads(line) for line in lines)

    # the classifier, as a user runs it, on the recorded logs
    a_log = Path(a["run_dir"]) / "engine.log"
    got = json.loads(kvrepro("classify", str(a_log), "--json").stdout)
    assert got["outcome"] == "target"
    assert got["signature"]["function"] == "update_state_after_alloc"
    got = json.loads(kvrepro("classify", str(run_dir / "engine.log"), "--json").stdout)
    assert (got["outcome"], got["signature"]) == ("none", None)
    # the same log read for its corruption: the defects the run's verdict named
    assert got["kv_defects"] == d["kv_defects"] and got["kv_violations"] == d["kv_violations"]


def test_a_hunk_that_does_not_apply_fails_only_its_build(tmp_path, matrix_copy, overlays):
    builds = matrix_copy.parent / "builds"
    broken_lines = (builds / "pr-52807.patch").read_text().splitlines(keepends=True)
    # corrupt the first context line of the first hunk so that hunk cannot apply
    first_hunk = next(i for i, line in enumerate(broken_lines) if line.startswith("@@"))
    context = next(i for i in range(first_hunk + 1, len(broken_lines)) if broken_lines[i].startswith(" "))
    broken_lines[context] = " # this context line is not in vLLM 0.26.0\n"
    (builds / "broken.patch").write_text("".join(broken_lines))
    spec = yaml.safe_load(matrix_copy.read_text())
    spec["patches"]["broken"] = {"file": "broken.patch", "upstream": "none"}
    spec["builds"] = {"A": [], "X": ["broken"]}
    spec["expect"] = {"A": "CRASH(target)"}
    matrix_copy.write_text(yaml.safe_dump(spec))

    proc = kvrepro("matrix", "run", "-m", str(matrix_copy), "--reps", "1", "--json", "--results", str(tmp_path / "r"))
    assert proc.returncode == 3, proc.stderr[-3000:]  # INFRA somewhere
    run = json.loads(proc.stdout)
    x = run["builds"]["X"]
    assert x["runs"][0]["verdict"] == "INFRA"
    assert "patch broken" in x["build_error"] and "scheduler.py" in x["build_error"] and "hunk #" in x["build_error"]
    assert run["builds"]["A"]["runs"][0]["verdict"] == "CRASH"


def test_a_run_whose_prompts_are_mostly_refused_is_not_survived(tmp_path, matrix_copy, overlays):
    """Measured before: engine.max_model_len 100 made build A SURVIVED although 498 of its 600
    requests were refused (HTTP 400, engine alive). The load then did not test the engine: INFRA.
    (Attention-only geometry, so that neither the target crash nor 0.26.0's hybrid-hit corruption
    can decide the run first.)"""
    spec = yaml.safe_load(matrix_copy.read_text())
    spec["engine"].update(max_model_len=100, mamba_cache_mode="none",
                          model=str(ROOT / "tests" / "data" / "models" / "qwen3-next-attention-only"))
    spec["runs"]["requests"] = 60
    # the shared-prefix profile draws prompts up to 439 tokens whatever the engine takes
    # (the default partial-prefix profile fits its prompts to max_model_len)
    spec["load"] = {"profile": "shared_prefix", "concurrency": 4, "documents": 6, "document_tokens": 400,
                    "suffix_tokens": [0, 39], "max_tokens": 8, "seed": 0}
    spec["builds"] = {"A": []}
    spec["expect"] = {}
    matrix_copy.write_text(yaml.safe_dump(spec))
    proc = kvrepro("matrix", "run", "-m", str(matrix_copy), "--reps", "1", "--json", "--results", str(tmp_path / "r"))
    assert proc.returncode == 3, proc.stderr[-3000:]  # INFRA
    a = json.loads(proc.stdout)["builds"]["A"]["runs"][0]
    lines = [json.loads(line) for line in (Path(a["run_dir"]) / "load.jsonl").read_text().splitlines()]
    refused = sum(1 for line in lines if not line["ok"])
    assert refused > 0.05 * len(lines) and refused < len(lines)  # some served, most refused
    assert a["verdict"] == "INFRA", a
    assert a["title"] == (f"{refused} of {a['requests']} requests failed with the engine up (more than 5%): "
                          "the load did not test the engine; see load.jsonl")
