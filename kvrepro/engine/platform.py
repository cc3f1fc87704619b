"""The GPU-free platform: vLLM's ``CpuPlatform`` that keeps a GPU's KV-cache geometry.

vLLM picks its platform through the ``vllm.platform_plugins`` entry-point group; kvrepro's
plugin (``kvrepro.engine.plugin.register``) names :class:`SimCpuPlatform` when the sim is asked
for (``KVREPRO_SIM=1``). Everything vLLM does on the CPU platform is kept, except what would
make the engine differ from a GPU node or could not run here:

* **Executor.** ``distributed_executor_backend`` becomes the sim executor (a fake model and
  fake offload data movement, see ``executor``), so the command line stays exactly what a GPU
  node runs: no ``--distributed-executor-backend`` flag is needed.
* **Mamba state dtype.** The CPU platform forces float32 on AMX machines; that would change the
  Mamba page size, and with it the KV geometry, depending on the host CPU. It stays as
  configured.
* **Attention backend for block alignment.** vLLM asks the platform which attention backend the
  model's full-attention layers use to align hybrid block sizes; a GPU answers
  ``FlashAttentionBackend``, and so do we (the sim never builds model layers to look at).
* **Process start method.** The CPU platform forces ``spawn`` for child processes; the start
  method set before (``VLLM_WORKER_MULTIPROC_METHOD``; kvrepro's targets set ``fork``, the GPU
  default when CUDA is not initialised) is kept, so the EngineCore process reuses the API
  server's imports and saves seconds per engine start.
* **The CPU worker's own requirements.** ``CpuPlatform.check_and_update_config`` also checks what
  vLLM's CPU *worker* needs to run a model: from 0.34.0 it refuses an x86 host without Triton
  (``RuntimeError: vLLM on x86 CPUs requires Triton (triton-cpu)``, ``platforms/cpu.py`` 0.34.0:
  238-243; 0.31.0-0.33.0 only warned, 0.33.0:239-244) because 0.34.0 dropped the C++ fallbacks of the CPU
  runner's Triton kernels (``register_triton_kernel_overrides``, 0.33.0:696-749). The sim builds no
  worker and runs no kernel, and the GPU node it stands for has Triton, so the config check is
  made with Triton reported present (:meth:`SimCpuPlatform._as_gpu_host`); nothing else in the
  engine sees that answer.

* **Asynchronous scheduling.** The CPU platform turns it off ("not required on CPU",
  platforms/cpu.py 0.26.0:142-144); a GPU platform leaves vLLM's own decision
  (``VllmConfig.__post_init__``, config/vllm.py 0.26.0:1021-1107, made before the platform's
  ``check_and_update_config`` in every supported release: on with MTP unless the executor cannot,
  and the sim executor can). That decision is kept, so EngineCore schedules as the GPU node does;
  ``--async-scheduling`` / ``--no-async-scheduling`` (``engine.async_scheduling``) set it as there.
"""

from __future__ import annotations

import contextlib
import os

from vllm.platforms.cpu import CpuPlatform

SIM_EXECUTOR = "kvrepro.engine.executor.SimExecutor"


class SimCpuPlatform(CpuPlatform):
    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        cache_config = vllm_config.cache_config
        configured_dtype = cache_config.mamba_ssm_cache_dtype
        start_method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
        decided_async = vllm_config.scheduler_config.async_scheduling  # vLLM's decision, as on a GPU
        with cls._as_gpu_host():
            super().check_and_update_config(vllm_config)
        cache_config.mamba_ssm_cache_dtype = configured_dtype
        vllm_config.scheduler_config.async_scheduling = decided_async
        if start_method is None:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        else:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = start_method
        vllm_config.parallel_config.distributed_executor_backend = SIM_EXECUTOR

    @classmethod
    def _find_non_ssm_backend(cls, vllm_config):
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend

    @classmethod
    @contextlib.contextmanager
    def _as_gpu_host(cls):
        """While the CPU platform checks a config: Triton present, as on the GPU node the sim stands
        for. ``CpuPlatform.check_and_update_config`` reads ``vllm.triton_utils.HAS_TRITON`` when it
        runs (a lazy import, 0.31.0-0.34.0; earlier releases never read it), only to decide what its
        own worker can run; the real value is back as soon as the check returns, for every other
        reader."""
        import vllm.triton_utils as triton_utils

        had = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            yield
        finally:
            triton_utils.HAS_TRITON = had
