"""Stream a log of any size and hand on only the lines triage reads.

A production log is gigabytes of access lines and stats; triage needs its version banner, the
args line, a few info lines, the periodic stats and the tracebacks. Reading it line by line in
Python costs about a microsecond a line (10 s per GB on this machine, before any regex), so the
log is read in blocks of a few MB and searched for keywords with ``bytes.find`` (memchr speed);
only the lines holding one -- plus a window of lines after each traceback start, whose frames
carry no keyword -- are decoded and yielded, in order, with their line numbers. Memory holds one
block at a time. gzip is read through the stdlib's streaming decompressor.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..classify.infra import infra_keywords
from ..errors import BadInputError

BLOCK = 8 << 20
# lines kept after a traceback starts, whatever they say: its frames and code lines have no keyword
TRACEBACK_WINDOW = 400
MAX_LINE = 4 << 20  # a longer "line" is cut: no log line of vLLM's is that long, a binary blob is
_GZIP_MAGIC = b"\x1f\x8b"

# lines that start a window (their followers belong to a traceback)
WINDOW_KEYWORDS = (b"Traceback (most recent call last)", b"EngineCore encountered a fatal error",
                   b"EngineCore failed to start")
# lines read for the configuration, the stall and classify's own decisions (classifier._KEYWORDS)
LINE_KEYWORDS = (
    b"vLLM API server version", b"non-default args", b"Mamba cache mode", b"attention block size",
    b"Initializing a V1 LLM engine", b"Resolved architecture", b"throughput:",
    b"Application startup complete", b"ERROR", b"CRITICAL", b": error: ", b"died", b"EngineDead",
    b"EngineCore encountered", b"[shutdown] ", b"Shutting down",
)
# needed once (classify takes an answered request as proof the server was up); after the first,
# the gigabytes of access lines are skipped
FIRST_ONLY_KEYWORDS = (b'" 200',)


@dataclass
class ReadStats:
    lines: int = 0
    bytes_read: int = 0
    selected: int = 0
    last_line: str = ""  # the log's last line (its timestamp ends a stall)


def _open(path: Path) -> BinaryIO:
    if path.is_dir():
        raise BadInputError(f"{path}: is a folder; give the log file (plain or .gz)")
    try:
        fh = open(path, "rb")  # noqa: SIM115 - returned to the caller, closed by it
    except FileNotFoundError:
        raise BadInputError(f"{path}: no such file; give a vLLM server log (plain or .gz)") from None
    if fh.read(2) == _GZIP_MAGIC:
        fh.seek(0)
        return gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[return-value]
    fh.seek(0)
    return fh


def read_selected(path: Path, stats: ReadStats) -> Iterator[tuple[int, str]]:
    """(line number, raw line with its newline) for every line triage reads, in file order.

    Raises BadInputError for a binary file (a NUL byte in its first 64 KB) or a damaged gzip."""
    keywords = LINE_KEYWORDS + tuple(k.encode() for k in infra_keywords())
    first_only = list(FIRST_ONLY_KEYWORDS)
    window_left = 0
    carry = b""
    fh = _open(path)
    try:
        first = True
        while True:
            try:
                data = fh.read(BLOCK)
            except (OSError, EOFError, zlib.error) as exc:
                raise BadInputError(f"{path}: damaged gzip data after {stats.bytes_read:,} bytes ({exc}); "
                                    "give the whole file, or gunzip what is left of it") from None
            if first:
                first = False
                if b"\x00" in data[:65536]:
                    raise BadInputError(f"{path}: a binary file (NUL bytes in its first 64 KB), not a log; give "
                                        "the server's text log (`docker logs`, the pod's log, plain or .gz)")
            stats.bytes_read += len(data)
            block = carry + data
            if data:
                cut = block.rfind(b"\n") + 1
                if cut == 0 and len(block) < MAX_LINE:
                    carry = block
                    continue
                if cut == 0:
                    cut = len(block)
                body, carry = block[:cut], block[cut:]
            else:
                body, carry = block, b""
            if body:
                window_left = yield from _select(body, stats, keywords, first_only, window_left)
            if not data:
                break
    finally:
        fh.close()


def _select(body: bytes, stats: ReadStats, keywords: tuple[bytes, ...], first_only: list[bytes],
            window_left: int) -> Iterator[tuple[int, str]]:
    starts: set[int] = set()
    size = len(body)

    def line_start(i: int) -> int:
        return body.rfind(b"\n", 0, i) + 1

    for kw in keywords:
        i = body.find(kw)
        while i >= 0:
            starts.add(line_start(i))
            end = body.find(b"\n", i)
            if end < 0:
                break
            i = body.find(kw, end)
    for kw in list(first_only):
        i = body.find(kw)
        if i >= 0:
            starts.add(line_start(i))
            first_only.remove(kw)
    windows: list[tuple[int, int]] = []  # (offset of a window's first line, lines to keep after it)
    if window_left:
        starts.add(0)
        windows.append((0, window_left - 1))
    for kw in WINDOW_KEYWORDS:
        i = body.find(kw)
        while i >= 0:
            s = line_start(i)
            starts.add(s)
            windows.append((s, TRACEBACK_WINDOW))
            end = body.find(b"\n", i)
            if end < 0:
                break
            i = body.find(kw, end)
    left_over = 0
    for pos, count in windows:
        for kept in range(count):
            end = body.find(b"\n", pos)
            if end < 0 or end + 1 >= size:
                left_over = max(left_over, count - kept)  # the window goes on in the next block
                break
            pos = end + 1
            starts.add(pos)
    number = stats.lines
    previous = 0
    for s in sorted(starts):
        if s >= size:
            continue
        number += body.count(b"\n", previous, s)
        previous = s
        end = body.find(b"\n", s)
        raw = body[s:end + 1 if end >= 0 else size]
        stats.selected += 1
        yield number + 1, raw[:MAX_LINE].decode("utf-8", errors="replace")
    stats.lines += body.count(b"\n") + (0 if body.endswith(b"\n") else 1)
    last_start = body.rfind(b"\n", 0, size - 1) + 1
    stats.last_line = body[last_start:last_start + 4096].decode("utf-8", errors="replace")
    return left_over


def read_text_lines(text: str) -> Iterator[tuple[int, str]]:
    """Every line of a text (tests, small logs), numbered, as :func:`read_selected` yields them."""
    for number, line in enumerate(io.StringIO(text, newline="\n"), start=1):
        yield number, line
