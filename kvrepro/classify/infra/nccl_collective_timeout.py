"""A collective (all-reduce, all-gather, ...) that never completed: torch's NCCL watchdog."""

from kvrepro.classify.infra import InfraCause

CAUSE = InfraCause(
    name="nccl_collective_timeout",
    kind="NCCL collective timeout",
    # torch's ProcessGroupNCCL: the watchdog's timeout, its heartbeat monitor when the watchdog
    # itself is stuck, and any other timeout ProcessGroupNCCL logs at error level (`[E...`); its
    # INFO/WARNING lines (`TIMEOUT(ms): 600000` among the options) are not a failure
    line=(r"Watchdog caught collective operation timeout"
          r"|ProcessGroupNCCL's watchdog got stuck"
          r"|\[E\d{4} [\d:.]+ (?:\d+ )?ProcessGroupNCCL\.cpp:\d+\].*\b(?:timed out|timeout)\b"),
    keywords=("Watchdog caught", "watchdog got stuck", "ProcessGroupNCCL"),
    why=(
        "A rank waited longer than the process group's timeout (600 s by default) for a collective "
        "the other ranks never joined: a hung or dead peer, a network or NVLink fault. torch then "
        "takes the whole process down; the engine's death is its consequence."
    ),
    upstream=("https://github.com/vllm-project/vllm/issues/2734",
              "https://github.com/vllm-project/vllm/issues/6042"),
    test_log="infra-nccl-watchdog-timeout.log",
)
