"""matrix.yaml validation: errors name file:line, the field and what is allowed."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvrepro.errors import SpecError
from kvrepro.spec.matrix import load_matrix, parse_matrix

ROOT = Path(__file__).resolve().parents[1]


def test_default_matrix_is_valid_and_plans_a_to_e():
    loaded = load_matrix(ROOT / "matrix.yaml")
    plans = {p.name: [x.name for x in p.patches] for p in loaded.plans()}
    assert plans == {
        "A": ["pr-49146"],
        "B": ["pr-49146", "pr-52807"],
        "C": ["pr-49146", "pr-52771"],
        "D": ["pr-49146", "pr-52771", "pr-52807"],
        "E": ["pr-49146", "pr-52771", "pr-52807", "pr-48425", "pr-50344"],
    }
    # the decoy of `bisect patches` is declared (and pinned) but in no build
    assert "decoy-docstring" in loaded.matrix.patches
    assert all("decoy-docstring" not in stack for stack in loaded.matrix.builds.values())
    assert loaded.patch_ref("decoy-docstring").sha256 == hashlib.sha256(
        loaded.patch_ref("decoy-docstring").path.read_bytes()).hexdigest()
    assert loaded.matrix.base == "0.26.0"
    assert loaded.matrix.target == "sim"
    for plan in loaded.plans():
        for patch in plan.patches:
            assert patch.sha256 == hashlib.sha256(patch.path.read_bytes()).hexdigest()


def _error(text: str, tmp_path: Path) -> str:
    path = tmp_path / "matrix.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_matrix(path).plans()
    return str(info.value)


def test_unknown_field_names_file_line_and_allowed_fields(tmp_path):
    msg = _error('base: "0.26.0"\nbuilds:\n  A: []\nengine:\n  block_size: 16\n  blok_size: 16\n', tmp_path)
    assert f"{tmp_path / 'matrix.yaml'}:6: engine.blok_size: unknown field" in msg
    assert "block_size" in msg.split("allowed here:")[1]


def test_wrong_type_names_line_and_field(tmp_path):
    msg = _error('base: "0.26.0"\nbuilds:\n  A: []\nruns:\n  repetitions: many\n', tmp_path)
    assert ":5: runs.repetitions:" in msg
    assert "integer" in msg


def test_unknown_patch_in_build_names_the_list_entry(tmp_path):
    msg = _error('base: "0.26.0"\nbuilds:\n  A: []\n  B: [pr-1]\n', tmp_path)
    assert ":4: builds.B.0: unknown patch 'pr-1'" in msg


def test_bad_version_and_bad_yaml(tmp_path):
    assert ":1: base: 'latest' must be a vLLM release version" in _error('base: "latest"\nbuilds: {A: []}\n', tmp_path)
    assert "not valid YAML" in _error("base: [\n", tmp_path)


def test_sha256_pin_mismatch_is_reported(tmp_path):
    (tmp_path / "builds").mkdir()
    (tmp_path / "builds" / "x.patch").write_text("--- a/x\n+++ b/x\n")
    text = ('base: "0.26.0"\npatches:\n  x:\n    file: x.patch\n    upstream: u\n    sha256: "' + "0" * 64
            + '"\nbuilds:\n  A: [x]\n')
    assert "patches.x.sha256" in _error(text, tmp_path)


def test_expect_must_name_builds_and_verdicts(tmp_path):
    assert "expect.Z: no build 'Z'" in _error('base: "0.26.0"\nbuilds: {A: []}\nexpect: {Z: SURVIVED}\n', tmp_path)
    assert "is not a verdict" in _error('base: "0.26.0"\nbuilds: {A: []}\nexpect: {A: OK}\n', tmp_path)


def test_serve_args_are_real_vllm_flags():
    engine = parse_matrix('base: "0.26.0"\nbuilds: {A: []}\n', Path("m.yaml")).matrix.engine
    args = engine.serve_args("/models/x", include_sim=True)
    assert args[0] == "/models/x"
    assert args[args.index("--mamba-cache-mode") + 1] == "align"
    assert '"method": "mtp"' in args[args.index("--speculative-config") + 1]
    assert "--num-gpu-blocks-override" in args
    assert "--num-gpu-blocks-override" not in engine.serve_args("/m", include_sim=False)


def test_async_scheduling_is_vllms_own_decision_unless_the_matrix_says_on_or_off(tmp_path):
    """auto (the default) passes nothing: vLLM decides as on a GPU (on with MTP); on/off are its flags,
    and the same setting in extra_args as well is one line naming both."""
    def args(fragment: str) -> list[str]:
        text = 'base: "0.26.0"\nbuilds: {A: []}\n' + fragment
        return parse_matrix(text, Path("m.yaml")).matrix.engine.serve_args("/m", include_sim=False)

    assert not any("async-scheduling" in a for a in args(""))
    assert not any("async-scheduling" in a for a in args("engine: {async_scheduling: auto}\n"))
    assert args("engine: {async_scheduling: 'on'}\n")[-1] == "--async-scheduling"
    assert args("engine: {async_scheduling: 'off'}\n")[-1] == "--no-async-scheduling"
    assert args("engine: {async_scheduling: off}\n")[-1] == "--no-async-scheduling"  # YAML's boolean off
    assert "engine.async_scheduling" in _error('base: "0.26.0"\nbuilds: {A: []}\nengine: {async_scheduling: maybe}\n',
                                               tmp_path)
    both = _error('base: "0.26.0"\nbuilds: {A: []}\nengine: {async_scheduling: "off", extra_args: '
                  '["--async-scheduling"]}\n', tmp_path)
    assert "engine.extra_args.0" in both and "engine.async_scheduling" in both


def test_fs_tier_root_dir_is_the_runs_own_folder_and_an_unreadable_config_is_one_line(tmp_path):
    """An fs offload tier's root_dir is rewritten (as JSON data) to a folder under the run's folder;
    the rest of --kv-transfer-config, and a config without an fs tier, are passed as written; a
    config kvrepro cannot read is refused with the field it is in (kvrepro/spec/fs_tier.py)."""
    config = {"kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "offload_prompt_only": False,
                                            "secondary_tiers": [{"type": "p2p"}, {"type": "fs", "root_dir": "/shared"}]}}

    def engine(*args: str):
        text = yaml.safe_dump({"base": "0.26.0", "builds": {"A": []}, "engine": {"extra_args": list(args)}})
        return parse_matrix(text, Path("m.yaml")).matrix.engine

    for args in (["--kv-transfer-config", json.dumps(config)], ["--kv-transfer-config=" + json.dumps(config)]):
        spec = engine(*args)
        assert [(t.tier, t.root_dir) for t in spec.fs_tiers()] == [(1, "/shared")]
        assert spec.serve_args("/m", include_sim=True)[-len(args):] == args  # none given: as written
        value = spec.serve_args("/m", include_sim=True, fs_tier_root="/runs/A/0")[-1].removeprefix("--kv-transfer-config=")
        rewritten = json.loads(value)
        tiers = rewritten["kv_connector_extra_config"]["secondary_tiers"]
        assert tiers == [{"type": "p2p"}, {"type": "fs", "root_dir": "/runs/A/0/fs-tier-1"}]
        assert rewritten["kv_connector_extra_config"]["offload_prompt_only"] is False
    plain = ["--kv-transfer-config", '{"kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec"}}']
    assert engine(*plain).serve_args("/m", include_sim=True, fs_tier_root="/r")[-2:] == plain
    assert engine(*plain).fs_tiers() == []

    base = 'base: "0.26.0"\nbuilds: {A: []}\nengine:\n  extra_args: ["--max-num-seqs", "4", "--kv-transfer-config", '
    for value, words in (("'{nope'", "is not valid JSON"), ("'[1]'", "is JSON list, not an object"),
                         ("'{\"kv_connector_extra_config\": {\"secondary_tiers\": [{\"type\": \"fs\", \"root_dir\": 3}]}}'",
                          "secondary_tiers[0] (type fs) has root_dir 3")):
        msg = _error(base + value + "]\n", tmp_path)
        lines = msg.strip().splitlines()
        assert len(lines) == 2 and lines[1].strip().startswith(f"{tmp_path / 'matrix.yaml'}:4: engine.extra_args.3: ")
        assert words in lines[1], msg


def test_cli_validate_exits_2_without_traceback(tmp_path):
    path = tmp_path / "matrix.yaml"
    path.write_text('base: "0.26.0"\nbuilds:\n  A: []\nload:\n  concurency: 3\n')
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "validate", "-m", str(path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert f"{path}:5: load.concurency: unknown field" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_base_may_be_a_list_and_every_build_runs_on_every_release(tmp_path):
    path = tmp_path / "matrix.yaml"
    path.write_text("base: [0.26.0, 0.30.0]\nbuilds:\n  plain: []\n  other: []\n")
    loaded = load_matrix(path)
    assert loaded.matrix.bases == ["0.26.0", "0.30.0"]
    cells = [(p.name, p.base, p.build_name) for p in loaded.plans()]
    assert cells == [("plain@0.26.0", "0.26.0", "plain"), ("other@0.26.0", "0.26.0", "other"),
                     ("plain@0.30.0", "0.30.0", "plain"), ("other@0.30.0", "0.30.0", "other")]
    # --base overrides; one release keeps the plain build names
    assert [(p.name, p.base) for p in loaded.plans(["plain"], ["0.27.1"])] == [("plain", "0.27.1")]
    from kvrepro.deploy.docker.settings import docker_settings

    assert docker_settings(loaded.matrix).image_for("0.30.0") == "vllm/vllm-openai:v0.30.0"


def test_bad_base_lists_are_named(tmp_path):
    assert "base: a release is listed twice" in _error("base: [0.26.0, 0.26.0]\nbuilds: {A: []}\n", tmp_path)
    assert "'latest' must be a vLLM release version" in _error("base: [0.26.0, latest]\nbuilds: {A: []}\n", tmp_path)
    path = tmp_path / "ok.yaml"
    path.write_text("builds: {A: []}\n")
    with pytest.raises(SpecError, match="--base 'nightly': must be a vLLM release version"):
        load_matrix(path).plans(bases=["nightly"])


def test_expect_may_accept_any_of_several_verdicts(tmp_path):
    """Release validation: "the crash is not back" is SURVIVED or UNREACHED, never CRASH/CORRUPT."""
    from kvrepro.records import Outcome, RunResult, Verdict
    from kvrepro.report.render import meets_expectation

    path = tmp_path / "matrix.yaml"
    path.write_text("builds: {release: []}\nexpect: {release: SURVIVED|UNREACHED}\n")
    expect = load_matrix(path).matrix.expect["release"]

    def run(verdict: Verdict, outcome: Outcome = Outcome.NONE) -> RunResult:
        return RunResult(build="release", rep=0, verdict=verdict, outcome=outcome, title="", trigger_count=1,
                         external_hit_calls=1, requests=600, seconds=1.0)

    assert meets_expectation(run(Verdict.UNREACHED), expect)
    assert meets_expectation(run(Verdict.SURVIVED), expect)
    assert not meets_expectation(run(Verdict.CORRUPT), expect)
    assert not meets_expectation(run(Verdict.CRASH, Outcome.TARGET), expect)
    msg = _error("builds: {A: []}\nexpect: {A: SURVIVED|FINE}\n", tmp_path)
    assert ":2: expect.A: 'FINE' is not a verdict" in msg and "joined by '|'" in msg


def test_each_offline_replay_starts_with_empty_fs_tiers(tmp_path, monkeypatch):
    """The minimizer's offline engine builds a fresh engine per candidate; vLLM's fs tier keeps its
    files, so without emptying them a candidate hit the chunks an earlier candidate stored, which
    the shadow KV never saw stored (measured: a 0.34.0 tiering run "minimized" to 1 request of 17
    tokens reading wrong KV). Only the tier folders kvrepro made, inside the folder it names, go."""
    from kvrepro.engine import offline

    root = tmp_path / "offline-fs"
    tier = root / "fs-tier-0"
    tier.mkdir(parents=True)
    (tier / "chunk-1.bin").write_bytes(b"x" * 16)
    (root / "keep.txt").write_text("not a tier")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "fs-tier-1").symlink_to(outside)
    (outside / "theirs.bin").write_bytes(b"y")
    built = []
    fresh = offline._fresh(lambda: built.append(sorted(p.name for p in tier.iterdir())) or "core")
    monkeypatch.setenv("KVREPRO_OFFLINE_FS_ROOT", str(root))
    assert fresh() == "core" and built == [[]]
    assert tier.is_dir() and (root / "keep.txt").exists() and (outside / "theirs.bin").exists()
    monkeypatch.delenv("KVREPRO_OFFLINE_FS_ROOT")
    (tier / "chunk-2.bin").write_bytes(b"z")
    fresh()
    assert (tier / "chunk-2.bin").exists()  # no folder named: nothing is removed
