"""The GPU-free data movement fails as vLLM's own CPU offload worker would (issue 48): a load whose
CPU keys and GPU blocks do not line up is an AssertionError raised by the release's own statement in
``transfer_async`` (``vllm/v1/kv_offload/cpu/gpu_worker.py``), never an error in kvrepro's code. The
specs are vLLM's own classes' shape (block ids, group sizes, block indices) built by hand: no GPU, no
engine; the release's vllm/ sources come from its cached wheel."""

from __future__ import annotations

import sys
import traceback
import types
from dataclasses import dataclass

import pytest

from kvrepro.engine import transfer_checks


@dataclass
class Spec:
    block_ids: list[int]
    group_sizes: tuple[int, ...] | None = None
    block_indices: tuple[int, ...] | None = None


@pytest.fixture(params=["0.26.0", "0.33.0"])
def release_vllm(request, monkeypatch):
    """``vllm`` in sys.modules pointing at the release's unpatched sources (nothing of it imported)."""
    from kvrepro.builds import pristine_tree

    _, tree, _ = pristine_tree(request.param)
    module = types.ModuleType("vllm")
    module.__file__ = str(tree / "vllm" / "__init__.py")
    monkeypatch.setitem(sys.modules, "vllm", module)
    return tree / "vllm"


def _raised(kind, src, dst, bpc) -> traceback.FrameSummary:
    with pytest.raises(AssertionError) as info:
        transfer_checks.check(kind, src, dst, bpc)
    return traceback.extract_tb(info.value.__traceback__)[-1]


def test_a_load_one_chunk_short_fails_in_vllms_transfer_async(release_vllm):
    # two groups of 4 GPU blocks from chunk-aligned positions, 4 blocks per chunk: 2 CPU blocks needed
    gpu = Spec([11, 12, 13, 14, 21, 22, 23, 24], (4, 4), (0, 0))
    frame = _raised("load", Spec([7]), gpu, 4)  # the connector dropped the first chunk's key
    worker = release_vllm / "v1/kv_offload/cpu/gpu_worker.py"
    assert frame.filename == str(worker) and frame.name == "transfer_async"
    assert frame.line == "assert src_end_offset <= num_src_blocks"
    assert worker.read_text().splitlines()[frame.lineno - 1].strip() == frame.line
    # one key too many: the walk ends short of the source's end
    frame = _raised("load", Spec([7, 8, 9]), gpu, 4)
    assert (frame.name, frame.line) == ("transfer_async", "assert src_offset == num_src_blocks")
    # a store of 5 GPU blocks into one CPU block of 4
    frame = _raised("store", Spec([1, 2, 3, 4, 5]), Spec([5]), 4)
    assert (frame.filename, frame.line) == (str(worker), "assert dst_end_offset <= num_dst_blocks")


def test_transfers_that_line_up_pass(release_vllm):
    # a group entered mid-chunk (block index 5 of 4-block chunks: skip 1) and a null-sized group
    transfer_checks.check("load", Spec([3, 4]), Spec([1, 2, 3, 4, 5], (5, 0), (5, 0)), 4)
    transfer_checks.check("store", Spec([1, 2, 3, 4, 5, 6]), Spec([9, 10]), 4)
    transfer_checks.check("load", Spec([3]), Spec([1]), 1)


def test_a_release_without_the_statement_still_fails_plainly(tmp_path, monkeypatch):
    module = types.ModuleType("vllm")
    module.__file__ = str(tmp_path / "vllm" / "__init__.py")  # no gpu_worker.py there
    monkeypatch.setitem(sys.modules, "vllm", module)
    with pytest.raises(AssertionError, match="src_end_offset <= num_src_blocks"):
        transfer_checks.check("load", Spec([7]), Spec([1, 2, 3, 4, 5], (5,), (0,)), 4)
