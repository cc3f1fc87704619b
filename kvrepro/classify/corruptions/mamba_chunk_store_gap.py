"""A Mamba state loaded from an offload sub-block that the gapped chunk store never wrote (fixed by #51358)."""

from kvrepro.classify.corruption import ClassPattern, CorruptionSignature

CORRUPTION = CorruptionSignature(
    name="mamba-chunk-store-gap",
    title="Mamba state loaded from an offload sub-block never written: a chunk stored with a null inside it (#51358)",
    why=(
        "Up to vLLM 0.28.0 the OffloadingConnector stores a Mamba `align` group like any other: "
        "`_build_store_jobs` lists a chunk's GPU blocks, skipping null ones, and records a single start "
        "index per group, the first non-null block's. The CPU worker writes the listed blocks to "
        "consecutive sub-blocks from that index. The connector's mirror of a request's Mamba block table "
        "is append-only while the Mamba manager pads skipped positions with the null block, so a chunk can "
        "read `[0, s, 0, b]`: its blocks land one sub-block too low and the last sub-block, where the "
        "chunk's boundary state belongs, is never written, yet the chunk's key is completed as stored. A "
        "later offload hit ending on that chunk loads the boundary state from the unwritten sub-block (on a "
        "GPU: another prefix's recurrent state or stale memory, silently). From 0.29.0 Mamba `align` groups "
        "are skipped by the chunk store and their boundary states are stored one block per job "
        "(`_build_aligned_boundary_store_jobs`), the change of #51358."
    ),
    classes=(
        # the request with the offload hit reads the sub-block the store skipped
        ClassPattern(groups=("mamba",), offload=True, reads=("missing", "stale", "wrong-state"), regions=("hit",)),
        # a later local hit on the block that load filled wrongly: the prefix cache serves it again
        ClassPattern(groups=("mamba",), offload=True, reads=("missing", "stale", "wrong-state"),
                     regions=("inherited",)),
    ),
    upstream=(
        "https://github.com/vllm-project/vllm/pull/51358",
    ),
    # the upstream change (vLLM 0.29.0); builds/ has no patch of it: it rewrites the Mamba store path
    fixed_by=("pr-51358",),
    needs_groups=("mamba",),
    test_log="shadow-mamba-chunk-store-gap.log",
)
