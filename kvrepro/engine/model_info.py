"""A sim engine inspects its model classes in its own process, not in a fresh interpreter.

vLLM learns what a model class supports (``_ModelInfo``: MTP, hybrid, attention-free, ...) by
importing it in a new interpreter (``registry._run_in_subprocess``, "to avoid initializing CUDA"
in the server) unless ``$VLLM_CACHE_ROOT/modelinfos`` holds the answer for that model file's hash.
A sim engine has no CUDA to protect, and that interpreter imports torch and vLLM again from
nothing: measured ~9 CPU s per class, twice per engine (the model and its MTP drafter), the
first time each release runs on a machine (empty cache, a new Docker volume, a Ray node's own
cache). Here the same ``fn`` runs in the engine's process, where vLLM is imported already (and,
forked from a zygote, the model module too). Everything else is vLLM's: the cache lookup before it,
the file it writes after it, what its caller does with an error. The plugin installs it when it
names the sim platform (``KVREPRO_SIM=1``: the API server, EngineCore, the offline engine, a Docker
container's ``vllm serve``); an image that carries kvrepro but runs on its GPUs keeps vLLM's isolation.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import TypeVar

REGISTRY = "vllm.model_executor.models.registry"
_T = TypeVar("_T")


def run_here(fn: Callable[[], _T]) -> _T:
    """What ``_run_in_subprocess(fn)`` returns, computed in this process."""
    return fn()


def _patch(module) -> None:
    if hasattr(module, "_run_in_subprocess"):
        module._run_in_subprocess = run_here


class _AfterRegistryImport(importlib.abc.MetaPathFinder):
    """Patches the registry right after it executes, wherever vLLM first imports it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != REGISTRY:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                original(module)
                _patch(module)

        spec.loader = _Loader()
        return spec


def install() -> None:
    """Run vLLM's model inspections in this process from now on: at once if vLLM's registry is
    imported, else right after vLLM imports it."""
    module = sys.modules.get(REGISTRY)
    if module is not None:
        _patch(module)
    elif not any(isinstance(f, _AfterRegistryImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterRegistryImport())
