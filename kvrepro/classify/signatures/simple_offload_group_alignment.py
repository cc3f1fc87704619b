"""SimpleCPUOffloadConnector: an external hit that is not a whole number of a group's blocks."""

from kvrepro.classify.patterns import Pattern

PATTERN = Pattern(
    name="simple_offload_group_alignment",
    exception="AssertionError",
    function="update_state_after_alloc",
    file="vllm/v1/simple_kv_offload/manager.py",
    expressions=(
        "num_external_tokens % g_block_size == 0",
        "num_external_tokens % g_block_size == 0, (",
    ),
    # the assert's own message: what a report that quotes only the exception line gives (vllm#55168)
    message=r"num_external_tokens=\d+ not aligned to group \d+ block_size=\d+",
    why=(
        "SimpleCPUOffloadConnector splits an external hit into whole CPU blocks of every KV "
        "group. A hybrid model reconciles its hit to the finest group's alignment, while decode "
        "context parallelism scales only the attention groups' blocks, so the hit can end inside "
        "an attention group's block and EngineCore dies. vLLM 0.30.0 maps fine-grained hits per "
        "group and rounds up (#54736)."
    ),
    upstream=(
        "https://github.com/vllm-project/vllm/pull/55168",
        "https://github.com/vllm-project/vllm/pull/54736",
    ),
    test_log="simple-offload-group-alignment.log",
)
