"""Source kind "git commit": a commit's ``vllm/`` Python tree on top of a release wheel.

This is what vLLM's precompiled developer install does (``VLLM_USE_PRECOMPILED=1 pip install
-e .``): the Python code comes from the checkout, everything compiled or generated at release
time comes from the nearest release's wheel. The GPU-free engine needs no compiled code, so a
commit costs one ``git archive`` and a few megabytes, cached under the overlays folder keyed by
the commit sha (a sha names its tree for good), the wheel and the probe.

What the wheel adds to the commit's tree: files git never tracks in any commit (``_version.py``
written by setuptools-scm) and whole folders that exist only in the wheel (vendored packages
built at release time). A file that the commit deleted stays deleted.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from .. import paths, versions
from ..errors import KvreproError, SpecError
from .records import BuildArtifact, BuildManifest
from ..spec.records import BuildPlan
from . import patching
from .overlay import OVERLAY_FORMAT, PROBE_SOURCE, file_sha256, finish_overlay, pristine_tree

# generated at release time, never committed: always taken from the wheel
_GENERATED = ("vllm/_version.py",)
_TAG_RE = re.compile(r"^v?(\d+\.\d+\.\d+)$")


def _git(repo: str | Path, *args: str, binary: bool = False) -> str | bytes:
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)
    except FileNotFoundError:
        raise KvreproError("git is not installed; install it (apt-get install git)") from None
    if proc.returncode != 0:
        said = proc.stderr.decode(errors="replace").strip().splitlines()
        raise SpecError(f"{repo}: `git {' '.join(args)}` failed: {said[-1] if said else proc.returncode}")
    return proc.stdout if binary else proc.stdout.decode().strip()


def resolve_commit(repo: str | Path, ref: str) -> str:
    """The full sha of ``ref`` (a sha, tag or branch) in ``repo``; SpecError naming it if none."""
    if not (Path(repo) / ".git").exists() and not Path(repo, "HEAD").exists():
        raise SpecError(f"--repo {repo}: not a git checkout (no .git); pass the folder of your vLLM clone")
    try:
        return str(_git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"))
    except SpecError:
        raise SpecError(f"--repo {repo}: {ref!r} is not a commit there (`git rev-parse {ref}` finds none)") from None


def is_ancestor(repo: str | Path, older: str, newer: str) -> bool:
    proc = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", older, newer],
                          capture_output=True)
    return proc.returncode == 0


def commits_between(repo: str | Path, older: str, newer: str) -> list[str]:
    """``older`` followed by every first-parent commit after it up to ``newer``, oldest first."""
    if not is_ancestor(repo, older, newer):
        raise SpecError(f"--repo {repo}: {older[:12]} is not an ancestor of {newer[:12]}; "
                        "--bad and --good must lie on one line of history")
    listed = str(_git(repo, "rev-list", "--reverse", "--first-parent", "--ancestry-path", f"{older}..{newer}"))
    return [older] + [line for line in listed.splitlines() if line]


def nearest_release(repo: str | Path, commit: str) -> str:
    """The newest supported release tagged at or before ``commit`` (``git describe``)."""
    try:
        tag = str(_git(repo, "describe", "--tags", "--abbrev=0", "--match", "v[0-9]*", commit))
    except SpecError:
        tag = ""
    found = _TAG_RE.match(tag)
    if not found or found.group(1) not in versions.SUPPORTED_RELEASES:
        raise SpecError(
            f"--repo {repo}: no supported release tag (v{versions.SUPPORTED_RELEASES[0]}..."
            f"v{versions.SUPPORTED_RELEASES[-1]}) at or before {commit[:12]} (git describe says {tag or 'nothing'}); "
            "pass --wheel VERSION to name the release whose wheel the commit goes on"
        )
    return found.group(1)


def short_subject(repo: str | Path, commit: str) -> str:
    return str(_git(repo, "log", "-1", "--format=%s", commit))


def overlay_key(plan: BuildPlan, wheel_digest: str) -> str:
    assert plan.source is not None
    material = {
        "format": OVERLAY_FORMAT,
        "source": "git-commit",
        "commit": plan.source.commit,
        "base": plan.base,
        "wheel_sha256": wheel_digest,
        "patches": [[p.name, p.sha256, *(["reverse"] if p.reverse else [])] for p in plan.patches],
        "probe_sha256": file_sha256(PROBE_SOURCE),
    }
    return "git-" + hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]


def _extract_commit(repo: str, commit: str, dest: Path) -> set[str]:
    """Write the commit's ``vllm/`` into ``dest``; return the paths it holds."""
    data = _git(repo, "archive", "--format=tar", commit, "vllm/", binary=True)
    names = set()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir() or m.issym()]
        tar.extractall(dest, members, filter="data")
        names = {m.name for m in members if m.isfile() or m.issym()}
    return names


def _add_from_wheel(pristine: Path, tree: Path, tracked: set[str]) -> list[str]:
    """Copy what the wheel has and the commit cannot have: generated files, wheel-only folders."""
    tracked_dirs = {str(Path(n).parent) for n in tracked}
    added = []
    for path in sorted((pristine / "vllm").rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(pristine).as_posix()
        if rel in tracked:
            continue
        folder = str(Path(rel).parent)
        if rel in _GENERATED or folder not in tracked_dirs and not any(d.startswith(folder + "/") for d in tracked_dirs):
            target = tree / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            added.append(rel)
    return added


def build_commit_overlay(plan: BuildPlan, on_line: Callable[[str], None] | None = None) -> BuildArtifact:
    """Build (or reuse) the overlay of a git-commit plan: the commit's ``vllm/`` + wheel extras +
    the plan's patches + the probe. Failures come back as the artifact's ``error``."""
    assert plan.source is not None
    source = plan.source
    try:
        wheel, pristine, wheel_digest = pristine_tree(plan.base, on_line)
        key = overlay_key(plan, wheel_digest)
        dest = paths.overlays_dir() / key
        if (dest / "manifest.json").exists():
            manifest = BuildManifest.from_json(json.loads((dest / "manifest.json").read_text()), str(dest / "manifest.json"))
            return BuildArtifact(plan=plan, ref=str(dest), manifest=manifest,
                                 reused=True, source_root=str(dest))
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{key}-"))
        try:
            if on_line:
                on_line(f"build {plan.name}: vllm/ of commit {source.commit[:12]} on the vLLM {plan.base} wheel")
            tracked = _extract_commit(source.repo, source.commit, tmp)
            if not (tmp / "vllm" / "__init__.py").exists():
                return BuildArtifact(plan=plan, ref=None, manifest=BuildManifest(),
                                     error=f"commit {source.commit[:12]} of {source.repo} has no vllm/__init__.py")
            added = _add_from_wheel(pristine, tmp, tracked)
            failure = patching.apply_patch_stack(tmp, plan.patches)
            if failure is not None:
                return BuildArtifact(plan=plan, ref=None, manifest=BuildManifest(), error=str(failure))
            return finish_overlay(plan, tmp, dest, wheel, wheel_digest, key, {
                "source": "git commit",
                "repo": source.repo,
                "commit": source.commit,
                "from_wheel": added,
            })
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    except KvreproError as exc:
        return BuildArtifact(plan=plan, ref=None, manifest=BuildManifest(), error=str(exc))
