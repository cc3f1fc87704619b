"""The shadow KV follows a chunk through a secondary offload tier by the CPU tier's real memory.

Why: on vLLM 0.34.0, `tiering-mtp-store-assert` (TieringOffloadingSpec: CPU tier + fs tier) read
CORRUPT with ~790 violations, the first a Mamba block loaded from CPU chunk 93 "holding group 2's
data". 0.34.0's fs tier marks a key present once it stored it (``mark_present``,
tiering/fs/manager.py 0.34.0:285-288; 0.33.0 has no such update), and chunks cascaded to files
came back: 222-237 promotions per run, none on 0.33.0. A promotion reads the file into whichever
CPU row the primary tier allocates (fs/manager.py 0.34.0:238-268, ``cid * row stride``), and the
shadow, which keyed CPU contents by chunk id and learnt them from GPU stores only, judged that
row by what this engine last stored there. With :class:`CpuRegion` a store writes a stamp into
the row and a load reads it back, so whatever moves the row's bytes moves the shadow's contents.

Faked: no vLLM import. The region is a file in ``tmp_path`` (vLLM's is ``/dev/shm/vllm_offload_
<engine id>.mmap``), and the fs tier's cascade and promotion are done here the way its
``batch_store_block`` / ``batch_load_block`` do them: a whole row to a real file, a real file into
a row. KV-cache config and transfer specs are plain objects with vLLM's field names.
"""

from __future__ import annotations

import io
import os
from types import SimpleNamespace

import pytest

from kvrepro.engine.shadow import Content, CpuRegion, ShadowKV
from test_shadow_offload_pairs import _config, _cpu  # the run's groups: mamba, mamba, full attention

ROW = 4096


def _gpu(block_ids, group_sizes):
    return SimpleNamespace(block_ids=block_ids, group_sizes=group_sizes, block_indices=[0] * len(group_sizes))


@pytest.fixture
def region_file(tmp_path):
    path = tmp_path / "vllm_offload_engine.mmap"
    path.write_bytes(bytes(8 * ROW))
    return path


def _cascade(region_file, chunk, file):
    """The fs tier storing CPU chunk ``chunk``: its whole row to a file."""
    with open(region_file, "rb") as f:
        f.seek(chunk * ROW)
        file.write_bytes(f.read(ROW))


def _promote(file, region_file, chunk):
    """The fs tier promoting a file into CPU chunk ``chunk`` (a row the primary tier allocated)."""
    with open(region_file, "r+b") as f:
        f.seek(chunk * ROW)
        f.write(file.read_bytes())


def _shadow(region_file):
    shadow = ShadowKV(_config(), blocks_per_chunk=1, stream=io.StringIO())
    shadow.region = CpuRegion(str(region_file), ROW)
    return shadow


def test_a_promoted_chunk_loads_what_was_cascaded_not_what_its_row_held(region_file, tmp_path):
    shadow = _shadow(region_file)
    shadow.gpu[10] = Content(0, states=frozenset({"after 320"}), source="state of request 8")
    shadow.gpu[20] = Content(2, slots=["kv"] * 16, source="KV of request 11")

    # the run's shape (chunk numbers scaled to 8 rows): job 34 stored group 0's state in chunk 1,
    # the fs tier cascaded it and chunk 1 went back to the free pool; job 44 stored an FA block in
    # chunk 5, which was evicted later, and a promotion of the cascaded key got chunk 5's row
    shadow.store(34, _gpu([10], [1, 0, 0]), _cpu([1]))
    file = tmp_path / "key-of-job-34.bin"
    _cascade(region_file, 1, file)
    shadow.store(44, _gpu([20], [0, 0, 1]), _cpu([5]))
    _promote(file, region_file, 5)

    shadow.load(446, _cpu([5]), _gpu([83], [1, 0, 0]))
    loaded = shadow.gpu[83]
    assert loaded.group == 0 and loaded.states == frozenset({"after 320"}), loaded.source
    assert "moved by a secondary tier to CPU chunk 5" in loaded.source
    assert shadow.moved_loads == 1


def test_a_row_keeps_its_own_store_when_no_tier_moved_it(region_file):
    shadow = _shadow(region_file)
    shadow.gpu[20] = Content(2, slots=["kv"] * 16, source="KV of request 11")
    shadow.store(44, _gpu([20], [0, 0, 1]), _cpu([3]))
    shadow.load(45, _cpu([3]), _gpu([21], [0, 0, 1]))
    assert shadow.gpu[21].slots == ["kv"] * 16 and "moved" not in shadow.gpu[21].source
    assert shadow.moved_loads == 0 and not shadow.cpu  # contents live in the region, not by chunk id


def test_a_row_another_engine_wrote_holds_nothing_this_engine_knows(region_file, tmp_path):
    other = _shadow(region_file)
    other.gpu[10] = Content(0, states=frozenset({"theirs"}), source="another engine's state")
    other.store(1, _gpu([10], [1, 0, 0]), _cpu([2]))
    file = tmp_path / "shared.bin"
    _cascade(region_file, 2, file)

    shadow = _shadow(region_file)  # a later engine on the same tier folder
    _promote(file, region_file, 4)
    shadow.load(2, _cpu([4]), _gpu([30], [1, 0, 0]))
    assert shadow.gpu[30].states is None and "no store wrote" in shadow.gpu[30].source


def test_no_region_file_keeps_contents_by_chunk_id(tmp_path):
    """A CPU-only spec: the scheduler maps no region (only GPU workers would), so nothing to open."""
    shadow = ShadowKV(_config(), blocks_per_chunk=1, stream=io.StringIO())
    shadow.region = CpuRegion(os.fspath(tmp_path / "absent.mmap"), ROW)
    shadow.gpu[20] = Content(2, slots=["kv"] * 16, source="KV")
    shadow.store(1, _gpu([20], [0, 0, 1]), _cpu([3]))
    assert (3, 0) in shadow.cpu
    shadow.load(2, _cpu([3]), _gpu([21], [0, 0, 1]))
    assert shadow.gpu[21].slots == ["kv"] * 16


def test_a_chunk_outside_the_region_reads_as_unwritten_and_ends_nothing(region_file):
    shadow = _shadow(region_file)
    shadow.gpu[20] = Content(2, slots=["kv"] * 16, source="KV")
    shadow.store(1, _gpu([20], [0, 0, 1]), _cpu([8]))  # the region has rows 0-7
    shadow.load(2, _cpu([8]), _gpu([21], [0, 0, 1]))
    assert shadow.gpu[21].slots is None and "no store wrote" in shadow.gpu[21].source


def test_the_region_line_is_written_as_stores_happen_not_only_at_exit(region_file):
    """An engine stopped by a signal may never write its exit report (a CI run's log lacked the
    line once): the first stamp says the region is wired, later counts lines carry the count."""
    shadow = _shadow(region_file)
    shadow.gpu[20] = Content(2, slots=["kv"] * 16, source="KV of request 11")
    shadow.store(44, _gpu([20], [0, 0, 1]), _cpu([3]))
    written = shadow._stream.getvalue()
    assert f"cpu-region path={region_file} stamped=1 loaded_after_promotion=0" in written
    shadow.store(45, _gpu([20], [0, 0, 1]), _cpu([4]))
    shadow._last_report_time = 0.0  # the report interval has passed
    shadow.report()
    assert f"cpu-region path={region_file} stamped=2 " in shadow._stream.getvalue()
