"""Stream a log of any size and hand on only the lines triage reads.

A production log is gigabytes of access lines and stats; triage needs its version banner, the
args line, a few info lines, the periodic stats and the tracebacks: the lines holding a keyword,
plus a window of lines after each traceback start (its frames carry no keyword). They are yielded
in order with their line numbers; nothing else is decoded, and memory holds no more than a block.

The log is opened by kvrepro/classify/logfile.py, as `classify` opens one: plain, gzip, bzip2, xz
or zstd, UTF-8 or UTF-16, a pipe (``-``, ``/dev/stdin``) but never a named FIFO, every line cut to
``untrusted.LINE_LIMIT`` bytes (a 3 GB "line" held whole made GNU grep alone take 2x its size).
That stream is then searched two ways, for the same lines (tests/test_triage.py checks they agree):

* with GNU grep (``grep -F``: every keyword in one pass), fed the stream by this process, three
  greps side by side: every keyword, the traceback windows (-A), the first answered request
  (-m 1). Measured on a 100 MB log while the machine was loaded (load average 11-20): 1.2 s for
  gzip, against 3.3 s for the Python search below;
* without GNU grep, blocks of 8 MB are searched with ``bytes.find``, keyword by keyword.
"""

from __future__ import annotations

import functools
import heapq
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ..classify.infra import infra_keywords
from ..classify.logfile import LogInfo, LogStream, open_log_bytes
from ..errors import BadInputError
from ..untrusted import LINE_LIMIT

BLOCK = 8 << 20
# lines kept after a traceback starts, whatever they say: its frames and code lines have no keyword
TRACEBACK_WINDOW = 400
MAX_LINE = LINE_LIMIT  # a longer "line" is cut (by the opener): no log line of vLLM's is that long

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
# where a report says its version and configuration other than vLLM's start-up lines
# (kvrepro/triage/sources.py): a command line, collect_env / pip output, an image tag, a dump
SOURCE_KEYWORDS = (b"vllm serve", b"vllm.entrypoints", b"vllm-openai", b"vLLM Version", b"Dumping input data",
                   b"LLM engine (v", b"--kv-transfer-config", b"--kv-offloading", b"--speculative-config",
                   b"vllm==")
LINE_KEYWORDS = LINE_KEYWORDS + SOURCE_KEYWORDS
# needed once (classify takes an answered request as proof the server was up); after the first,
# the gigabytes of access lines are skipped
FIRST_ONLY_KEYWORDS = (b'" 200',)


@dataclass
class ReadStats:
    lines: int = 0
    bytes_read: int = 0
    selected: int = 0
    last_line: str = ""  # the log's last line (its timestamp ends a stall)
    notices: list[str] = field(default_factory=list)  # what reading noticed (lines cut, UTF-16), for warnings


def read_selected(path: Path, stats: ReadStats, use_grep: bool = True) -> Iterator[tuple[int, str]]:
    """(line number, raw line with its newline) for every line triage reads, in file order.

    Raises BadInputError for what is not a log (kvrepro/classify/logfile.py: a binary file, a
    damaged compressed stream with where, a FIFO, a folder)."""
    with open_log_bytes(path, require_text=True) as (stream, info):
        yield from select_stream(stream, info, path, stats, use_grep)


def select_stream(stream: LogStream | Prefixed, info: LogInfo, path: Path, stats: ReadStats,
                  use_grep: bool = True) -> Iterator[tuple[int, str]]:
    """:func:`read_selected` of a log already opened by kvrepro/classify/logfile.py (``stream``
    from its start: a :class:`Prefixed` when its first bytes were read already)."""
    grep = _gnu_grep() if use_grep else None
    if grep is not None:
        yield from _grep_stream_selected(grep, stream, path, stats)
    else:
        yield from _python_selected(stream, stats)
    stats.notices.extend(info.notices())
    stats.bytes_read = max(stats.bytes_read, info.out_bytes)  # the log's bytes, cut lines whole


