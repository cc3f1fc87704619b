"""The offloading scheduler's sliding-window bound on the GPU blocks a load fills."""

from kvrepro.classify.patterns import Pattern

PATTERN = Pattern(
    name="offload_sliding_window_pending",
    exception="AssertionError",
    function="update_state_after_alloc",
    file="vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
    expressions=(
        # vLLM 0.26.0 (offloading/scheduler.py:822)
        "num_pending_gpu_blocks <= group_config.sliding_window_size_in_chunks * self.config.blocks_per_chunk",
        # the lines Python 3.11/3.12 print of the wrapped assert when no source is at hand
        "num_pending_gpu_blocks",
        "<= group_config.sliding_window_size_in_chunks",
        "<= group_config.sliding_window_size_in_blocks",
        # what a report quotes (#48959): the bound without its `group_config.`/`self.config.` owners
        "num_pending_gpu_blocks <= sliding_window_size_in_blocks * block_size_factor",
    ),
    # vLLM 0.25.1 (:740) names the same bound in blocks and block-size factors
    other_statements=(
        "num_pending_gpu_blocks <= group_config.sliding_window_size_in_blocks * self.config.block_size_factor",
    ),
    why=(
        "A sliding-window KV group whose external load starts at a window edge that is not "
        "GPU-block aligned: the load legitimately spans one GPU block more than the window's "
        "chunks times blocks per chunk, and the sanity bound kills EngineCore. vLLM 0.27.0 "
        "allows the one extra block (#49052)."
    ),
    upstream=(
        "https://github.com/vllm-project/vllm/issues/48959",
        "https://github.com/vllm-project/vllm/pull/49052",
    ),
    test_log="sliding-window-pending.log",
    # the target's function and file, another statement and another bug: never the target crash
    never_target=True,
)
