"""A load issued for a request whose own offload transfers are still in flight (vllm#46014)."""

from kvrepro.classify.patterns import Pattern

PATTERN = Pattern(
    name="offload_transfer_jobs_pending",
    exception="AssertionError",
    function="update_state_after_alloc",
    file="vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
    expressions=("not req_status.transfer_jobs",),
    why=(
        "A request preempted while its offload stores were in flight is re-admitted, with an offload "
        "hit, before the step that reports the flushed stores done has been processed (under "
        "asynchronous scheduling the next pass is scheduled first): the connector issues a load while "
        "transfer_jobs still holds the stores, against its one-load-xor-stores invariant. Every "
        "supported release defers such a lookup (vllm#46231); seen here with that guard taken out."
    ),
    upstream=(
        "https://github.com/vllm-project/vllm/issues/46014",
        "https://github.com/vllm-project/vllm/pull/46231",
    ),
    test_log="suite-preempt-readmit-transfer-jobs.log",
)
