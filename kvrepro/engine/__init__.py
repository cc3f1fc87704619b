"""The GPU-free engine: vLLM's own ``vllm serve``, with a vLLM plugin where a GPU would be.

``python -m kvrepro.engine serve MODEL ARGS`` is ``vllm serve MODEL ARGS`` (see ``__main__``):
vLLM's API server, ``AsyncLLM``, the EngineCore process with its ``Scheduler``,
``KVCacheManager`` (prefix caching, hybrid full-attention + Mamba ``align`` groups), MTP draft
bookkeeping and the ``OffloadingConnector`` on both sides, vLLM's logging and lifecycle. With
``KVREPRO_SIM=1`` kvrepro's platform plugin (``plugin``, entry point group
``vllm.platform_plugins``) names ``platform.SimCpuPlatform``, which selects
``executor.SimExecutor``: the model (which tokens come out, whether a draft token is accepted)
and the offload worker's data movement (a job completes one step later; a load `engine.sim.load_steps`) are faked, because
this machine has no GPU. ``config`` holds the fake model's knobs (``KVREPRO_SIM_*``).

Geometry notes for matrix authors. vLLM itself refuses to start when one request of
``--max-model-len`` does not fit in the GPU pool (``--num-gpu-blocks-override`` blocks of
``--block-size`` tokens, less the Mamba blocks); with the shipped qwen3-next-tiny and block 16
that is max_model_len <= (blocks - 6) * 16. With 64 blocks, vLLM 0.26.0's scheduler can also
deadlock on async offload loads (a request parked in ``skipped_waiting`` ahead of finished
loads that hold the blocks it needs; upstream vllm#57841) in roughly one run in five; 96
blocks showed no such stall in 30 seeds while the target crash stays certain.

Start-up is dominated by importing torch & co.; ``zygote`` lets many engines share that cost.

This package imports only the standard library, vLLM and vLLM's own dependencies (plus the
stdlib-only ``kvrepro.versions``, and ``kvrepro.scratch`` with what it imports, for the /dev/shm
region claims of ``shm_region``): it runs in the runtime env, which has no kvrepro
dependencies. Nothing is imported here so that ``import kvrepro.engine`` stays free.
"""
