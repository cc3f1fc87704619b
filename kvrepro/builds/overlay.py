"""Per-build overlays: the base's ``vllm/`` package with the build's patch stack and the probe.

An overlay is keyed by what went into it (wheel sha256, ordered patch sha256s, probe sha256), so
identical inputs reuse it and any change makes a new one. Unchanged files are hard links into
the pristine extraction, so a build costs a few megabytes and well under a second.
"""

from __future__ import annotations

import ast
import hashlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .. import paths
from .records import BuildArtifact, BuildManifest
from ..spec.records import BuildPlan
from .plugin_dist import dist_info_files
from . import patching, wheel as wheels

PROBE_SOURCE = paths.PACKAGE_ROOT / "probe" / "kvrepro_probe.py"
OVERLAY_FORMAT = 2  # 2: vllm and kvrepro_sim dist-info folders (vLLM's own `vllm serve`)
# what the probe wraps (kvrepro_probe.TARGET_*; not imported: importing the probe installs it)
PROBE_TARGET_FILE = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
PROBE_TARGET_CLASS = "OffloadingConnectorScheduler"
PROBE_TARGET_METHOD = "update_state_after_alloc"


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_sha256(root: Path) -> str:
    """Content hash of a tree: every file's relative path and bytes, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(file_sha256(path).encode())
    return digest.hexdigest()


def probe_target_sha256(root: Path) -> str | None:
    """The sha256 the probe will log for this tree's wrapped method, computed from the file.

    The probe hashes ``inspect.getsource(method)``: the method's lines from its first decorator
    (or ``def``) to the end of its last statement, as written. ``ast`` gives the same span
    (``lineno`` of the first decorator, ``end_lineno``), so a run whose probe logs another hash
    ran other code than this build holds. None when the file or the method is not there.
    """
    path = root / PROBE_TARGET_FILE
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == PROBE_TARGET_CLASS:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == PROBE_TARGET_METHOD:
                    start = min([item.lineno] + [d.lineno for d in item.decorator_list])
                    lines = text.splitlines(keepends=True)[start - 1:item.end_lineno]
                    return hashlib.sha256("".join(lines).encode()).hexdigest()
    return None


def pristine_tree(version: str, on_line: Callable[[str], None] | None = None) -> tuple[Path, Path, str]:
    """(wheel, extracted tree, wheel sha256) for a base version; downloads/extracts once."""
    if on_line and wheels.cached_wheel(version) is None:
        on_line(f"downloading the vLLM {version} wheel")
    wheel = wheels.fetch_wheel(version)
    digest = wheels.wheel_sha256(wheel)
    tree = paths.overlays_dir() / "pristine" / f"{version}-{digest[:12]}"
    if not (tree / "vllm" / "__init__.py").exists() and on_line:
        on_line(f"extracting vllm/ from {wheel.name}")
    wheels.extract_sources(wheel, tree)
    return wheel, tree, digest


def overlay_key(plan: BuildPlan, wheel_digest: str) -> str:
    material = {
        "format": OVERLAY_FORMAT,
        "base": plan.base,
        "wheel_sha256": wheel_digest,
        # a revert is another build than the same file applied forward (old keys unchanged)
        "patches": [[p.name, p.sha256, *(["reverse"] if p.reverse else [])] for p in plan.patches],
        "probe_sha256": file_sha256(PROBE_SOURCE),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]


def _link_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, copy_function=os.link, ignore=shutil.ignore_patterns("__pycache__"))


def _unshare(path: Path) -> None:
    """Replace a hard link by a private copy so patching it cannot touch the pristine tree."""
    if path.exists():
        data = path.read_bytes()
        mode = path.stat().st_mode
        path.unlink()
        path.write_bytes(data)
        os.chmod(path, mode)


def install_dist_info(wheel: Path, root: Path) -> None:
    """Make ``root`` look like an installed vLLM to ``importlib.metadata``.

    `vllm serve` asks ``importlib.metadata.version("vllm")`` and vLLM finds its plugins through
    entry points, so the overlay carries vLLM's own ``METADATA`` and ``entry_points.txt`` and the
    ``kvrepro_sim`` dist-info whose entry point is the GPU-free platform plugin.
    """
    wheels.extract_dist_info(wheel, root, ("METADATA", "entry_points.txt", "top_level.txt"))
    for rel, text in dist_info_files().items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def finish_overlay(plan: BuildPlan, tmp: Path, dest: Path, wheel: Path, wheel_digest: str, key: str,
                   about: dict) -> BuildArtifact:
    """Complete a patched ``vllm/`` tree in ``tmp`` and move it to ``dest``: the probe, the
    dist-info folders `vllm serve` needs, and the manifest (``about`` says where the tree came
    from). Every kind of build (release wheel, git commit) ends here."""
    shutil.copy2(PROBE_SOURCE, tmp / PROBE_SOURCE.name)
    install_dist_info(wheel, tmp)
    manifest = {
        **about,
        "base": plan.base,
        "wheel": wheel.name,
        "wheel_sha256": wheel_digest,
        "patches": [{"name": p.name, "upstream": p.upstream, "sha256": p.sha256,
                     **({"reverse": True} if p.reverse else {})} for p in plan.patches],
        "probe_sha256": file_sha256(PROBE_SOURCE),
        # what the probe must log as source_sha256 when this build's code runs
        "probe_target_sha256": probe_target_sha256(tmp),
        "overlay_key": key,
        "overlay_sha256": tree_sha256(tmp),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if dest.exists():  # a concurrent builder (another slot, a prefetch thread) won; theirs is identical
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, dest)
    return BuildArtifact(plan=plan, ref=str(dest), manifest=BuildManifest.from_json(manifest), source_root=str(dest))


def build_release_overlay(plan: BuildPlan, on_line: Callable[[str], None] | None = None) -> BuildArtifact:
    """Build (or reuse) the overlay for ``plan`` on a release wheel (``kvrepro.builds.build_overlay``
    sends plans on a git commit to :mod:`kvrepro.builds.gitcommit` instead).

    A patch that does not apply fails this build only: the artifact comes back with ``error``
    naming the patch, file and hunk, and nothing is left in the cache.
    """
    wheel, pristine, wheel_digest = pristine_tree(plan.base, on_line)
    key = overlay_key(plan, wheel_digest)
    dest = paths.overlays_dir() / key
    manifest_path = dest / "manifest.json"
    if manifest_path.exists():
        manifest = BuildManifest.from_json(json.loads(manifest_path.read_text()), str(manifest_path))
        if manifest.probe_target_sha256 is None:  # an overlay made before the field existed
            manifest = dataclasses.replace(manifest, probe_target_sha256=probe_target_sha256(dest))
        return BuildArtifact(plan=plan, ref=str(dest), manifest=manifest, reused=True, source_root=str(dest))

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{key}-"))
    try:
        _link_tree(pristine / "vllm", tmp / "vllm")
        for patch in plan.patches:
            for rel in patching.touched_files(patch.path):
                _unshare(tmp / rel)
        if on_line:
            on_line(f"build {plan.name}: applying {len(plan.patches)} patch(es) to vLLM {plan.base}")
        failure = patching.apply_patch_stack(tmp, plan.patches)
        if failure is not None:
            return BuildArtifact(plan=plan, ref=None, manifest=BuildManifest(), error=str(failure))
        return finish_overlay(plan, tmp, dest, wheel, wheel_digest, key, {})
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
