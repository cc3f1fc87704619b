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

Writing into a folder the user named (``kvrepro init DIR``, ``triage --emit DIR``) goes through
:class:`WriteFolder`: a folder that may already hold links left by anyone (``DIR/builds/x.patch``
-> ``/etc/cron.d/x``, dangling or not; ``DIR`` itself a link to ``/etc``). It opens ``DIR`` once
(``O_NOFOLLOW``: a link there is refused), then makes and opens every sub-folder relative to
that descriptor (``dir_fd``, ``O_NOFOLLOW``), and creates each file with ``O_CREAT | O_EXCL |
O_NOFOLLOW`` (anything already at the name, a dangling link included, is "already there"), or,
when replacing is asked for, writes a new file beside it and renames it over the name (a
rename replaces a link itself, never what it points at). Nothing is ever written outside ``DIR``.

:func:`quote` is what a message says of an input's value: one line, at most ~80 characters,
control and line-break characters escaped (a log line may hold anything, a 200 MB "version").

Used by ``kvrepro clean`` (owner records in the temp folder, kvrepro/scratch.py), the defect
catalogue (kvrepro/suite/catalogue.py), ``classify`` (kvrepro/classify/logfile.py) and
``results`` (kvrepro/results/store.py: every JSON record it reads back).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from .errors import BadInputError, InfraError


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


# -- lines of bounded length ----------------------------------------------------------------------

# no line vLLM or kvrepro's engine writes comes near this (the longest, the non-default args and
# the engine's config line, are a few KB); a longer "line" is a binary blob, a base64 payload or a
# hostile file, and reading it whole made `classify` of a 13 MB gzip holding one 3 GB line reach
# 17.6 GB RSS (issue 44). docs/reliability.md states the bound; benchmarks/hostile_logs.py measures it.
LINE_LIMIT = 1 << 20


class LineCutter:
    """Cuts every line of a byte stream to at most ``limit`` bytes (its newline kept), block by
    block, in O(1) Python steps per ``limit`` bytes (it jumps from newline to newline with
    ``rfind`` over windows of ``limit`` bytes, so a log of short lines costs a few calls per MB).

    Line numbers are kept (no newline is added or removed). The first cut lines are remembered as
    (line number, bytes the whole line had) in :attr:`cuts`; :attr:`cut_count` counts them all."""

    KEEP = 3

    def __init__(self, limit: int = LINE_LIMIT):
        self.limit = limit
        self.run = 0  # bytes of the current line passed on so far
        self.cutting = False  # dropping the rest of the current line
        self.newlines = 0  # newlines in the blocks fed before this one
        self.cuts: list[tuple[int, int]] = []
        self.cut_count = 0
        self._cut_line = 0
        self._cut_bytes = 0

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        pos, size = 0, len(data)
        while pos < size:
            if self.cutting:
                j = data.find(b"\n", pos)
                if j < 0:
                    self._cut_bytes += size - pos
                    break
                self._cut_bytes += j - pos
                self._end_cut()
                pos = j  # the newline is passed on below, as a line of its own end
                self.run = 0
                continue
            room = self.limit - self.run
            end = min(size, pos + room + 1)
            k = data.rfind(b"\n", pos, end)
            if k >= 0:
                out.append(data[pos:k + 1])
                self.run = 0
                pos = k + 1
            elif pos + room >= size:
                out.append(data[pos:])
                self.run += size - pos
                pos = size
            else:
                out.append(data[pos:pos + room])
                self.cutting = True
                self._cut_line = self.newlines + data.count(b"\n", 0, pos) + 1
                self._cut_bytes = self.limit
                pos += room
        self.newlines += data.count(b"\n")
        return b"".join(out) if len(out) != 1 else out[0]

    def _end_cut(self) -> None:
        self.cutting = False
        self.cut_count += 1
        if len(self.cuts) < self.KEEP:
            self.cuts.append((self._cut_line, self._cut_bytes))

    def close(self) -> None:
        """The stream ended: a line being cut (no newline after it) is counted."""
        if self.cutting:
            self._end_cut()

    def notices(self, path: object) -> list[str]:
        """One line per remembered cut (and one for the rest): what a command says on stderr."""
        lines = [f"{quote(path, 200)}:{line}: a line of {length:,} bytes, cut to its first {self.limit:,} (no "
                 "vLLM log line is that long; docs/reliability.md)" for line, length in self.cuts]
        if self.cut_count > len(self.cuts):
            lines.append(f"{quote(path, 200)}: {self.cut_count - len(self.cuts):,} more line(s) over {self.limit:,} "
                         "bytes cut the same way")
        return lines


# -- quoting an input in a message ----------------------------------------------------------------

QUOTE_CHARS = 80
_LINE_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """``value`` as a message may show it: one line (every control, line-break or invisible
    character escaped as ``\\n``, ``\\x1b``, ``\\u2028``) of at most ``limit`` characters of the
    input, then ``...`` and how long it was. Never fails: an int too long for ``str`` (Python's
    4,300-digit limit) is said by its number of digits."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"a number of about {int(value.bit_length() * 0.30103):,} digits"
    text = value if isinstance(value, str) else str(value)
    shown = text[:limit]
    escaped = "".join(c if c.isprintable() and c not in _LINE_BREAKS else c.encode("unicode_escape").decode("ascii")
                      for c in shown)
    return escaped + (f"... ({len(text):,} characters)" if len(text) > limit else "")


def one_line(text: str) -> str:
    """``text`` with every line-break and control character escaped (no length bound): what may be
    written on one line of a generated file's comment."""
    return "".join(c if c.isprintable() and c not in _LINE_BREAKS else c.encode("unicode_escape").decode("ascii")
                   for c in text)


