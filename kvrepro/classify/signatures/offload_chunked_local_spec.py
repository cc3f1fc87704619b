"""The offloading scheduler meets a KV-cache spec it has no window rule for (chunked local attention)."""

from kvrepro.classify.patterns import Pattern

PATTERN = Pattern(
    name="offload_chunked_local_spec",
    exception="AssertionError",
    function="get_sliding_window_size_in_chunks",
    file="vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
    expressions=("isinstance(kv_cache_spec, FullAttentionSpec)",),
    why=(
        "At start-up the OffloadingConnector's scheduler asks each KV-cache group how many offload "
        "chunks its window spans: sliding window and Mamba are handled, everything else is asserted "
        "to be full attention. A model with chunked local attention (Llama 4) has a "
        "ChunkedLocalAttentionSpec group, and EngineCore fails to start. vLLM 0.28.0 bounds it like a "
        "sliding window of the attention chunk (#51161)."
    ),
    upstream=(
        "https://github.com/vllm-project/vllm/issues/51150",
        "https://github.com/vllm-project/vllm/pull/51161",
    ),
    test_log="offload-chunked-local-spec.log",
)
