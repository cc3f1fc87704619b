"""truncate_computed_blocks asserts that a KV group holds as many blocks as the computed tokens cover."""

from kvrepro.classify.patterns import Pattern

PATTERN = Pattern(
    name="kv_cache_truncate_computed_blocks",
    exception="AssertionError",
    function="truncate_computed_blocks",
    file="vllm/v1/core/kv_cache_manager.py",
    expressions=("num_blocks <= len(group_blocks)",),
    why=(
        "0.27.0/0.27.1 with a hybrid model and a KV connector: when an external hit runs past a "
        "partial local tail the scheduler truncates every group's computed blocks to the local "
        "boundary, and a Mamba (align) group whose hit lags the full-attention one holds fewer "
        "blocks than that boundary covers. EngineCore dies. 0.28.0 clamps Mamba groups (#51468)."
    ),
    upstream=(
        "https://github.com/vllm-project/vllm/pull/51421",
        "https://github.com/vllm-project/vllm/pull/51468",
    ),
    test_log="truncate-computed-blocks.log",
)
