"""The GPU dropped off the PCIe bus, or the driver reported a hardware Xid."""

from kvrepro.classify.infra import InfraCause

# NVIDIA Xid codes that mean the hardware (or its firmware) failed, not the application: 48
# double-bit ECC, 61/62 internal micro-controller breakpoint/halt, 63/64 ECC page retirement or row
# remapping, 74 NVLink error, 79 fallen off the bus, 92 high single-bit ECC rate, 94/95
# contained/uncontained ECC error, 119/120 GSP timeout/error. Xids an application causes (13, 31,
# 43, 45: a faulting kernel) are left out on purpose.
_HARDWARE_XIDS = "48|61|62|63|64|74|79|92|94|95|119|120"

CAUSE = InfraCause(
    name="gpu_lost",
    kind="GPU hardware error",
    line=(r"GPU has fallen off the bus|GPU is lost"
          rf"|NVRM: Xid \([^)]*\): (?:{_HARDWARE_XIDS}),"),
    keywords=("fallen off the bus", "GPU is lost", "NVRM: Xid"),
    why=(
        "The driver lost the GPU (Xid 79, 'fallen off the bus': power, PCIe, overheating) or "
        "reported a hardware Xid; every process on it dies. A hardware fault: the run says "
        "nothing about the code."
    ),
    test_log="infra-gpu-fell-off-bus.log",
)
