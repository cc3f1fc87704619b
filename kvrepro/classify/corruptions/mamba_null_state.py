"""A Mamba state read from the null block: full attention's hit deeper than the state's (#48425, #50344)."""

from kvrepro.classify.corruption import ClassPattern, CorruptionSignature

CORRUPTION = CorruptionSignature(
    name="mamba-null-state",
    title="Mamba state read from the null block: the local hit is deeper than any saved state (#48425, #50344)",
    why=(
        "With a connector set, vLLM 0.26.0 takes the largest per-group local hit of a hybrid model. When "
        "full attention hit deeper than the last saved Mamba state and the connector has nothing to load, "
        "the request resumes at full attention's hit, and `preprocess_mamba` copies the running state "
        "from block `(num_computed_tokens - 1) // block_size`, which the request holds only as the null "
        "block: the recurrent layers start from a state that is not this prefix's. #48425 reconciles a "
        "deeper full-attention hit when the connector has nothing external; #50344 gives divergent hits "
        "only to connectors that declare they restore the Mamba state. Under a prefix-match unit below "
        "the block (0.26.0 `--prefix-match-unit`) MTP's drop of one unit leaves full attention's hit "
        "inside a block: the resume block is then the first chunk's own running-state block, a fresh "
        "Mamba block the scheduler never zeroes, so the read is of whatever it held before (nothing, "
        "another group's data, another prefix's state) instead of the null block."
    ),
    classes=(ClassPattern(groups=("mamba",), reads=("null-block",), regions=("hit",)),
             # the prefix-match-unit face (docs/defect-family.md 3.6): no offload hit (with one, a
             # chunk stored without its state is mamba-chunk-store-gap's)
             ClassPattern(groups=("mamba",), offload=False, reads=("missing", "foreign", "wrong-state"),
                          regions=("hit",))),
    upstream=(
        "https://github.com/vllm-project/vllm/issues/46453",
        "https://github.com/vllm-project/vllm/pull/48425",
        "https://github.com/vllm-project/vllm/pull/50344",
        "https://github.com/LMCache/LMCache/issues/4674",
    ),
    fixed_by=("pr-48425", "pr-50344"),
    needs_groups=("mamba", "full_attention"),  # a hybrid model: per-group hits can diverge
    test_log="shadow-mamba-null-state.log",
)
