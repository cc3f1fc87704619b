"""TieringOffloadingManager: a store prepared for a request it has already finalized."""

from kvrepro.classify.patterns import Pattern

PATTERN = Pattern(
    name="tiering_prepare_store_keyerror",
    exception="KeyError",
    function="prepare_store",
    file="vllm/v1/kv_offload/tiering/manager.py",
    expressions=("state = self._req_state[req_context.req_id]",),
    # the same lookup one statement later (prepare_store with nothing new to store, 0.26.0 :546)
    other_statements=("request_level_tiers = self._req_state[req_context.req_id].request_level_tiers",),
    why=(
        "Multi-tier offloading (TieringOffloadingSpec) with generated tokens offloaded "
        "(offload_prompt_only false): the connector signals a request's finish to the manager, "
        "which drops the request's state when no store is in flight, and the final chunk's store "
        "is prepared on the next step for a request the manager no longer knows. vLLM 0.27.0 "
        "builds the final stores before signalling the finish (#49671)."
    ),
    upstream=(
        "https://github.com/vllm-project/vllm/issues/49635",
        "https://github.com/vllm-project/vllm/pull/49671",
    ),
    test_log="suite-tiering-final-store-keyerror.log",
)
