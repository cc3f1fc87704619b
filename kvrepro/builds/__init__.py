"""Builds: a base vLLM release plus an ordered patch stack, made runnable.

For the GPU-free engine a build is an *overlay* (the patched ``vllm/`` package and the probe)
run inside one shared *runtime env* holding vLLM's dependencies. The Docker target uses the same
patching code on files copied out of a base image.
"""

from __future__ import annotations

from collections.abc import Callable

from .overlay import build_overlay, pristine_tree
from .patching import apply_patch_stack, touched_files
from .runtime import Runtime, ensure_runtime, is_ready
from .wheel import fetch_wheel, vllm_requirements


def prepare_runtime(base: str, on_line: Callable[[str], None] | None = None) -> Runtime:
    """The runtime (python + layers) for vLLM ``base`` (downloads and installs on first use)."""
    wheel, _, _ = pristine_tree(base, on_line)
    return ensure_runtime(vllm_requirements(wheel), on_line)


__all__ = [
    "Runtime", "apply_patch_stack", "build_overlay", "ensure_runtime", "fetch_wheel", "is_ready",
    "prepare_runtime", "pristine_tree", "touched_files", "vllm_requirements",
]
