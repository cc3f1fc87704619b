"""Shared fixtures. Tests that need the runtime env build it (idempotent, cached in ~/.cache/kvrepro);
tests that need Docker fail instead of skipping when CI is set (see `require`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IN_CI = bool(os.environ.get("CI"))


def require(condition: bool, why: str) -> None:
    """Skip on a developer's machine, fail under CI: CI must never pass by skipping."""
    if not condition:
        if IN_CI:
            pytest.fail(f"required under CI: {why}")
        pytest.skip(why)


@pytest.fixture(scope="session")
def default_matrix():
    from kvrepro.spec.matrix import load_matrix

    return load_matrix(ROOT / "matrix.yaml")


@pytest.fixture(scope="session")
def runtime_python(default_matrix) -> Path:
    """The runtime env's python (vLLM's dependencies, torch CPU)."""
    from kvrepro.builds import prepare_runtime

    return prepare_runtime(default_matrix.matrix.base).python


@pytest.fixture(scope="session")
def overlays(default_matrix, runtime_python) -> dict[str, Path]:
    """The default matrix's builds A-D as overlays (patched vllm/ + probe), built by kvrepro.builds."""
    from kvrepro.builds import build_overlay

    built = {}
    for plan in default_matrix.plans():
        artifact = build_overlay(plan)
        assert artifact.ok, artifact.error
        built[plan.name] = Path(artifact.ref)
    return built


@pytest.fixture(scope="session")
def pristine_vllm(default_matrix) -> Path:
    """A folder holding vLLM 0.26.0's unpatched vllm/ sources (from the cached wheel)."""
    from kvrepro.builds import pristine_tree

    _, tree, _ = pristine_tree(default_matrix.matrix.base)
    return tree


@pytest.fixture
def matrix_copy(tmp_path) -> Path:
    """A writable copy of matrix.yaml + builds/ to edit in a test."""
    shutil.copy(ROOT / "matrix.yaml", tmp_path / "matrix.yaml")
    shutil.copytree(ROOT / "builds", tmp_path / "builds")
    return tmp_path / "matrix.yaml"


def planned_run(**fields):
    """A run as the runner plans it (kvrepro.results.store.create_run's ``info``), from JSON-like fields."""
    from kvrepro.records import RunInfo, from_jsonable, to_jsonable

    return from_jsonable(RunInfo, {"run_id": "", "status": "running", **to_jsonable(fields)})
