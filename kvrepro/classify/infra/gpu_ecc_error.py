"""The GPU's memory reported an error it could not correct."""

from kvrepro.classify.infra import InfraCause

CAUSE = InfraCause(
    name="gpu_ecc_error",
    kind="GPU hardware error",
    line=r"uncorrectable ECC error encountered|CUDA_ERROR_ECC_UNCORRECTABLE",
    keywords=("ECC error", "ECC_UNCORRECTABLE"),
    why=(
        "An uncorrectable (double-bit) ECC error in the GPU's memory: a hardware fault. The run "
        "says nothing about the code; rerun it on another GPU (vLLM's maintainers: 'This usually "
        "means a hardware error')."
    ),
    upstream=("https://github.com/vllm-project/vllm/issues/5222",),
    test_log="infra-gpu-ecc-error.log",
)
