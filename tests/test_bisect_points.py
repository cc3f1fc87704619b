"""Bisection points as matrices, and the git-commit source kind, on real git repositories and
real release trees (no engine runs)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvrepro.bisect.points import CommitPoint, PatchSetPoint, PointMatrices, ReleasePoint, releases_between
from kvrepro.builds import gitcommit
from kvrepro.errors import SpecError

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def tiny_repo(tmp_path) -> tuple[Path, list[str]]:
    repo = tmp_path / "repo"
    (repo / "vllm").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    shas = []
    for i, tag in enumerate(["v0.26.0", None, "v0.27.0", None]):
        (repo / "vllm" / "__init__.py").write_text(f"STEP = {i}\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"step {i}")
        if tag:
            git(repo, "tag", tag)
        shas.append(git(repo, "rev-parse", "HEAD"))
    return repo, shas


def test_releases_between_is_ordered_either_way_and_rejects_unknown_ones():
    assert releases_between("0.30.0", "0.26.0") == ["0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0"]
    with pytest.raises(SpecError, match="0.24.0"):
        releases_between("0.24.0", "0.26.0")


def test_commit_history_and_nearest_release(tiny_repo):
    repo, shas = tiny_repo
    assert gitcommit.commits_between(repo, shas[0], shas[3]) == shas
    assert gitcommit.nearest_release(repo, shas[1]) == "0.26.0"
    assert gitcommit.nearest_release(repo, shas[3]) == "0.27.0"
    with pytest.raises(SpecError, match="not an ancestor"):
        gitcommit.commits_between(repo, shas[3], shas[0])
    with pytest.raises(SpecError, match="not a commit"):
        gitcommit.resolve_commit(repo, "no-such-ref")


def test_points_become_one_build_matrices(default_matrix, tiny_repo):
    repo, shas = tiny_repo
    matrices = PointMatrices(default_matrix, requests=200, repo=str(repo))
    release = matrices.matrix_for(ReleasePoint("0.28.0"))
    (plan,) = release.plans()
    assert (plan.name, plan.base, plan.patches, plan.source) == ("0.28.0", "0.28.0", (), None)
    assert release.matrix.runs.requests == 200 and release.matrix.expect == {}

    patches = matrices.matrix_for(PatchSetPoint(("pr-52807",)))
    (plan,) = patches.plans()
    assert [p.name for p in plan.patches] == ["pr-49146", "pr-52807"]  # common first

    commit = matrices.matrix_for(CommitPoint(shas[1]))
    (plan,) = commit.plans()
    assert plan.base == "0.26.0" and plan.source.commit == shas[1] and plan.patches == ()
    with_build = PointMatrices(default_matrix, build="B").matrix_for(ReleasePoint("0.26.0"))
    assert [p.name for p in with_build.plans()[0].patches] == ["pr-49146", "pr-52807"]


def test_commit_overlay_is_the_commits_tree_plus_what_only_the_wheel_has(tmp_path, pristine_vllm, monkeypatch):
    """The commit's files win; files git never tracked (generated _version.py, wheel-only folders)
    come from the wheel; the probe is added; the overlay is reused by commit sha."""
    from kvrepro.spec.records import BuildPlan, GitCommitSource

    monkeypatch.setenv("KVREPRO_HOME", str(tmp_path / "home"))
    # the real 0.26.0 wheel and its extraction, linked into the private home
    from kvrepro import paths

    real_home = Path.home() / ".cache" / "kvrepro"
    (tmp_path / "home" / "overlays" / "pristine").mkdir(parents=True)
    (tmp_path / "home" / "wheels").symlink_to(real_home / "wheels")
    (paths.overlays_dir() / "pristine" / pristine_vllm.name).symlink_to(pristine_vllm)

    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    subprocess.run(["cp", "-r", str(pristine_vllm / "vllm"), str(repo)], check=True)
    (repo / "vllm" / "_version.py").unlink(missing_ok=True)
    (repo / "vllm" / "envs.py").write_text((repo / "vllm" / "envs.py").read_text() + "\nCOMMIT_MARK = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "c")
    sha = git(repo, "rev-parse", "HEAD")

    plan = BuildPlan(name="c", base="0.26.0", patches=(), source=GitCommitSource(repo=str(repo), commit=sha))
    artifact = gitcommit.build_commit_overlay(plan)
    assert artifact.ok, artifact.error
    overlay = Path(artifact.ref)
    assert "COMMIT_MARK = 1" in (overlay / "vllm" / "envs.py").read_text()
    assert (overlay / "kvrepro_probe.py").is_file()
    assert artifact.manifest.commit == sha and artifact.manifest.source == "git commit"
    if (pristine_vllm / "vllm" / "_version.py").exists():
        assert "vllm/_version.py" in artifact.manifest.from_wheel
    again = gitcommit.build_commit_overlay(plan)
    assert again.reused and again.ref == artifact.ref


def kvrepro(*args: str) -> subprocess.CompletedProcess:
    import sys

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=root, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, says", [
    (["bisect", "releases", "--bad", "0.26.0", "--good", "0.9"], "vLLM release '0.9' is not supported"),
    (["bisect", "releases", "--good", "0.26.0"], "give --bad"),
    (["bisect", "patches", "--patch", "pr-99999"], "--patch pr-99999: not declared"),
    (["bisect", "commits", "--repo", "/", "--bad", "a", "--good", "b"], "not a git checkout"),
    (["bisect", "releases", "--resume", "nope"], "--resume nope: no bisection of that id"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    proc = kvrepro(*args, "--results", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_git_bisect_adapter_aborts_git_bisect_on_bad_input(tmp_path):
    proc = kvrepro("matrix", "verdict", "--git-bisect", "--repo", str(tmp_path), "--results", str(tmp_path))
    assert proc.returncode == 128, proc.stderr  # >127: `git bisect run` stops instead of marking a commit
    assert "not a git checkout" in proc.stderr
