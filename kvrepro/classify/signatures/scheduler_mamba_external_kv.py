"""Mamba `align` block-aligned split refuses a request with an external (connector) hit."""

from kvrepro.classify.patterns import Pattern

PATTERN = Pattern(
    name="scheduler_mamba_external_kv",
    exception="AssertionError",
    function="_mamba_block_aligned_split",
    file="vllm/v1/core/sched/scheduler.py",
    expressions=(
        "num_external_computed_tokens == 0",
        # the first line of the wrapped assert, as Python 3.12 prints it without the source
        "num_external_computed_tokens == 0, (",
    ),
    why=(
        "A hybrid model in Mamba cache mode `align` with any KV connector: the scheduler splits "
        "the prefill of a request the connector answered with an external hit, and the split "
        "asserts there is none ('External KV connector is not verified yet'). EngineCore dies on "
        "the first external hit. vLLM 0.23.0 removed the assert and skips the split while an "
        "async load is set up (#42554); every release kvrepro supports carries that."
    ),
    upstream=(
        "https://github.com/vllm-project/vllm/pull/42554",
        "https://github.com/vllm-project/vllm/issues/45407",
        "https://github.com/vllm-project/vllm/issues/45268",
        "https://github.com/vllm-project/vllm/issues/43508",
        "https://github.com/vllm-project/vllm/issues/41515",
    ),
    test_log="suite-mamba-align-external-hit-assert.log",
)
