"""The assertion that the boundary fix (vLLM PR 52807) adds to the same function."""

from kvrepro.classify.patterns import Pattern

PATTERN = Pattern(
    name="offload_boundary_alignment",
    exception="AssertionError",
    function="update_state_after_alloc",
    file="vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
    expressions=("num_locally_computed_tokens % tokens_per_block == 0",),
    why=(
        "Only exists in builds carrying PR 52807: the fix rounds the local boundary and asserts "
        "that it is block-aligned. Seen with hash block 16 and KV block 32/64, where a local hit "
        "can end mid-block. It means the fix is incomplete for that geometry, not that the "
        "original crash is back, so it never counts as the target crash (unless the matrix's "
        "target_signature names this expression)."
    ),
    upstream=("https://github.com/vllm-project/vllm/pull/52807",),
    test_log="pr52807-alignment.log",
    never_target=True,
)
