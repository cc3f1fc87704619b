"""Full-attention blocks below the boundary neither loaded nor computed: #52807 without #48425."""

from kvrepro.classify.corruption import ClassPattern, CorruptionSignature

CORRUPTION = CorruptionSignature(
    name="fa-hole-below-boundary",
    title="full-attention KV below the boundary neither loaded nor computed after an offload hit (#52807 without #48425)",
    why=(
        "vLLM 0.26.0's scheduler tells the connector the largest per-group local hit of a hybrid model "
        "whenever a connector is set. With the boundary fix (#52807) the offloading connector loads from "
        "that boundary on, so the full-attention blocks between full attention's own hit and the boundary "
        "are neither loaded nor computed: the request attends to whatever those blocks held (measured: "
        "mostly another KV group's data, since the groups share one block pool). The blocks "
        "are then hashed into the prefix cache, and a later request that hits them locally inherits the "
        "hole. #48425 (vLLM 0.27.0) hands the connector the reconciled hit instead."
    ),
    classes=(
        # the request with the offload hit reads its own hole
        ClassPattern(groups=("full_attention", "sliding_window"), offload=True, reads=("missing", "stale", "foreign"),
                     regions=("hit",)),
        # a later request hits the hashed hole in the prefix cache (+offload: the hole's maker had one)
        ClassPattern(groups=("full_attention", "sliding_window"), offload=True, reads=("missing", "stale", "foreign"),
                     regions=("inherited",)),
    ),
    upstream=(
        "https://github.com/vllm-project/vllm/issues/46453",
        "https://github.com/vllm-project/vllm/pull/48425",
        "https://github.com/vllm-project/vllm/pull/52807",
    ),
    fixed_by=("pr-48425",),
    needs_groups=("mamba", "full_attention"),  # a hybrid model: per-group hits can diverge
    test_log="shadow-fa-hole.log",
)
