"""kvrepro's vLLM plugin: what makes vLLM's own ``vllm serve`` run without a GPU.

vLLM calls ``register()`` (entry point ``kvrepro_sim`` in the group ``vllm.platform_plugins``)
in every process that resolves ``vllm.platforms.current_platform``: the API server, the
EngineCore process, any worker. Two things happen there:

* the probe is activated (``import kvrepro_probe``): ``.pth`` files are not read from
  ``PYTHONPATH`` folders, and this hook runs in every vLLM process before the scheduler module
  is imported, which is what the probe needs to wrap it;
* the platform is named: :class:`kvrepro.engine.platform.SimCpuPlatform` when ``KVREPRO_SIM=1``,
  otherwise nothing, so an image that carries the plugin still runs on its GPUs unchanged; with
  it, vLLM's model-class inspection runs in the process (:mod:`kvrepro.engine.model_info`).

The entry point is declared by a hand-written ``kvrepro_sim-<version>.dist-info`` that kvrepro
puts next to each build's ``vllm/`` (``kvrepro.builds.plugin_dist``); nothing is pip-installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ENV_FLAG = "KVREPRO_SIM"
PLATFORM = "kvrepro.engine.platform.SimCpuPlatform"


def platform_for(environ) -> str | None:
    """The platform to name for this environment: the sim's when ``KVREPRO_SIM=1``, else none."""
    return PLATFORM if environ.get(ENV_FLAG, "") == "1" else None


def activate_probe():
    """Import the build's probe (next to its vllm/), or this checkout's copy outside an overlay."""
    if "kvrepro_probe" in sys.modules:
        return sys.modules["kvrepro_probe"]
    try:
        import kvrepro_probe  # noqa: PLC0415

        return kvrepro_probe
    except ImportError:
        path = Path(__file__).resolve().parent.parent / "probe" / "kvrepro_probe.py"
        spec = importlib.util.spec_from_file_location("kvrepro_probe", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["kvrepro_probe"] = module
        spec.loader.exec_module(module)
        return module


def register() -> str | None:
    activate_probe()
    platform = platform_for(os.environ)
    if platform is not None:  # no CUDA here: vLLM's model-class inspection runs in this process
        from .model_info import install

        install()
    return platform
