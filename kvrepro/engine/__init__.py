"""The GPU-free engine: vLLM's real EngineCore on the CPU, served over OpenAI-style HTTP.

Run as ``python -m kvrepro.engine <model_dir> <vllm serve args> [--host H] [--port P]`` (the
same argument list ``kvrepro.spec.EngineSpec.serve_args`` gives every target). What runs for
real: vLLM's ``EngineArgs`` -> ``VllmConfig``, ``EngineCore`` with its ``Scheduler``,
``KVCacheManager`` (prefix caching, hybrid full-attention + Mamba ``align`` groups), MTP draft
bookkeeping, the ``OffloadingConnector`` on both the scheduler side (CPU offloading manager,
lookups, load/store job building) and the worker side (job submission, completion reports).
What is faked (no GPU here): the model (which tokens come out, whether a draft token is
accepted) and the offload worker's data movement (every job completes one step later). See
``executor`` for the details and ``config`` for what had to be set by hand.

Geometry notes for matrix authors. vLLM itself refuses to start when one request of
``--max-model-len`` does not fit in the GPU pool (``--num-gpu-blocks-override`` blocks of
``--block-size`` tokens, less the Mamba blocks); with the shipped qwen3-next-tiny and block 16
that is max_model_len <= (blocks - 6) * 16. With 64 blocks, vLLM 0.26.0's scheduler can also
deadlock on async offload loads (a request parked in ``skipped_waiting`` ahead of finished
loads that hold the blocks it needs; upstream vllm#57841) in roughly one run in five; 96
blocks showed no such stall in 30 seeds while the target crash stays certain.

Start-up is dominated by importing torch & co.; ``zygote`` lets many engines share that cost.

This package imports only the standard library and vLLM (plus vLLM's own dependencies): it
runs in the runtime env, which has no kvrepro dependencies. Nothing is imported here so that
``import kvrepro.engine`` stays free.
"""
