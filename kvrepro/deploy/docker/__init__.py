"""The `docker` deploy target: builds become images, runs become containers on Docker hosts.

    kvrepro images base-cpu                   # once, for laptops/CI: a GPU-free vllm-openai look-alike
    kvrepro hosts check                       # each host: daemon, GPUs, ports, base image
    kvrepro matrix run --target docker        # builds A-D as images, each run as containers
    kvrepro clean [--images]                  # leftovers (only what carries kvrepro's labels; --images:
                                              # the assembled images and the vLLM cache volumes)

matrix.yaml, for a cluster (values shown are the defaults unless marked as an example)::

    base_image: vllm/vllm-openai:v0.26.0      # default vllm/vllm-openai:v<base>
    hosts:                                    # example: absent = the local daemon
      - {name: gb200-0, docker: "ssh://ops@gb200-0", gpus: 4, address: 10.0.0.10}
      - {name: gb200-1, docker: "ssh://ops@gb200-1", gpus: 4, address: 10.0.0.11}
    docker:
      nodes: [gb200-0, gb200-1]               # example: one engine over both, head first
      multi_node: nnodes                      # or data-parallel
      pass_env: [HF_TOKEN, HUGGING_FACE_HUB_TOKEN]   # names only; values come from your shell
      hf_cache: kvrepro-hf-cache              # volume name or absolute host path
      vllm_cache: kvrepro-vllm-cache          # one volume per release (<name>-<release>) as VLLM_CACHE_ROOT
      health_timeout_s: null                  # null: runs.start_timeout_s

Modules: ``assemble`` (image per build), ``launch`` (which container gets which flags),
``containers`` (logs, watchdog, health gate, teardown), ``target`` (the Target), ``hosts``,
``ssh`` (one kept OpenSSH connection per ssh:// host: daemon socket and engine API forwarded),
``basecpu`` (the CPU base image), ``clean``, ``cli``, ``errors`` (the named failures), ``on_nodes``
(this engine on another target's nodes: ``ray.engine: docker``).
"""

from __future__ import annotations

from typing import Any

# matrix.yaml's top-level sections this target owns (kvrepro.deploy.target_sections): typed in settings.py
SECTIONS = ("hosts", "docker", "base_image")
# an engine container downloads a Hugging Face model id itself (kvrepro.deploy.fetches_hub_models)
FETCHES_HUB_MODELS = True
# its engine can run on another target's nodes (``ray.engine: docker``): the hooks, kvrepro.deploy.node_engine
NODE_ENGINE = f"{__name__}.on_nodes"


def load() -> None:
    """Import the target (and with it the docker SDK, 0.2 s): ``deploy.get_target("docker")``
    calls this; commands that only show results (`results list`) never pay for it."""
    from . import target  # noqa: F401 - registers DockerTarget


def check_settings(matrix: Any) -> None:
    """``hosts:``, ``docker:`` and ``base_image:`` checked by their types (kvrepro.deploy.check_settings
    applies it); the SDK is not imported for it."""
    from .settings import check_settings as check

    check(matrix)


def engine_api_key(matrix: Any) -> str | None:
    """$VLLM_API_KEY when docker.pass_env hands it to the engine container: the engine then wants
    it on /v1/* (kvrepro.deploy.engine_api_key)."""
    import os

    from .settings import docker_settings

    if "VLLM_API_KEY" in docker_settings(matrix).docker.pass_env:
        return os.environ.get("VLLM_API_KEY") or None
    return None


def __getattr__(name: str) -> Any:
    if name in ("DockerEngineHandle", "DockerTarget"):
        from . import target

        return getattr(target, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FETCHES_HUB_MODELS", "NODE_ENGINE", "SECTIONS", "DockerEngineHandle", "DockerTarget", "check_settings",
           "engine_api_key", "load"]
