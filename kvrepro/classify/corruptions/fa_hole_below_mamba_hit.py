"""Full-attention blocks below a deeper Mamba hit neither computed nor loaded, no offload hit (#46453)."""

from kvrepro.classify.corruption import ClassPattern, CorruptionSignature

CORRUPTION = CorruptionSignature(
    name="fa-hole-below-mamba-hit",
    title="full-attention KV below a deeper Mamba hit neither computed nor loaded, without an offload hit (#46453)",
    why=(
        "With a connector set, vLLM 0.26.0 takes the largest per-group local hit of a hybrid model as the "
        "request's computed prefix. When a Mamba state survived deeper in the prefix cache than the "
        "full-attention blocks and the connector has nothing to load, the request resumes at the Mamba "
        "hit: the full-attention blocks between the two hits are fresh blocks that nobody computes, and "
        "the request attends to whatever they held. This is the divergence of issue #46453 that "
        "#48425 (vLLM 0.27.0) closes by falling back to the reconciled hit when a Mamba hit is deeper "
        "than full attention's. It needs no patch of the matrix: the base alone shows it."
    ),
    classes=(ClassPattern(groups=("full_attention", "sliding_window"), offload=False,
                          reads=("missing", "stale", "foreign"), regions=("hit", "inherited")),),
    upstream=(
        "https://github.com/vllm-project/vllm/issues/46453",
        "https://github.com/vllm-project/vllm/pull/48425",
    ),
    fixed_by=("pr-48425",),
    needs_groups=("mamba", "full_attention"),  # a hybrid model: per-group hits can diverge
    test_log="shadow-fa-hole-no-offload.log",
)
