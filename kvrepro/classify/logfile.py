"""Opening a log kvrepro reads (`classify`, `triage`): whatever the user attached, as UTF-8 text
of bounded lines, or one clear refusal. One place for both commands.

People attach ``engine.log.gz`` or a ``.bz2``/``.xz``/``.zst`` an incident tool made; a log saved
by a Windows tool is UTF-16; a wrong path may be a binary, a FIFO or ``/dev/zero``; a log pasted
into a pipe has no seek; a hostile one holds a 3 GB "line". Now:

* the path: a regular file is opened through kvrepro/untrusted.py (never blocks; a character
  device, a socket or a folder is refused; the path the user named may be a link, it is
  followed). A named FIFO is refused at once (opening it waits for a writer: a hang), but a pipe
  kvrepro inherited is read: ``-``, ``/dev/stdin``, ``/dev/fd/N`` (``<(zcat x)``);
* compression, by magic bytes whatever the name: gzip, bzip2 and xz with the standard library's
  incremental decompressors, zstd through the ``zstd`` program when it is installed (there is no
  zstd in Python 3.11's standard library; a regular file only), each at most 1 MiB of output
  per step (a bomb is read as a stream, never inflated whole). zip, 7z and lz4 are named and
  refused. A damaged or cut-off stream says where: the compressed byte, and how much of the log
  (bytes, lines) came before;
* the text: UTF-16 and UTF-32 (by BOM, or by where the NUL bytes fall) are transcoded to UTF-8;
  ``require_text``: otherwise the first 64 KiB (decompressed) must hold no NUL byte and at most
  1 % of bytes that are not UTF-8 (:class:`NotTextLog`); a log whose only line ends are ``\\r``
  (classic Mac, a tool that rewrites one line) is read with ``\\r`` as the line end;
* every line is cut to :data:`kvrepro.untrusted.LINE_LIMIT` bytes (``untrusted.LineCutter``: line
  numbers kept; :meth:`LogInfo.notices` says which were cut), so memory stays flat whatever the
  input: benchmarks/hostile_logs.py measures it.
"""

from __future__ import annotations

import bz2
import codecs
import io
import lzma
import os
import re
import shutil
import stat
import subprocess
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .. import untrusted
from ..errors import BadInputError
from ..untrusted import LINE_LIMIT, LineCutter, quote

SNIFF_BYTES = 64 * 1024
READ_BYTES = 1 << 20  # raw bytes per read, and decompressed bytes per step at most
GZIP_MAGIC = b"\x1f\x8b"
# what reading a damaged stream raises, kept for callers that still catch them
GZIP_ERRORS = (EOFError, zlib.error, OSError)
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
          (b"PK\x03\x04", "zip"), (b"7z\xbc\xaf\x27\x1c", "7z"), (b"\x04\x22\x4d\x18", "lz4"))
_TOOL = {"gzip": "zcat", "bzip2": "bzcat", "xz": "xzcat", "zstd": "zstdcat"}
_INHERITED = re.compile(r"^(-|/dev/stdin|/dev/fd/\d+|/proc/(self|\d+)/fd/\d+)$")


class NotTextLog(BadInputError):
    """The file is not a log kvrepro can read (exit 2)."""


@dataclass
class LogInfo:
    """How the log was read: what a command may say about it (``notices``)."""

    path: str
    compression: str | None = None
    encoding: str = "utf-8"
    line_end: str = "\n"
    raw_bytes: int = 0  # bytes read from the file (compressed, when it is)
    size: int | None = None  # the file's size, when it is a regular file
    text_bytes: int = 0  # bytes of log text (decompressed, UTF-8) passed on
    out_bytes: int = 0  # bytes the decompressor gave so far, and the newlines in them (where damage is)
    out_lines: int = 0
    cutter: LineCutter = field(default_factory=LineCutter)

    def notices(self) -> list[str]:
        said = []
        if self.encoding != "utf-8":
            said.append(f"{quote(self.path, 200)}: {self.encoding.upper()} text, read as such")
        if self.line_end == "\r":
            said.append(f"{quote(self.path, 200)}: its lines end in \\r only (no \\n), read as lines")
        return said + self.cutter.notices(self.path)


def _why_not_text(head: bytes) -> str | None:
    if b"\x00" in head:
        return "binary data (NUL bytes)"
    bad = len(head) - len(head.decode("utf-8", errors="ignore").encode("utf-8"))
    if head and bad > len(head) // 100 + 4:
        return f"binary data ({bad:,} of the first {len(head):,} bytes are not UTF-8)"
    return None


def _wide_encoding(head: bytes) -> str | None:
    """UTF-16/32 by where NUL bytes fall in the first 400 bytes (a log is mostly ASCII: in UTF-16-LE
    every odd byte is NUL), not by a BOM alone (a UTF-8 log may begin with the bytes ff fe, noise
    before its first line)."""
    sample = head[:400]
    if len(sample) < 8 or sample.count(0) < len(sample) // 4:
        return None
    quads = [sample[i::4].count(0) / max(1, len(sample[i::4])) for i in range(4)]
    if quads[1] > 0.9 and quads[2] > 0.9 and quads[3] > 0.9 and quads[0] < 0.5:
        return "utf-32-le"
    if quads[0] > 0.9 and quads[1] > 0.9 and quads[2] > 0.9 and quads[3] < 0.5:
        return "utf-32-be"
    even, odd = sample[0::2].count(0) / (len(sample) / 2), sample[1::2].count(0) / (len(sample) / 2)
    if odd > 0.7 and even < 0.2:
        return "utf-16-le"
    if even > 0.7 and odd < 0.2:
        return "utf-16-be"
    return None


