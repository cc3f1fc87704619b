"""kvrepro/versions.py: the one table of vLLM release knowledge, and what reads it."""

from __future__ import annotations

import pytest

from kvrepro import versions
from kvrepro.builds.runtime import satisfies


def test_supported_releases_are_the_eleven_from_0_25_1_in_order():
    from packaging.version import Version

    assert versions.SUPPORTED_RELEASES == ("0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0",
                                           "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
    assert list(versions.SUPPORTED_RELEASES) == sorted(versions.SUPPORTED_RELEASES, key=Version)
    assert versions.DEFAULT_BASE in versions.SUPPORTED_RELEASES
    assert versions.newest() == "0.34.0"


def test_a_newer_release_is_unported_and_runs_with_the_newest_settings():
    """A release newer than the table (same major) is tried, not refused: the newest entry's settings
    under its own version, marked unported; an older gap, another major or a pre-release is not."""
    newest = versions.require(versions.newest())
    for later in ("0.34.1", "0.35.0", "0.40.2"):
        entry = versions.require(later)
        assert versions.is_unported(later) and versions.unsupported(later) is None
        assert entry.version == later and entry.unported_from == versions.newest()
        assert entry.worker_rpc_answers() == newest.worker_rpc_answers() and entry.torch == newest.torch
        assert versions.label(later) == f"{later} (unported)"
        assert later in versions.unported_note(later) and "kvrepro release port" in versions.unported_note(later)
    for refused in ("0.28.5", "1.0.0", "9.9.9", "0.35.0rc1", "v0.35.0"):
        assert not versions.is_unported(refused)
        assert "is not a vLLM release kvrepro supports" in versions.unsupported(refused)
        with pytest.raises(versions.UnsupportedRelease):
            versions.require(refused)
    # the catalogue states what was read and measured: no unported release there
    assert "is not a vLLM release" in versions.unsupported("0.35.0", unported_ok=False)
    assert versions.label("0.34.0") == "0.34.0" and versions.unported_note("0.34.0") is None


def test_every_release_answers_the_common_rpcs_and_later_ones_more():
    for entry in versions.RELEASES:
        answers = entry.worker_rpc_answers()
        assert answers["get_supported_tasks"] == ("generate",)
        assert "shutdown" in answers
    assert "supports_draft_weight_updates" not in versions.require("0.27.1").worker_rpc_answers()
    assert versions.require("0.28.0").worker_rpc_answers()["supports_draft_weight_updates"] is False
    layouts = versions.require("0.30.0").worker_rpc_answers()["get_supported_kv_cache_layouts"]
    assert layouts == versions.Computed("gpu_kv_cache_layouts")


def test_a_release_without_an_adapter_says_what_to_do():
    with pytest.raises(versions.UnsupportedRelease) as info:
        versions.require("0.28.5")
    message = str(info.value)
    assert "vLLM 0.28.5 has no GPU-free engine adapter" in message
    assert "0.34.0" in message and "porting checklist" in message


def test_unsupported_base_is_bad_input_and_an_infra_build_not_a_traceback(tmp_path):
    """An unknown release in `base:` is bad input when the matrix is read (issue 30: before anything
    is recorded); a plan that reaches the sim target all the same is a failed build naming it (no
    download tried)."""
    import dataclasses

    from kvrepro.deploy.sim import SimTarget
    from kvrepro.errors import SpecError
    from kvrepro.spec.matrix import load_matrix

    path = tmp_path / "matrix.yaml"
    path.write_text("base: 0.28.5\nbuilds:\n  plain: []\n")
    with pytest.raises(SpecError, match=r"matrix.yaml:1: base: '0.28.5' is not a vLLM release kvrepro supports"):
        load_matrix(path)
    path.write_text("base: 0.26.0\nbuilds:\n  plain: []\n")
    loaded = load_matrix(path)
    with pytest.raises(SpecError, match="--base '1.0.0' is not a vLLM release kvrepro supports"):
        loaded.plans(bases=["1.0.0"])
    assert [p.base for p in loaded.plans(bases=["0.35.0"])] == ["0.35.0"]  # unported: tried
    plan = dataclasses.replace(loaded.plans()[0], base="0.28.5")
    artifact = SimTarget(loaded).prepare(plan)
    assert not artifact.ok and "vLLM 0.28.5 has no GPU-free engine adapter" in artifact.error


def test_a_runtime_env_is_shared_when_it_satisfies_a_release():
    installed = {"transformers": "5.24.0", "xgrammar": "0.2.9", "numpy": "2.3.5"}
    assert satisfies(installed, ["transformers>=5.5.3", "numpy"])
    assert not satisfies(installed, ["transformers<5.18.0,>=5.10.4"])  # 0.31.0's pin: a layer
    assert not satisfies(installed, ["instanttensor>=0.1.9"])  # missing: a layer
    assert not satisfies(installed, ["not a requirement ((("])