# -- writing inside a folder, never through a link --------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkInTheWay(BadInputError):
    """A symbolic link where kvrepro would write (exit 2): it is never written through."""


@contextmanager
def writing(what: str, exists: str, prefix: str = "") -> Iterator[None]:
    """One line, and the exit code, for what writing into a user's folder meets: a link in the way
    (2, ``prefix`` before it: ``--emit``), a file where one is to be made (2, ``exists``: what to do),
    a file where a folder is needed (2), a disk or permission problem (3, naming ``what``)."""
    try:
        yield
    except LinkInTheWay as exc:
        raise LinkInTheWay(f"{prefix}{exc}") from None
    except FileExistsError as exc:
        raise BadInputError(f"{quote(exc.filename or what, 200)}: already exists; {exists}") from None
    except NotADirectoryError as exc:
        raise BadInputError(f"{quote(exc.filename or what, 200)}: a file stands where a folder is needed; move it, "
                            "or choose another folder") from None
    except OSError as exc:
        raise InfraError(f"{what}: cannot write {quote(exc.filename or '', 200)}: {exc.strerror or exc}; give "
                         f"{prefix}a folder you can write (e.g. under your home or the project)") from None


class WriteFolder:
    """A folder the user named, written only inside (see the module docstring). Use as a context
    manager; :meth:`write` creates files (and their sub-folders) relative to it."""

    def __init__(self, folder: Path, create: bool = True):
        self.folder = Path(folder)
        absolute = os.path.abspath(self.folder)
        parent, name = os.path.split(absolute)
        if create and not os.path.lexists(absolute):
            os.makedirs(parent, exist_ok=True)  # the folders above are the user's own choice
            try:
                os.mkdir(absolute)
            except FileExistsError:
                pass
        if os.path.islink(absolute):
            target = os.readlink(absolute)
            raise LinkInTheWay(f"{quote(self.folder, 200)}: a symbolic link (to {quote(target, 200)}); kvrepro "
                               "writes only into a real folder, never through a link: give the folder itself")
        parent_fd = os.open(parent or "/", _DIR_FLAGS & ~os.O_NOFOLLOW)
        try:
            self.fd = self._open_dir(name or ".", parent_fd, self.folder)
        finally:
            os.close(parent_fd)

    @staticmethod
    def _open_dir(name: str, dir_fd: int, shown: Path) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                try:
                    is_link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
                except OSError:
                    is_link = False
                if is_link:
                    raise LinkInTheWay(f"{quote(shown, 200)}: a symbolic link; kvrepro writes only inside the "
                                       "folder, never through a link: remove it or choose another folder") from None
                raise NotADirectoryError(errno.ENOTDIR, "a file stands where a folder is needed", str(shown)) from None
            raise type(exc)(exc.errno, exc.strerror, str(shown)) from None

    def __enter__(self) -> "WriteFolder":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _parent_fd(self, parts: tuple[str, ...], create: bool) -> int:
        """A descriptor of the sub-folder ``parts`` (made when ``create``); the caller closes it."""
        fd = os.dup(self.fd)
        shown = self.folder
        try:
            for part in parts:
                if part in ("", ".", "..") or "/" in part:
                    raise BadInputError(f"{quote(shown / part, 200)}: not a plain name inside {self.folder}")
                shown = shown / part
                if create:
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass
                    except OSError as exc:
                        raise type(exc)(exc.errno, exc.strerror, str(shown)) from None
                sub = self._open_dir(part, fd, shown)
                os.close(fd)
                fd = sub
            return fd
        except BaseException:
            os.close(fd)
            raise

    def exists(self, relative: str | Path) -> bool:
        """Anything at ``relative`` (a dangling link too); links on the way are not followed."""
        parts = Path(relative).parts
        try:
            fd = self._parent_fd(parts[:-1], create=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)

    def write(self, relative: str | Path, data: bytes | str, replace: bool = False) -> Path:
        """Create ``folder/relative`` holding ``data``. Anything already at that name is
        FileExistsError, unless ``replace``: then the new file is renamed over it (a link there is
        replaced, not followed). A write that fails (a full disk) leaves no partial file."""
        if isinstance(data, str):
            data = data.encode()
        parts = Path(relative).parts
        shown = self.folder.joinpath(*parts)
        fd = self._parent_fd(parts[:-1], create=True)
        try:
            name = parts[-1]
            temp = f".{name}.{secrets.token_hex(4)}.tmp" if replace else name
            try:
                out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                              dir_fd=fd)
            except OSError as exc:
                raise type(exc)(exc.errno, exc.strerror if exc.errno != errno.EEXIST else "already exists",
                                str(shown)) from None
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view):]
                os.close(out)
                out = -1
                if replace:
                    os.rename(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException as exc:
                if out >= 0:
                    os.close(out)
                try:
                    os.unlink(temp, dir_fd=fd)
                except OSError:
                    pass
                if isinstance(exc, OSError):
                    raise type(exc)(exc.errno, exc.strerror, str(shown)) from None
                raise
        finally:
            os.close(fd)
        return shown


__all__ = ["LINE_LIMIT", "LineCutter", "LinkInTheWay", "UnreadableFile", "WriteFolder", "one_line", "open_regular",
           "quote", "read_bytes", "read_text", "writing"]