def _open_source(path: str | Path) -> tuple[int, int | None]:
    """(descriptor, size when a regular file) of what the user named; see the module docstring."""
    shown = quote(path, 200)
    text = str(path)
    if text == "-":
        fd = os.dup(0)
        mode = os.fstat(fd)
        return fd, mode.st_size if stat.S_ISREG(mode.st_mode) else None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BadInputError(f"{shown}: no such file; give the log file (plain or compressed), or - to read a "
                            "pipe") from None
    except OSError as exc:
        raise BadInputError(f"{shown}: {exc.strerror or exc}; give the log file") from None
    if stat.S_ISDIR(st.st_mode):
        raise BadInputError(f"{shown}: is a folder; give the log file in it (plain or compressed)")
    if stat.S_ISFIFO(st.st_mode):
        if not _INHERITED.match(text):
            raise BadInputError(f"{shown}: a FIFO (named pipe); kvrepro does not wait on one (it blocks until "
                                f"something writes): give a file, or pipe it in: `cat {shown} | kvrepro ... -`")
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC), None
    try:
        fd = untrusted.open_regular(path, follow=True)
    except OSError as exc:
        raise BadInputError(f"{shown}: {exc.strerror or exc}; give a log file (plain or compressed)") from None
    return fd, os.fstat(fd).st_size


def _read_head(fd: int) -> bytes:
    chunks, got = [], 0
    while got < SNIFF_BYTES:
        data = os.read(fd, SNIFF_BYTES - got)
        if not data:
            break
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


class _Damaged(Exception):
    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


def _raw_blocks(fd: int, head: bytes, info: LogInfo, size: int = READ_BYTES) -> Iterator[bytes]:
    if head:
        info.raw_bytes += len(head)
        yield head
    while data := os.read(fd, size):
        info.raw_bytes += len(data)
        yield data


def _decompressor(kind: str) -> Any:
    if kind == "gzip":
        return zlib.decompressobj(wbits=31)
    return bz2.BZ2Decompressor() if kind == "bzip2" else lzma.LZMADecompressor()


def _decompressed(kind: str, raw: Iterator[bytes]) -> Iterator[bytes]:
    """gzip/bzip2/xz, every member or stream of a multi-member file, READ_BYTES out at most per step."""
    d = _decompressor(kind)
    for data in raw:
        while data:
            try:
                if kind == "gzip":
                    out = d.decompress(data, READ_BYTES)
                    data = d.unconsumed_tail
                else:
                    out = d.decompress(data, READ_BYTES)
                    data = b""
                    while not d.eof and not d.needs_input:
                        if out:
                            yield out
                        out = d.decompress(b"", READ_BYTES)
            except (zlib.error, OSError, EOFError, lzma.LZMAError, ValueError) as exc:
                raise _Damaged(f"not valid {kind} data ({exc})") from None
            if out:
                yield out
            if d.eof:
                rest = (d.unused_data or b"") + data
                if not rest.strip(b"\x00"):
                    data = b""  # padding after the last member
                    continue
                if not rest.startswith(_MAGIC_OF[kind]):
                    raise _Damaged(f"bytes after the end of the {kind} data are not another {kind} stream")
                d, data = _decompressor(kind), rest
    if not d.eof:
        raise _Damaged(f"the file ends inside the {kind} data (cut off while copied?)")


_MAGIC_OF = {kind: magic for magic, kind in _MAGIC}


