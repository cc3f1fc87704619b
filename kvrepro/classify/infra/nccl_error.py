"""NCCL itself failed (a system, network or CUDA error inside the communication library)."""

from kvrepro.classify.infra import InfraCause

CAUSE = InfraCause(
    name="nccl_error",
    kind="NCCL error",
    # torch.distributed.DistBackendError: NCCL error in: .../ProcessGroupNCCL.cpp:1970, unhandled system
    # error ...; vLLM's pynccl wrapper: RuntimeError: NCCL error: unhandled cuda error ...
    line=r"\bNCCL error\b",
    keywords=("NCCL error",),
    why=(
        "NCCL reported an error of its own (unhandled system error, remote process exited, "
        "unhandled cuda error): shared memory, the network, a peer or the driver, not the code "
        "under test. A kernel fault of the code shows up earlier as a CUDA error of its own and "
        "stays a crash."
    ),
    upstream=("https://github.com/vllm-project/vllm/issues/4618",
              "https://github.com/vllm-project/vllm/issues/10523",
              "https://github.com/vllm-project/vllm/issues/10626",
              "https://github.com/vllm-project/vllm/issues/5828"),
    test_log="infra-nccl-error.log",
)
