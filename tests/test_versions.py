"""kvrepro/versions.py: the one table of vLLM release knowledge, and what reads it."""

from __future__ import annotations

import pytest

from kvrepro import versions
from kvrepro.builds.runtime import satisfies


def test_supported_releases_are_the_ten_from_0_25_1_in_order():
    from packaging.version import Version

    assert versions.SUPPORTED_RELEASES == ("0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0",
                                           "0.30.0", "0.31.0", "0.32.0", "0.33.0")
    assert list(versions.SUPPORTED_RELEASES) == sorted(versions.SUPPORTED_RELEASES, key=Version)
    assert versions.DEFAULT_BASE in versions.SUPPORTED_RELEASES
    assert versions.newest() == "0.33.0"


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
        versions.require("0.34.0")
    message = str(info.value)
    assert "vLLM 0.34.0 has no GPU-free engine adapter" in message
    assert "0.33.0" in message and "porting checklist" in message


def test_unsupported_base_is_bad_input_and_an_infra_build_not_a_traceback(tmp_path):
    """An unknown release in `base:` is bad input when the matrix is read (issue 30: before anything
    is recorded); a plan that reaches the sim target all the same is a failed build naming it (no
    download tried)."""
    import dataclasses

    from kvrepro.deploy.sim import SimTarget
    from kvrepro.errors import SpecError
    from kvrepro.spec.matrix import load_matrix

    path = tmp_path / "matrix.yaml"
    path.write_text("base: 0.34.0\nbuilds:\n  plain: []\n")
    with pytest.raises(SpecError, match=r"matrix.yaml:1: base: '0.34.0' is not a vLLM release kvrepro supports"):
        load_matrix(path)
    path.write_text("base: 0.26.0\nbuilds:\n  plain: []\n")
    loaded = load_matrix(path)
    with pytest.raises(SpecError, match="--base '0.34.0' is not a vLLM release kvrepro supports"):
        loaded.plans(bases=["0.34.0"])
    plan = dataclasses.replace(loaded.plans()[0], base="0.34.0")
    artifact = SimTarget(loaded).prepare(plan)
    assert not artifact.ok and "vLLM 0.34.0 has no GPU-free engine adapter" in artifact.error


def test_a_runtime_env_is_shared_when_it_satisfies_a_release():
    installed = {"transformers": "5.24.0", "xgrammar": "0.2.9", "numpy": "2.3.5"}
    assert satisfies(installed, ["transformers>=5.5.3", "numpy"])
    assert not satisfies(installed, ["transformers<5.18.0,>=5.10.4"])  # 0.31.0's pin: a layer
    assert not satisfies(installed, ["instanttensor>=0.1.9"])  # missing: a layer
    assert not satisfies(installed, ["not a requirement ((("])
