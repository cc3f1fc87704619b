"""What vLLM's CPU offload worker checks of a transfer before it copies, failing as it fails.

The GPU-free engine moves no bytes (``SimTransferWorker``, kvrepro/engine/executor.py), so a transfer
whose CPU keys and GPU blocks do not line up would otherwise reach the shadow KV's pairing and fail
there, in kvrepro's code (an ``IndexError`` in ``ShadowKV._pairs`` under ``start_kv_transfers``,
measured on 0.33.0 with a connector that sent a load one chunk short). vLLM's own worker never
gets that far: ``SingleDirectionOffloadingHandler.transfer_async`` in
``vllm/v1/kv_offload/cpu/gpu_worker.py`` walks the groups' block counts and asserts that each
group's blocks fit in the spec on either side and that the walk used every block (0.26.0:323-359,
0.30.0:591-615, 0.33.0:642-666: ``assert src_end_offset <= num_src_blocks``, ...,
``assert dst_offset == num_dst_blocks``; 0.34.0 keeps the CPU side there, 576 and 593, and checks
the GPU side in ``resolve_device_pointers``, ``vllm/v1/kv_offload/pointer_utils.py``:104).

:func:`check` walks the transfer the same way (the same arithmetic as the shadow KV's pairing) and,
where vLLM's walk would fail, runs **the release's own assert statement**: the statement is taken
from the release's file by its text and compiled under that file's name and line inside a function
of the enclosing function's name, so the traceback ends in vLLM's file, function, line and statement
(``AssertionError`` in ``transfer_async``, ``vllm/v1/kv_offload/cpu/gpu_worker.py``), the title a
GPU engine would show. A release without that statement gets a plain ``AssertionError`` saying which
check failed (no vLLM frame to point at). Nothing here copies or changes anything.

Our own, not vLLM's code: the real ``transfer_async`` needs CUDA streams and pinned tensors before it
reaches its checks, and its signature differs between releases; only the checks are needed.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WORKER_FILE = "v1/kv_offload/cpu/gpu_worker.py"
POINTERS_FILE = "v1/kv_offload/pointer_utils.py"
HANDLER_FUNCTION = "transfer_async"
POINTERS_FUNCTION = "resolve_device_pointers"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _vllm_file(relative: str) -> Path | None:
    module = sys.modules.get("vllm")
    root = Path(module.__file__).parent if module is not None and getattr(module, "__file__", None) else None
    if root is None:
        return None
    path = root / relative
    return path if path.is_file() else None


@functools.lru_cache(maxsize=64)
def _statement(path: Path, function: str, text: str):
    """vLLM's ``assert <text>`` inside ``function`` of the file ``path``, compiled as a function of
    that name under the file's own path and line (None: the release has no such statement)."""
    try:
        tree = ast.parse(path.read_text(errors="replace"), str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function):
            continue
        for stmt in ast.walk(node):
            if isinstance(stmt, ast.Assert) and ast.unparse(stmt.test) == text:
                module = ast.parse("def wrapper():\n    pass\n")  # a def as this Python spells one
                wrapper = module.body[0]
                wrapper.name = function  # the name as data, never spliced into source text
                wrapper.body = [stmt]  # keeps its own line numbers: the traceback shows vLLM's line
                wrapper.lineno, wrapper.end_lineno = node.lineno, stmt.end_lineno
                return compile(module, str(path), "exec")
    return None


def fail(relative: str, function: str, texts: tuple[str, ...], values: Mapping[str, Any]) -> None:
    """Raise vLLM's own assertion: the first of ``texts`` the release's ``function`` asserts, evaluated
    over ``values`` (the walk's variables, named as vLLM names them)."""
    path = _vllm_file(relative)
    for text in texts if path is not None else ():
        code = _statement(path, function, text)
        if code is None:
            continue
        scope: dict[str, Any] = dict(values)
        exec(code, scope)  # noqa: S102 - vLLM's own statement, from the release's file
        scope[function]()  # raises AssertionError where vLLM's worker would
    raise AssertionError(f"{function} ({relative}): {texts[0]} does not hold "
                         f"({', '.join(f'{k}={v}' for k, v in values.items())})")


def _ids(spec) -> list[int] | None:
    ids = getattr(spec, "block_ids", None)
    return None if ids is None else [int(b) for b in ids]


