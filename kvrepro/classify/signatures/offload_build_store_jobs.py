"""Building store jobs found a different number of offload keys than GPU blocks to store."""

from kvrepro.classify.patterns import Pattern

PATTERN = Pattern(
    name="offload_build_store_jobs",
    exception="AssertionError",
    function="_build_store_jobs",
    file="vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
    expressions=("len(offload_keys) == len(offload_block_ids)",),
    why=(
        "Seen on 0.26.0 in some geometries: the chunks to store run past the block ids the "
        "request's group state holds. An allocated-chunks clamp in vLLM 0.27.1 may be the fix "
        "(not verified). A different bug from the target: it fires in build_connector_meta, "
        "not at allocation."
    ),
    test_log="build-store-jobs.log",
)
