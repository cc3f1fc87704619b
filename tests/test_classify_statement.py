"""The target's title is the whole failing statement whatever Python printed: Python 3.10 prints
only the first line of a wrapped ``assert`` (``assert (``); the statement is read from the build's
own source (``BuildArtifact.source_root``) at the traceback's file:line."""

from __future__ import annotations

from kvrepro.classify import classify_log
from kvrepro.records import Outcome
from kvrepro.spec.matrix import TargetSignature

SITE = "/usr/local/lib/python3.10/site-packages"


MULTI_LINE_ASSERT = '''\
class OffloadingConnectorScheduler:
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        num_locally_computed_gpu_blocks = len(blocks)
        tokens_per_block = 16
        num_locally_computed_tokens = request.num_computed_tokens
        assert (
            num_locally_computed_tokens
            <= num_locally_computed_gpu_blocks * tokens_per_block
        ), "more local tokens than blocks"
        return num_locally_computed_tokens
'''
TARGET_FILE = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
PY310_LOG = """\
INFO:     Application startup complete.
ERROR 11-30 13:46:45 [core.py:863] EngineCore encountered a fatal error.
ERROR 11-30 13:46:45 [core.py:863] Traceback (most recent call last):
ERROR 11-30 13:46:45 [core.py:863]   File "{site}/vllm/v1/core/sched/scheduler.py", line 963, in schedule
ERROR 11-30 13:46:45 [core.py:863]     self.connector.update_state_after_alloc(
ERROR 11-30 13:46:45 [core.py:863]   File "{site}/{file}", line 6, in update_state_after_alloc
ERROR 11-30 13:46:45 [core.py:863]     assert (
ERROR 11-30 13:46:45 [core.py:863] AssertionError: more local tokens than blocks
"""


def test_python_310_first_line_of_an_assert_is_read_whole_from_the_builds_source(tmp_path):
    source = tmp_path / "overlay"
    path = source / TARGET_FILE
    path.parent.mkdir(parents=True)
    path.write_text(MULTI_LINE_ASSERT)
    assert path.read_text().splitlines()[5].strip() == "assert ("  # line 6, as the traceback says
    log = PY310_LOG.format(site=SITE, file=TARGET_FILE)
    result = classify_log(log, source, TargetSignature())
    whole = "num_locally_computed_tokens <= num_locally_computed_gpu_blocks * tokens_per_block"
    assert result.signature.expression == whole
    assert result.title == f"AssertionError in update_state_after_alloc: {whole}"
    assert result.outcome is Outcome.TARGET


def test_a_cut_assert_without_the_source_says_so_rather_than_title_it_a_bracket(tmp_path):
    log = PY310_LOG.format(site=SITE, file=TARGET_FILE)
    for root in (None, tmp_path / "elsewhere"):
        result = classify_log(log, root, TargetSignature())
        assert result.title == ("AssertionError in update_state_after_alloc: assert ( ... (statement cut; "
                                f"{TARGET_FILE}:6)")
        # which assert it was is not known: a target that names its expression does not claim it
        named = TargetSignature(expression="num_locally_computed_tokens <= num_locally_computed_gpu_blocks * "
                                           "tokens_per_block")
        assert classify_log(log, root, named).outcome is Outcome.OTHER_CRASH
