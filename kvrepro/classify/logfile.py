"""Opening a log to classify: whatever the user attached, as text, or one clear refusal.

People attach ``engine.log.gz``; a log saved by a Windows tool is UTF-16; a wrong path may be a
binary, a FIFO or ``/dev/zero``. Before this module each of them was "none: no crash" (every
byte replaced, nothing matched) or hung. Now:

* the file is opened through kvrepro/untrusted.py (never blocks on a FIFO; a character device,
  a socket or a folder is refused; the path the user named may be a link, it is followed);
* gzip (by its magic bytes, whatever the name) is decompressed as it is read;
* ``require_text``: the first 64 KiB (decompressed) must look like a text log: no NUL byte (UTF-16
  and UTF-32 are full of them, random bytes hold one every 256) and at most 1 % of bytes that
  are not UTF-8 (a line cut mid-character is fine). Otherwise :class:`NotTextLog`.
"""

from __future__ import annotations

import gzip
import io
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .. import untrusted
from ..errors import BadInputError

SNIFF_BYTES = 64 * 1024
GZIP_MAGIC = b"\x1f\x8b"
# what reading a damaged gzip stream raises: a truncated file (EOFError), bad data (zlib.error, BadGzipFile)
GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


class NotTextLog(BadInputError):
    """The file is not an engine log kvrepro can read (exit 2)."""


def _why_not_text(head: bytes) -> str | None:
    # by its NULs, not its BOM: a UTF-8 log may begin with the bytes ff fe (noise before the first line)
    if head[:200].count(b"\x00") > len(head[:200]) // 4:
        return "UTF-16 or UTF-32 text"
    if b"\x00" in head:
        return "binary data (NUL bytes)"
    bad = len(head) - len(head.decode("utf-8", errors="ignore").encode("utf-8"))
    if head and bad > len(head) // 100 + 4:
        return f"binary data ({bad:,} of the first {len(head):,} bytes are not UTF-8)"
    return None


@contextmanager
def open_log(path: str | Path, require_text: bool = False) -> Iterator[IO[str]]:
    """The log as a text stream (UTF-8, bad bytes replaced, ``\\n`` lines); see the module docstring.

    OSError for a path that cannot be opened or is not a regular file; :class:`NotTextLog` when
    ``require_text`` and the content is not a text log (a damaged gzip stream included)."""
    fd = untrusted.open_regular(path, follow=True)
    file = os.fdopen(fd, "rb", buffering=0)
    gz: gzip.GzipFile | None = None
    try:
        if file.read(2) == GZIP_MAGIC:
            file.seek(0)
            gz = gzip.GzipFile(fileobj=file, mode="rb")
        else:
            file.seek(0)
        stream = io.BufferedReader(gz if gz is not None else file, buffer_size=SNIFF_BYTES)
        if require_text:
            try:
                head = stream.peek(SNIFF_BYTES)[:SNIFF_BYTES]
            except GZIP_ERRORS as exc:
                raise NotTextLog(f"{path}: not a text log (a damaged gzip file: {exc}); give the engine's log "
                                 "as text or .gz") from None
            why = _why_not_text(head)
            if why is not None:
                raise NotTextLog(f"{path}: not a text log ({why}); give the engine's log as UTF-8 text "
                                 "(or gzip of it), e.g. results/<run>/<build>/<rep>/engine.log") from None
        yield io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline="\n")
    finally:
        if gz is not None:
            gz.close()  # does not close the file it was given
        file.close()

__all__ = ["GZIP_ERRORS", "NotTextLog", "open_log"]
