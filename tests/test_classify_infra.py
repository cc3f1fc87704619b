"""Infrastructure root causes (kvrepro/classify/infra/: NCCL timeouts and errors, GPU hardware
errors)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrepro.classify import classify_file, classify_log
from kvrepro.classify.infra import known_infra_causes, match_infra
from kvrepro.classify.lines import split_line
from kvrepro.records import Outcome

LOGS = Path(__file__).parent / "data" / "logs"
SITE = "/usr/local/lib/python3.10/site-packages"


# --------------------------------------------------------------------------- the infra table

def test_every_infra_cause_has_a_test_log_that_yields_its_title():
    causes = known_infra_causes()
    assert {c.name for c in causes} >= {"nccl_collective_timeout", "nccl_error", "gpu_ecc_error", "gpu_lost"}
    readme = (LOGS / "README.md").read_text()
    for cause in causes:
        assert cause.test_log and cause.why and cause.keywords, cause.name
        path = LOGS / cause.test_log
        assert path.is_file(), f"infra cause {cause.name}: {path} missing"
        assert f"`{cause.test_log}`" in readme, f"{cause.test_log} is not listed in tests/data/logs/README.md"
        result = classify_file(path)
        assert result.outcome is Outcome.INFRA, (cause.name, result)
        assert result.title.startswith(cause.kind + ": "), (cause.name, result.title)
        first = next(body for body in (split_line(i, raw).body for i, raw in enumerate(path.open(), 1))
                     if match_infra(body) is not None)
        assert match_infra(first) is cause, f"{cause.test_log}: its first infra line is another cause's"
        assert result.title == cause.render_title(first)
        assert "crash of unknown cause" not in result.title


@pytest.mark.parametrize("name, title", [
    ("infra-nccl-watchdog-timeout.log",
     "NCCL collective timeout: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=20518, "
     "OpType=ALLREDUCE, NumelIn=106496, NumelOut=106496, Timeout(ms)=600000) ran for 600010 milliseconds before "
     "timing out."),
    ("infra-nccl-error.log",
     "NCCL error: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/"
     "NCCLUtils.cpp:77, remote process exited or there was a network error, NCCL version 2.27.3"),
    ("infra-gpu-ecc-error.log", "GPU hardware error: RuntimeError: CUDA error: uncorrectable ECC error encountered"),
    ("infra-gpu-fell-off-bus.log",
     "GPU hardware error: NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off "
     "the bus."),
])
def test_infra_logs_are_infra_titled_with_their_line(name, title):
    result = classify_file(LOGS / name)
    assert result.outcome is Outcome.INFRA
    assert result.title == title


FATAL = """\
INFO:     Application startup complete.
INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK
{before}ERROR 11-29 10:04:12 [core.py:1332] EngineCore encountered a fatal error.
ERROR 11-29 10:04:12 [core.py:1332] Traceback (most recent call last):
ERROR 11-29 10:04:12 [core.py:1332]   File "{site}/vllm/v1/worker/gpu_model_runner.py", line 3120, in execute_model
ERROR 11-29 10:04:12 [core.py:1332]     valid_sampled_token_ids = sampled_token_ids.tolist()
ERROR 11-29 10:04:12 [core.py:1332] RuntimeError: CUDA error: {error}
{after}"""
WATCHDOG = ("[rank0]:[E1129 10:04:11.408271257 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran "
            "for 600004 milliseconds before timing out.\n")


def test_an_infra_line_after_the_crash_is_its_consequence():
    log = FATAL.format(site=SITE, before="", error="an illegal memory access was encountered", after=WATCHDOG)
    result = classify_log(log)
    assert result.outcome is Outcome.OTHER_CRASH
    assert result.title.startswith("RuntimeError in execute_model")


def test_an_infra_line_before_the_crash_is_its_root_cause():
    log = FATAL.format(site=SITE, before=WATCHDOG, error="an illegal memory access was encountered", after="")
    result = classify_log(log)
    assert result.outcome is Outcome.INFRA and result.title.startswith("NCCL collective timeout: [Rank 0] Watchdog")


def test_unspecified_launch_failure_alone_stays_a_crash():
    """Ambiguous (a faulting kernel of the code under test raises it too): a crash unless a hardware
    line came first (infra-gpu-fell-off-bus.log)."""
    for error in ("unspecified launch failure", "an illegal memory access was encountered"):
        result = classify_log(FATAL.format(site=SITE, before="", error=error, after=""))
        assert result.outcome is Outcome.OTHER_CRASH, error


def test_a_worker_that_died_without_a_traceback_after_a_timeout_is_infra():
    log = ("INFO:     Application startup complete.\n" + "(Worker_TP1 pid=392) " + WATCHDOG +
           "(EngineCore_DP0 pid=245) ERROR 11-29 10:14:13 [multiproc_executor.py:154] Worker proc VllmWorker-1 died "
           "unexpectedly, shutting down executor.\n")
    result = classify_log(log)
    assert result.outcome is Outcome.INFRA and "Watchdog caught collective operation timeout" in result.title


@pytest.mark.parametrize("line", [
    "[rank0]:[I1129 10:00:31.1 ProcessGroupNCCL.cpp:919] [PG ID 0 PG GUID 0 Rank 0] ProcessGroupNCCL "
    "initialization options: size: 2, global rank: 0, TIMEOUT(ms): 600000, USE_HIGH_PRIORITY_STREAM: 0",
    "INFO 11-29 10:00:31 [pynccl.py:111] vLLM is using nccl==2.27.3",
    "NVRM: Xid (PCI:0000:3b:00): 31, pid=1234, name=python3, Ch 00000008, intr 00000000. MMU Fault",
    "NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception: ESR 0x505648=0x1000f",
])
def test_lines_that_are_not_an_infra_failure(line):
    assert match_infra(line) is None


def test_a_healthy_run_with_no_death_is_not_made_infra():
    log = "INFO:     Application startup complete.\n" + WATCHDOG
    assert classify_log(log).outcome is Outcome.NONE
