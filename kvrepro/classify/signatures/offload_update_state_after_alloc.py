"""The crash kvrepro was built for: the local-hit boundary assertion of the offloading scheduler."""

from kvrepro.classify.patterns import Pattern

PATTERN = Pattern(
    name="offload_update_state_after_alloc",
    exception="AssertionError",
    function="update_state_after_alloc",
    file="vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
    expressions=(
        "num_locally_computed_tokens <= num_locally_computed_gpu_blocks * tokens_per_block",
        # what Python 3.11/3.12 print for the wrapped assert when no source is at hand
        "num_locally_computed_tokens",
        "<= num_locally_computed_gpu_blocks * tokens_per_block",
    ),
    why=(
        "A request with both a local prefix hit and an offload hit on a hybrid (attention + Mamba "
        "align) model: the scheduler takes the local hit as the maximum over KV groups, so the "
        "full-attention group can hold a fresh unhashed block below the local boundary and the "
        "connector finds fewer locally computed blocks than tokens. EngineCore dies."
    ),
    upstream=(
        "https://github.com/vllm-project/vllm/pull/52807",
        "https://github.com/vllm-project/vllm/pull/52771",
    ),
    test_log="serve-0.26-target.log",
)
