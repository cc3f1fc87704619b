"""kvrepro as a user installs it: a wheel built from this repository, pip-installed into a fresh
venv, run from an empty folder with no clone around it (issue 29's "done when").

Nothing is faked: a real wheel build, a real `pip install` (from pip's cache where it can), the
real vLLM 0.26.0 engine in the shared runtime env (~/.cache/kvrepro, reused, never rebuilt here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, require


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from the repository as `kvrepro images ci` builds one: `pip wheel .` (setup.py's
    build step), under the checkout's wheel lock (the CI image test may be building one beside it)."""
    from kvrepro.deploy.docker.ciimage import build_kvrepro_wheel

    out = tmp_path_factory.mktemp("wheel")
    found = build_kvrepro_wheel(out, on_line=lambda line: None)
    assert list(out.glob("kvrepro-*.whl")) == [found]
    return found


def test_the_wheel_ships_the_default_project_and_every_catalogue_entry(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = "kvrepro/data/project/"
    assert shipped + "matrix.yaml" in names
    matrix = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    for patch in matrix["patches"].values():
        assert shipped + "builds/" + patch["file"] in names, patch
    entries = sorted(p.name for p in (ROOT / "defects").glob("*.yaml"))
    assert entries and [shipped + "defects/" + e for e in entries] == sorted(
        n for n in names if n.startswith(shipped + "defects/"))
    # the top-level folders stay where people edit them
    assert (ROOT / "defects").is_dir() and (ROOT / "builds").is_dir() and (ROOT / "matrix.yaml").is_file()


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """`pip install <wheel>` into a fresh venv: its `kvrepro` program."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile",
                           str(wheel)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return venv / "bin" / "kvrepro"


def _run(program: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(program), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_an_empty_folder_says_how_to_get_a_matrix(installed, tmp_path):
    proc = _run(installed, "matrix", "validate", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: matrix.yaml: no such file; `kvrepro init` writes a starter project here (or pass --matrix "
        "PATH, or run from the project's folder)"]


def test_init_then_build_a_crashes_on_the_target_and_the_suite_lists_the_catalogue(installed, tmp_path):
    """The done-when, exactly: from an empty folder, `kvrepro init && kvrepro matrix run --build A
    --reps 1` gives CRASH(target), and `kvrepro suite list` lists the catalogue."""
    from kvrepro.builds.runtime import find_compatible
    from kvrepro.builds.wheel import cached_wheel, vllm_requirements

    wheel_0260 = cached_wheel("0.26.0")
    require(wheel_0260 is not None and find_compatible(vllm_requirements(wheel_0260)) is not None,
            "the vLLM 0.26.0 runtime env (`kvrepro setup` in the repository)")
    project = tmp_path / "empty"
    project.mkdir()
    init = _run(installed, "init", cwd=project)
    assert init.returncode == 0, init.stderr
    assert "kvrepro matrix run --build A --reps 1" in init.stdout
    assert sorted(p.name for p in project.iterdir()) == ["builds", "matrix.yaml"]  # no defects/ unless asked

    run = _run(installed, "matrix", "run", "--build", "A", "--reps", "1", cwd=project)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "CRASH(target)" in run.stdout, run.stdout[-3000:]
    (verdict_file,) = (project / "results").glob("*/A/*/verdict.json")
    verdict = json.loads(verdict_file.read_text())
    assert (verdict["verdict"], verdict["outcome"]) == ("CRASH", "target"), verdict

    listed = _run(installed, "suite", "list", "--json", cwd=project)
    assert listed.returncode == 0, listed.stderr
    assert sorted(e["name"] for e in json.loads(listed.stdout)) == sorted(p.stem for p in (ROOT / "defects").glob("*.yaml"))
    table = _run(installed, "suite", "list", cwd=project)
    assert "offload-boundary-assert" in table.stdout and "site-packages" in table.stdout  # the shipped copy


def test_init_writes_the_catalogue_only_when_asked_and_never_overwrites(installed, tmp_path):
    first = _run(installed, "init", "proj", "--defects", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "cd proj && kvrepro matrix run --build A --reps 1" in first.stdout
    assert sorted(p.name for p in (tmp_path / "proj" / "defects").glob("*.yaml")) == \
        sorted(p.name for p in (ROOT / "defects").glob("*.yaml"))
    (tmp_path / "proj" / "matrix.yaml").write_text("# mine\n")
    again = _run(installed, "init", "proj", cwd=tmp_path)
    assert again.returncode == 2
    assert "already exists" in again.stderr and "--force" in again.stderr
    assert (tmp_path / "proj" / "matrix.yaml").read_text() == "# mine\n"
    # ./defects (the project's own) is the default catalogue there
    (tmp_path / "proj" / "defects" / "parked-load-stranded.yaml").unlink()
    listed = _run(installed, "suite", "list", "--json", cwd=tmp_path / "proj")
    assert listed.returncode == 0, listed.stderr
    assert "parked-load-stranded" not in {e["name"] for e in json.loads(listed.stdout)}


def test_help_lists_commands_in_the_order_of_the_work(installed, tmp_path):
    proc = _run(installed, "--help", cwd=tmp_path)
    listed = [line.split()[1] for line in proc.stdout.splitlines()
              if line.startswith("│ ") and line[2] != " "]  # a command's first line, not a wrapped one
    work = ["setup", "init", "matrix", "suite", "bisect", "minimize", "results", "report", "classify", "engine",
            "clean"]
    assert [c for c in listed if c in work] == work, listed
