"""Reading files kvrepro did not write itself, or that anyone could have replaced: one bounded,
non-blocking, non-following reader.

The temp folder is world-writable, catalogue entries and run folders are copied around and
hand-edited, and a log to classify is whatever the user attached. A path there may be a FIFO
(``open`` blocks until a writer comes: forever), a link to ``/dev/zero`` (``stat`` says 0 bytes,
``read`` never ends: a MemoryError), a 1 GB file, or a link into someone else's files. So every
such read goes through :func:`open_regular`:

* ``open`` with ``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a writer) and
  ``O_NOFOLLOW`` (a symbolic link is refused, unless the caller was handed the path by the user
  and says ``follow=True``);
* ``fstat`` of the open descriptor (not of the path, which could change in between) must say a
  regular file;
* :func:`read_bytes` then reads at most ``limit`` bytes, counting the bytes actually read, not
  the size ``fstat`` reported (a file that grows while read, or a size a filesystem reports
  wrong, still stops at the bound).

Every refusal is an :class:`UnreadableFile` (an ``OSError``, so callers that report an unreadable
file already report these in the same one line).

Used by ``kvrepro clean`` (owner records in the temp folder, kvrepro/scratch.py), the defect
catalogue (kvrepro/suite/catalogue.py), ``classify`` (kvrepro/classify/logfile.py) and
``results`` (kvrepro/results/store.py: every JSON record it reads back).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class UnreadableFile(OSError):
    """A path kvrepro refuses to read: not a regular file, a link, or over the bound."""

    def __init__(self, path: str | Path, why: str, code: int = errno.EINVAL):
        super().__init__(code, why, str(path))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | Path, follow: bool = False) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (see the module docstring).

    Never blocks (a FIFO), never follows a symbolic link unless ``follow``. The descriptor is
    blocking again once checked, for the caller's reads."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise UnreadableFile(path, "a symbolic link; kvrepro does not follow links here (copy the file "
                                       "in its place)", errno.ELOOP) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnreadableFile(path, f"{_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str | Path, limit: int, follow: bool = False) -> bytes:
    """At most ``limit`` bytes of a regular file; :class:`UnreadableFile` if it holds more."""
    fd = open_regular(path, follow)
    try:
        size = os.fstat(fd).st_size
        if size > limit:  # a cheap early answer; the count below is what holds
            raise UnreadableFile(path, f"{size:,} bytes; at most {limit:,} are read here (is this the right file?)",
                                 errno.EFBIG)
        chunks: list[bytes] = []
        got = 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
            if got > limit:
                raise UnreadableFile(path, f"more than {limit:,} bytes; at most {limit:,} are read here "
                                           "(is this the right file?)", errno.EFBIG)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | Path, limit: int, follow: bool = False) -> str:
    """:func:`read_bytes` decoded as UTF-8 (UnicodeDecodeError, a ValueError, if it is not)."""
    return read_bytes(path, limit, follow).decode("utf-8")


__all__ = ["UnreadableFile", "open_regular", "read_bytes", "read_text"]
