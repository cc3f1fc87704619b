"""Copy-on-write of a partial prefix hit pointed past the request's blocks."""

from kvrepro.classify.patterns import Pattern

PATTERN = Pattern(
    name="kv_cache_apply_cow",
    exception="AssertionError",
    function="_apply_cow",
    file="vllm/v1/core/single_type_kv_cache_manager.py",
    expressions=("block_idx < len(req_blocks)",),
    # the face with an offload hit (docs/defect-family.md 3.15): the load's blocks extend full
    # attention's table past the recorded index, so the first assert holds and the next one fails
    other_statements=("req_blocks[block_idx] is source_block",),
    why=(
        "Seen on 0.26.0 with the same setup: a partial prefix hit remembered for copy-on-write "
        "refers to a block index the request no longer has when its blocks are allocated "
        "(for example after an offload hit changed how many blocks were computed locally)."
    ),
    test_log="apply-cow.log",
)
