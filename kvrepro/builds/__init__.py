"""Builds: a base vLLM release plus an ordered patch stack, made runnable.

For the GPU-free engine a build is an *overlay* (the patched ``vllm/`` package and the probe)
run inside one shared *runtime env* holding vLLM's dependencies. The Docker target uses the same
patching code on files copied out of a base image.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..spec.records import BuildPlan
from .records import BuildArtifact

if TYPE_CHECKING:
    from .runtime import Runtime

# The package's face, imported on first use (PEP 562): a module that needs only the stage's records
# (kvrepro.builds.records: results, the report, every command reading a results folder) does not
# pay for the overlay, wheel and runtime code (what `kvrepro --help` would then import).
_LAZY = {"build_commit_overlay": "gitcommit", "build_release_overlay": "overlay", "pristine_tree": "overlay",
         "apply_patch_stack": "patching", "touched_files": "patching", "Runtime": "runtime",
         "ensure_runtime": "runtime", "is_ready": "runtime", "fetch_wheel": "wheel", "vllm_requirements": "wheel"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_overlay(plan: BuildPlan, on_line: Callable[[str], None] | None = None) -> BuildArtifact:
    """Build (or reuse) the overlay for ``plan``: on a release wheel, or on a git commit when the
    plan names one (``plan.source``). A patch that does not apply fails this build only (the
    artifact's ``error`` names the patch, file and hunk)."""
    if plan.source is not None:
        from .gitcommit import build_commit_overlay

        return build_commit_overlay(plan, on_line)
    from .overlay import build_release_overlay

    return build_release_overlay(plan, on_line)


def prepare_runtime(base: str, on_line: Callable[[str], None] | None = None) -> Runtime:
    """The runtime (python + layers) for vLLM ``base`` (downloads and installs on first use)."""
    from .overlay import pristine_tree
    from .runtime import ensure_runtime
    from .wheel import vllm_requirements

    wheel, _, _ = pristine_tree(base, on_line)
    return ensure_runtime(vllm_requirements(wheel), on_line)


def setup_matrix(loaded, on_line: Callable[[str], None] | None = None) -> dict:
    """`kvrepro setup`: every release's runtime env and every build's overlay (idempotent); what
    was made, as `setup --json` prints it. ``loaded``: a spec LoadedMatrix."""
    done: dict = {}
    for release in loaded.matrix.bases:
        runtime = prepare_runtime(release, on_line=on_line)
    done["runtime_python"] = str(runtime.python)
    done["runtime_layers"] = [str(p) for p in runtime.layers]
    done["builds"] = {}
    for plan in loaded.plans():
        artifact = build_overlay(plan, on_line=on_line)
        done["builds"][plan.name] = {"ok": artifact.ok, "overlay": artifact.ref, "error": artifact.error,
                                     "reused": artifact.reused}
    return done


def setup_lines(done: dict) -> list[str]:
    """`kvrepro setup`'s report of :func:`setup_matrix` (rich markup)."""
    return [f"runtime env: {done['runtime_python']}"] + [
        f"build {name}: " + (f"[green]ok[/] {b['overlay']}" if b["ok"] else f"[red]failed[/] {b['error']}")
        for name, b in done["builds"].items()]


__all__ = [
    "setup_lines", "setup_matrix",
    "Runtime", "apply_patch_stack", "build_overlay", "ensure_runtime", "fetch_wheel", "is_ready",
    "prepare_runtime", "pristine_tree", "touched_files", "vllm_requirements",
]
