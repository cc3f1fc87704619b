"""The shadow KV catches silent KV corruption: runs of real engines with deliberately broken loads.

Everything vLLM does runs for real (vLLM 0.26.0's EngineCore, scheduler, KV-cache manager,
OffloadingConnector on both sides); faked, because no GPU is here: the model and the offload data
movement (kvrepro/engine/executor.py), whose block contents the shadow KV stands in for.

The broken builds are the default base (0.26.0 + pr-49146) with pr-52771 (so that MTP does not
zero the offload hits) plus a fixture patch from tests/data/patches/ that moves or drops the
destination blocks of offload loads in ``update_state_after_alloc``. They run on an attention-only variant of the default geometry
(tests/data/models/qwen3-next-attention-only, Mamba cache mode none): vLLM 0.26.0's own handling of
hybrid hits already reads wrong KV on the hybrid model (see docs/first-case.md), which would
hide which violation the fixture caused. The shipped base build on the same geometry is the
control: it must check out clean, or the fixtures would prove nothing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

FIXTURES = ROOT / "tests" / "data" / "patches"
ATTENTION_ONLY = ROOT / "tests" / "data" / "models" / "qwen3-next-attention-only"


@pytest.fixture(scope="module")
def broken_runs(tmp_path_factory, overlays) -> dict:
    """One matrix run: control (base), shifted load destinations, skipped load; one rep each."""
    folder = tmp_path_factory.mktemp("shadow")
    shutil.copytree(ROOT / "builds", folder / "builds")
    for patch in FIXTURES.glob("fixture-*.patch"):
        shutil.copy(patch, folder / "builds" / patch.name)
    spec = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    spec["patches"]["shifted"] = {"file": "fixture-shifted-load-destinations.patch", "upstream": "none (test fixture)"}
    spec["patches"]["skipped"] = {"file": "fixture-skipped-load.patch", "upstream": "none (test fixture)"}
    # pr-52771 in all three: without it, 0.26.0 under MTP zeroes most offload hits (no loads to break)
    spec["builds"] = {"base": ["pr-52771"], "shifted": ["pr-52771", "shifted"], "skipped": ["pr-52771", "skipped"]}
    spec["expect"] = {"shifted": "CORRUPT", "skipped": "CORRUPT"}
    spec["engine"].update(model=str(ATTENTION_ONLY), mamba_cache_mode="none")
    spec["runs"].update(requests=120, repetitions=1, start_timeout_s=400)  # three engines start at once
    (folder / "matrix.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(folder / "matrix.yaml"),
                           "--json", "--results", str(folder / "results")],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.stdout, proc.stderr[-3000:]
    run = json.loads(proc.stdout)
    run["returncode"] = proc.returncode
    return {name: build["runs"][0] | {"returncode": proc.returncode} for name, build in run["builds"].items()}


def shadow_lines(run: dict) -> list[str]:
    log = (Path(run["run_dir"]) / "engine.log").read_text(errors="replace")
    # vLLM prefixes what its EngineCore process prints ("(EngineCore pid=N) "): keep from the tag on
    return [line[line.index("kvrepro-shadow: "):] for line in log.splitlines() if "kvrepro-shadow: " in line]


def test_the_shipped_base_checks_out_clean(broken_runs):
    base = broken_runs["base"]
    assert base["kv_check"] == "ok", base
    # attention only: the bug's state cannot occur (whether a call had both hits varies by run)
    assert base["verdict"] in ("UNREACHED", "VACUOUS") and base["state_count"] == 0, base
    assert base["offload_load_jobs"] > 0, base  # loads did happen, and put the right KV in place
    last = shadow_lines(base)[-1]  # the counts at shutdown: every forward was checked
    assert " violations=0 " in last and int(last.split("checks=")[1].split()[0]) > 100, last


def test_loads_into_the_wrong_blocks_make_the_run_corrupt_naming_the_first_violation(broken_runs):
    run = broken_runs["shifted"]
    assert (run["verdict"], run["kv_check"]) == ("CORRUPT", "corrupt"), run
    # the title is the first violation, in words: request, group, block, positions, provenance
    title = run["title"]
    assert title.startswith("silent KV corruption: step="), title
    for words in (" request ", "group 0 (full_attention)", "block index ", "positions ", "misplaced KV",
                  "its content: offload load (job "):
        assert words in title, (words, title)
    first = next(line for line in shadow_lines(run) if " violation " in line)
    # an attention-only model has no per-group divergence: no known defect, so the words of the first
    # violation are the title (its class tag left out)
    step, cls, words = first.split(" violation ", 1)[1].split(" ", 2)
    assert cls.startswith("class=full_attention") and title == f"silent KV corruption: {step} {words}"


def test_a_skipped_load_makes_the_run_corrupt_as_stale_kv(broken_runs):
    run = broken_runs["skipped"]
    assert (run["verdict"], run["kv_check"]) == ("CORRUPT", "corrupt"), run
    assert "stale KV" in run["title"], run["title"]
    assert "its content: offload load" not in run["title"]  # nothing was loaded there: the block is what it was
    assert broken_runs["skipped"]["returncode"] == 0  # every verdict as expect: says