def _zstd_blocks(path: str | Path, fd: int, size: int | None, info: LogInfo) -> Iterator[bytes]:
    program = shutil.which("zstd")
    if program is None or size is None:
        why = "the zstd program is not installed" if program is None else "read from a pipe"
        raise NotTextLog(f"{quote(path, 200)}: zstd-compressed ({why}); decompress it first: "
                         f"`zstd -dc {quote(path, 200)} > log.txt`")
    proc = subprocess.Popen([program, "-dcq"], stdin=fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        while data := proc.stdout.read(READ_BYTES):
            yield data
        problem = proc.stderr.read(400).decode("utf-8", errors="replace").strip() if proc.stderr else ""
        if proc.wait() != 0:
            info.raw_bytes = os.lseek(fd, 0, os.SEEK_CUR)
            said = problem.splitlines()[-1] if problem else f"exit {proc.returncode}"
            raise _Damaged(f"zstd said: {quote(said)}")
        info.raw_bytes = size
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def _text_blocks(path: str | Path, fd: int, size: int | None, info: LogInfo, require_text: bool) -> Iterator[bytes]:
    """The log's text as UTF-8 byte blocks, lines cut: see the module docstring."""
    head = _read_head(fd)
    kind = next((name for magic, name in _MAGIC if head.startswith(magic)), None)
    shown = quote(path, 200)
    if kind in ("zip", "7z", "lz4"):
        raise NotTextLog(f"{shown}: a {kind} archive, not a log; unpack it and give the log inside")
    info.compression = kind
    if kind == "zstd":
        os.lseek(fd, 0, os.SEEK_SET)
        blocks = _zstd_blocks(path, fd, size, info)
    elif kind is not None:
        # compressed bytes in small reads: a damaged stream is then placed within 64 KiB
        blocks = _decompressed(kind, _raw_blocks(fd, head, info, SNIFF_BYTES))
    else:
        blocks = _raw_blocks(fd, head, info)
    blocks = _counted(blocks, info)
    try:
        first: list[bytes] = []
        got = 0
        for block in blocks:  # the first 64 KiB of text, to tell its encoding and line ends
            first.append(block)
            got += len(block)
            if got >= SNIFF_BYTES:
                break
        sample = b"".join(first)[:SNIFF_BYTES]
        wide = _wide_encoding(sample)
        decoder = None
        if wide is not None:
            info.encoding = wide
            decoder = codecs.getincrementaldecoder(wide)(errors="replace")
            sample = decoder.decode(sample, final=False).encode("utf-8")  # a fresh decoder decodes the blocks
            decoder = codecs.getincrementaldecoder(wide)(errors="replace")
        if require_text and (why := _why_not_text(sample)) is not None:
            raise NotTextLog(f"{shown}: not a text log ({why}); give the log as text (UTF-8 or UTF-16), plain "
                             "or compressed (gzip, bzip2, xz, zstd)")
        if b"\n" not in sample and b"\r" in sample:
            info.line_end = "\r"

        def all_blocks() -> Iterator[bytes]:
            yield from first
            yield from blocks

        for block in all_blocks():
            if decoder is not None:
                text = decoder.decode(block)
                block = (text[1:] if info.text_bytes == 0 and text.startswith("\ufeff") else text).encode("utf-8")
            if info.line_end == "\r":
                block = block.replace(b"\r", b"\n")
            out = info.cutter.feed(block)
            info.text_bytes += len(block)
            if out:
                yield out
        info.cutter.close()
    except _Damaged as exc:
        of = f" of {size:,}" if size is not None else ""
        tool = _TOOL.get(kind or "", "cat")
        raise NotTextLog(f"{shown}: damaged {kind} data at byte {info.raw_bytes:,}{of} (after {info.out_bytes:,} "
                         f"bytes of log, {info.out_lines:,} lines): {exc.detail}; give the whole file, or decompress "
                         f"what is left of it (`{tool} LOG > part.log`) and give that") from None


def _counted(blocks: Iterator[bytes], info: LogInfo) -> Iterator[bytes]:
    for block in blocks:
        info.out_bytes += len(block)
        info.out_lines += block.count(b"\n")
        yield block


class LogStream(io.RawIOBase):
    """The blocks of :func:`_text_blocks` as a readable binary stream (``read(n)`` may return less)."""

    def __init__(self, blocks: Iterator[bytes]):
        self._blocks = blocks
        self._pending = b""

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        while not self._pending:
            block = next(self._blocks, None)
            if block is None:
                return b""
            self._pending = block
        if size is None or size < 0 or size >= len(self._pending):
            out, self._pending = self._pending, b""
        else:
            out, self._pending = self._pending[:size], self._pending[size:]
        return out

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


@contextmanager
def open_log_bytes(path: str | Path, require_text: bool = True) -> Iterator[tuple[LogStream, LogInfo]]:
    """The log as a binary stream of UTF-8 text with bounded lines, and how it was read.

    BadInputError (exit 2) for a path that is not a log (a folder, a FIFO, a device, missing) and
    :class:`NotTextLog` for content that is not one (when ``require_text``; raised when met, so a
    damaged stream may raise while read)."""
    fd, size = _open_source(path)
    info = LogInfo(path=str(path), size=size)
    blocks = _text_blocks(path, fd, size, info, require_text)
    try:
        yield LogStream(blocks), info
    finally:
        blocks.close()  # a reader that stopped early: the zstd process (if any) goes now, not at GC
        os.close(fd)


@contextmanager
def open_log(path: str | Path, require_text: bool = False,
             notices: list[str] | None = None) -> Iterator[IO[str]]:
    """The log as a text stream (UTF-8, bad bytes replaced, ``\\n`` lines of at most LINE_LIMIT
    bytes); see the module docstring. ``notices``: what was noticed (lines cut, the encoding) is
    appended there once the stream has been read."""
    with open_log_bytes(path, require_text) as (stream, info):
        text = io.TextIOWrapper(io.BufferedReader(stream, buffer_size=SNIFF_BYTES), encoding="utf-8",
                                errors="replace", newline="\n")
        try:
            yield text
        finally:
            if notices is not None:
                notices.extend(info.notices())
            text.detach()


__all__ = ["GZIP_ERRORS", "LINE_LIMIT", "LogInfo", "NotTextLog", "open_log", "open_log_bytes"]