class Prefixed:
    """``head`` (bytes already read from ``rest``), then the rest of ``rest``: a stream from its start."""

    def __init__(self, head: bytes, rest: LogStream):
        self._head, self._rest = head, rest

    def read(self, size: int = -1) -> bytes:
        if self._head:
            out = self._head if size is None or size < 0 else self._head[:size]
            self._head = self._head[len(out):]
            return out
        return self._rest.read(size)


_STREAM_PREFIX = re.compile(rb"(\d+)[:-]")


def _grep_stream_selected(grep: str, stream: LogStream | Prefixed, path: Path, stats: ReadStats) -> Iterator[tuple[int, str]]:
    """The log's text fed to three greps at once, whose output goes to temporary files (so no grep
    waits on a reader): every keyword, the traceback windows (-A) and the first answered request
    (-m 1). Then the three are merged in line order (each line read back bounded)."""
    import tempfile

    env = dict(os.environ, LC_ALL="C")
    base = [grep, "-a", "-n", "-F"]

    def patterns(words: tuple[bytes, ...]) -> list[str]:
        return [a for w in words for a in ("-e", w.decode())]

    commands = [[*base, *patterns(LINE_KEYWORDS + tuple(k.encode() for k in infra_keywords()))],
                [*base, "--no-group-separator", "-A", str(TRACEBACK_WINDOW), *patterns(WINDOW_KEYWORDS)],
                [*base, "-m", "1", *patterns(FIRST_ONLY_KEYWORDS)]]
    outputs = [tempfile.TemporaryFile() for _ in commands]
    procs: list[subprocess.Popen] = []
    try:
        procs = [subprocess.Popen(c, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.DEVNULL, env=env)
                 for c, out in zip(commands, outputs, strict=True)]
        feeding = list(procs)
        tail, count, last_byte = b"", 0, b"\n"
        while True:
            data = stream.read(BLOCK)
            if not data:
                break
            stats.bytes_read += len(data)
            count += data.count(b"\n")
            last_byte = data[-1:]
            tail = (tail + data)[-4096:]
            for p in list(feeding):
                try:
                    p.stdin.write(data)  # type: ignore[union-attr]
                except BrokenPipeError:  # grep -m 1 has its line and has gone
                    feeding.remove(p)
        for p in procs:
            try:
                p.stdin.close()  # type: ignore[union-attr]
            except BrokenPipeError:
                pass
        for p in procs:
            if p.wait() > 1:
                raise BadInputError(f"{path}: cannot be read (grep exited with {p.returncode}); check the file")
        stats.lines = count + (0 if last_byte == b"\n" else 1)
        stats.last_line = tail.rstrip(b"\n").rsplit(b"\n", 1)[-1].decode("utf-8", errors="replace")

        def numbered(out: BinaryIO) -> Iterator[tuple[int, bytes]]:
            out.seek(0)
            for raw in out:
                m = _STREAM_PREFIX.match(raw)
                if m is not None:
                    yield int(m[1]), raw[m.end():]

        last = 0
        for number, raw in heapq.merge(*(numbered(o) for o in outputs), key=lambda item: item[0]):
            if number == last:
                continue
            last = number
            stats.selected += 1
            yield number, raw[:MAX_LINE].decode("utf-8", errors="replace")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out in outputs:
            out.close()


@functools.lru_cache(maxsize=1)
def _gnu_grep() -> str | None:
    grep = shutil.which("grep")
    if grep is None:
        return None
    try:
        version = subprocess.run([grep, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return grep if "GNU grep" in version else None


def _python_selected(stream: LogStream | Prefixed, stats: ReadStats) -> Iterator[tuple[int, str]]:
    keywords = LINE_KEYWORDS + tuple(k.encode() for k in infra_keywords())
    first_only = list(FIRST_ONLY_KEYWORDS)
    window_left = 0
    carry = b""  # a line begun in the block before: at most MAX_LINE bytes (the opener cut it)
    while True:
        data = stream.read(BLOCK)
        stats.bytes_read += len(data)
        block = carry + data
        if data:
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                carry = block
                continue
            body, carry = block[:cut], block[cut:]
        else:
            body, carry = block, b""
        if body:
            window_left = yield from _select(body, stats, keywords, first_only, window_left)
        if not data:
            break


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

