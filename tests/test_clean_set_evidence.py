"""scripts/clean_set_evidence.py derives valid one-build matrices for every (profile, geometry) cell.

No engine runs here (the script's runs are the "Build E" tables of docs/first-case.md): these tests check that
each derived matrix loads with kvrepro's own validation (profile settings included), keeps the
build's patch stack and pins, and carries the geometry it names.
"""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from conftest import ROOT
from kvrepro.spec.matrix import load_matrix

spec = importlib.util.spec_from_file_location("clean_set_evidence", ROOT / "scripts" / "clean_set_evidence.py")
evidence = importlib.util.module_from_spec(spec)
spec.loader.exec_module(evidence)


@pytest.mark.parametrize("geometry", evidence.GEOMETRIES)
@pytest.mark.parametrize("profile", evidence.PROFILES)
def test_each_cell_is_a_valid_matrix_of_build_e_alone(tmp_path, profile, geometry):
    default = evidence.load_yaml(ROOT / "matrix.yaml")
    production = evidence.load_yaml(ROOT / "examples" / "production-geometry.yaml")
    cell = evidence.cell_matrix(default, production, "E", profile, geometry, reps=2, requests=None)
    (tmp_path / "builds").symlink_to(ROOT / "builds")
    path = tmp_path / "cell.yaml"
    path.write_text(yaml.safe_dump(cell, sort_keys=False))
    loaded = load_matrix(path)  # raises SpecError (file:line) on any invalid field
    (plan,) = loaded.plans()
    assert plan.name == "E"
    assert [p.name for p in plan.patches] == ["pr-49146", "pr-52771", "pr-52807", "pr-48425", "pr-50344"]
    assert loaded.matrix.expect == {"E": "SURVIVED|UNREACHED"}
    assert loaded.matrix.load.profile == profile
    assert loaded.matrix.runs.repetitions == 2
    engine = loaded.matrix.engine
    if geometry == "production":
        assert engine.geometry is not None and engine.geometry.data_parallel_size == 4
        assert engine.geometry.block_size == 2128
        assert loaded.matrix.load.dp_routing == "affinity"
    else:
        assert engine.geometry is None and engine.block_size == 16


def test_unknown_build_is_one_line(tmp_path):
    default = evidence.load_yaml(ROOT / "matrix.yaml")
    with pytest.raises(SystemExit, match="--build Z: matrix.yaml defines A, B, C, D, E"):
        evidence.cell_matrix(default, default, "Z", "multi-turn", "default", 1, None)


def test_a_patch_list_runs_on_top_of_common_as_its_own_build(tmp_path):
    default = evidence.load_yaml(ROOT / "matrix.yaml")
    cell = evidence.cell_matrix(default, default, "+pr-48425", "partial-prefix", "default", 1, None)
    assert cell["builds"] == {"only-pr-48425": ["pr-48425"]}
    assert set(cell["patches"]) == {"pr-49146", "pr-48425"}
    (tmp_path / "builds").symlink_to(ROOT / "builds")
    (tmp_path / "cell.yaml").write_text(yaml.safe_dump(cell, sort_keys=False))
    (plan,) = load_matrix(tmp_path / "cell.yaml").plans()
    assert [p.name for p in plan.patches] == ["pr-49146", "pr-48425"]
    with pytest.raises(SystemExit, match="--patch pr-00000: not declared"):
        evidence.cell_matrix(default, default, "+pr-00000", "partial-prefix", "default", 1, None)
