"""A copy-on-write copy that reads its source before the same step's other copy fills it (vLLM 0.34.0, open)."""

from kvrepro.classify.corruption import ClassPattern, CorruptionSignature

CORRUPTION = CorruptionSignature(
    name="cow-chained-copy",
    title="a partial prefix hit copied (copy-on-write) from another request's copy-on-write block of the same step, "
          "before that block was filled",
    why=(
        "With a prefix-match unit below the KV block, a local hit that ends inside a block gets a private "
        "copy of the cached block: `_apply_cow` queues (source, fresh block) and the runner copies every "
        "pair of a step in one batched index copy (`blocks[dst] = blocks[src]`, v1/worker/utils.py "
        "0.34.0:985), which reads all sources before it writes any destination. vLLM caches the fresh "
        "block as a full block in the same scheduling step (`cache_full_blocks` from `allocate_slots`), "
        "so a second request scheduled in that step, sharing the block's whole prefix, finds the fresh "
        "block, takes a partial hit on it too and queues a copy from it: a chain A -> B -> C in one batch. "
        "C receives B as it was before the step (a zeroed new block on a GPU, model_runner.py 0.34.0:1363), "
        "and the second request attends to it below its hit. Full attention has no guard for blocks cached "
        "in the current step (Mamba `align` has `cached_blocks_this_step`). 0.34.0 reaches it with MTP and "
        "the OffloadingConnector: its lookahead block hashes (new for connectors in 0.34.0) make the "
        "earlier prompt's full block miss, so the first request's hit falls to the partial entry and only "
        "its private copy carries the full-block key the second request finds."
    ),
    classes=(ClassPattern(reads=("chained-copy",)),),
    upstream=(),
    fixed_by=(),
    needs_groups=("full_attention",),
    test_log="shadow-cow-chained-copy.log",
)