def check(kind: str, src_spec, dst_spec, blocks_per_chunk: int) -> None:
    """The worker's checks of one ``kind`` ("load": CPU -> GPU, "store": GPU -> CPU) transfer with
    ``blocks_per_chunk`` GPU blocks per CPU block; AssertionError in vLLM's form where they fail."""
    to_cpu = kind == "store"
    gpu_spec, cpu_spec = (src_spec, dst_spec) if to_cpu else (dst_spec, src_spec)
    bpc = max(1, int(blocks_per_chunk))
    cpu_ids = _ids(cpu_spec)
    if cpu_ids is None:
        return  # not a block-ids spec (another medium): vLLM's other workers check their own
    if hasattr(gpu_spec, "group_block_counts"):  # 0.34.0+: device pointers, resolved from the GPU spec
        sizes = [int(n) for n in gpu_spec.group_block_counts]
        indices = [int(i) for i in gpu_spec.block_indices]
        _check_cpu_side(cpu_ids, sizes, indices, bpc)
        return
    gpu_ids = _ids(gpu_spec)
    if gpu_ids is None:
        return
    sizes = [int(n) for n in (getattr(gpu_spec, "group_sizes", None) or [len(gpu_ids)])]
    indices = [int(i) for i in (getattr(gpu_spec, "block_indices", None) or [0] * len(sizes))]
    src_blocks_per_chunk, dst_blocks_per_chunk = (1, bpc) if to_cpu else (bpc, 1)
    num_src_blocks, num_dst_blocks = (len(gpu_ids), len(cpu_ids)) if to_cpu else (len(cpu_ids), len(gpu_ids))
    src_offset = dst_offset = 0
    for group_size, block_idx in zip(sizes, indices):
        if group_size == 0:
            continue
        src_skip = block_idx % src_blocks_per_chunk
        dst_skip = block_idx % dst_blocks_per_chunk
        dst_end_offset = dst_offset + _cdiv(group_size + dst_skip, dst_blocks_per_chunk)
        src_end_offset = src_offset + _cdiv(group_size + src_skip, src_blocks_per_chunk)
        if dst_end_offset > num_dst_blocks:
            fail(WORKER_FILE, HANDLER_FUNCTION, ("dst_end_offset <= num_dst_blocks",),
                 {"dst_end_offset": dst_end_offset, "num_dst_blocks": num_dst_blocks})
        if src_end_offset > num_src_blocks:
            fail(WORKER_FILE, HANDLER_FUNCTION, ("src_end_offset <= num_src_blocks",),
                 {"src_end_offset": src_end_offset, "num_src_blocks": num_src_blocks})
        src_offset, dst_offset = src_end_offset, dst_end_offset
    if src_offset != num_src_blocks:
        fail(WORKER_FILE, HANDLER_FUNCTION, ("src_offset == num_src_blocks",),
             {"src_offset": src_offset, "num_src_blocks": num_src_blocks})
    if dst_offset != num_dst_blocks:
        fail(WORKER_FILE, HANDLER_FUNCTION, ("dst_offset == num_dst_blocks",),
             {"dst_offset": dst_offset, "num_dst_blocks": num_dst_blocks})


def _check_cpu_side(cpu_ids: list[int], sizes: list[int], indices: list[int], bpc: int) -> None:
    """0.34.0's walk (``transfer_async`` over ``iter_pointer_groups``): the CPU blocks only."""
    num_cpu_blocks = len(cpu_ids)
    cpu_offset = 0
    for group_size, block_idx in zip(sizes, indices):
        if group_size == 0:
            continue
        cpu_end_offset = cpu_offset + _cdiv(group_size + block_idx % bpc, bpc)
        if cpu_end_offset > num_cpu_blocks:
            fail(WORKER_FILE, HANDLER_FUNCTION, ("cpu_end_offset <= num_cpu_blocks",),
                 {"cpu_end_offset": cpu_end_offset, "num_cpu_blocks": num_cpu_blocks})
        cpu_offset = cpu_end_offset
    if cpu_offset != num_cpu_blocks:
        fail(WORKER_FILE, HANDLER_FUNCTION, ("cpu_offset == num_cpu_blocks",),
             {"cpu_offset": cpu_offset, "num_cpu_blocks": num_cpu_blocks})


def check_gpu_spec(gpu_spec) -> None:
    """0.34.0's ``resolve_device_pointers``: the GPU spec's group sizes add up to its block ids."""
    ids = _ids(gpu_spec)
    sizes = getattr(gpu_spec, "group_sizes", None)
    if ids is None or sizes is None:
        return
    blk_offset = sum(int(n) for n in sizes)
    if blk_offset != len(ids):
        fail(POINTERS_FILE, POINTERS_FUNCTION, ("blk_offset == len(block_ids)",),
             {"blk_offset": blk_offset, "block_ids": ids, "len": len})
