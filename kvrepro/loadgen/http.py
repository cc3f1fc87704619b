"""A small HTTP/1.1 client for the load generator: keep-alive connections on one asyncio loop.

Why our own: the load generator's job is to keep an engine busy from one core while it also
writes a trace line and a result line per request. A thread per concurrency slot with
``requests`` spent most of a core on thread switches and library layers (~700 req/s against a
null server); an asyncio ``Protocol`` that writes one pre-built request and parses only what
the runner needs (status, body) does several times that. It speaks exactly what an
OpenAI-compatible server answers: ``Content-Length`` bodies, ``chunked`` bodies (streamed
server-sent events) and bodies that end with the connection (HTTP/1.0 servers,
``Connection: close``).

One :class:`Connection` carries one request at a time (closed loop per slot, as before). A
connection the server closed, or one idle long enough that the server may close it under our
feet (uvicorn, which vLLM runs, drops idle keep-alive connections after 5 s), is replaced
before a request goes out, never retried after: a request is sent at most once, so the engine
sees exactly the requests in the trace.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

IDLE_REOPEN_S = 2.0  # reopen a keep-alive connection idle longer than this (server timeout: 5 s)
_MAX_HEAD = 64 * 1024


class HttpError(Exception):
    """The exchange failed before a whole response arrived (refused, reset, closed early, bad
    response). ``connect`` tells whether it failed while connecting."""

    def __init__(self, message: str, *, connect: bool = False):
        super().__init__(message)
        self.connect = connect


class HttpTimeout(HttpError):
    """No byte of the response for ``timeout`` seconds (an inactivity timeout, as ``requests``
    has: a long stream that keeps sending is not cut)."""


@dataclass
class Response:
    status: int
    body: bytes


def parse_url(base_url: str) -> tuple[str, int, str]:
    """``http://host:port[/prefix]`` -> (host, port, path prefix). Only plain HTTP: engines are
    reached on a loopback port or through an SSH tunnel, never over TLS."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the load generator speaks plain http:// only, not {base_url!r}")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


def build_request(method: str, host: str, port: int, path: str, body: bytes | None = None,
                  content_type: bytes = b"application/json") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: */*\r\n".encode()
    if body is None:
        return head + b"\r\n"
    return (head + b"Content-Type: " + content_type + b"\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


class _Protocol(asyncio.Protocol):
    """Parses one response at a time into ``waiter``; the states are head, body, done."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[Response] | None = None
        self.closed = False
        self.last_data = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.in_head = True
        self.length = -1  # -1: until the connection ends; -2: chunked
        self.body = bytearray()
        self.chunk_left = 0  # chunked: data bytes of the current chunk still to come
        self.crlf_left = 0  # chunked: bytes of the CRLF after a chunk's data still to come
        self.keep_alive = True

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.last_data = time.monotonic()
        if self.waiter is None or self.waiter.done():
            self.closed = True  # nothing asked: stray bytes after a response; not reused
            return
        self.buf += data
        try:
            self._parse()
        except HttpError as exc:
            self._fail(exc)
        except ValueError as exc:  # a length that is not a number
            self._fail(HttpError(f"bad response: {exc}"))

    def eof_received(self) -> bool:
        self._finish_at_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is not None:
            self._fail(HttpError(f"{type(exc).__name__}: {exc}"))
        else:
            self._finish_at_eof()

    # -- parsing

    def _finish_at_eof(self) -> None:
        self.closed = True
        if self.waiter is None or self.waiter.done():
            return
        if not self.in_head and self.length == -1:
            self._done()
        else:
            self._fail(HttpError("ConnectionResetError: the server closed the connection before a whole response"))

    def _parse(self) -> None:
        if self.in_head:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > _MAX_HEAD:
                    raise HttpError("response head too long")
                return
            self._head(bytes(self.buf[:end]))
            del self.buf[:end + 4]
        if self.length >= 0:
            if len(self.buf) >= self.length:
                self.body = self.buf[:self.length]
                del self.buf[:self.length]
                self._done()
        elif self.length == -2:
            self._chunks()
        else:
            self.body += self.buf
            self.buf.clear()

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise HttpError(f"not an HTTP response: {lines[0][:80]!r}")
        try:
            self.status = int(parts[1])
        except ValueError:
            raise HttpError(f"bad status line: {lines[0][:80]!r}") from None
        self.keep_alive = parts[0] == b"HTTP/1.1"
        self.in_head = False
        self.length = -1
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                self.length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                self.length = -2
            elif name == b"connection":
                value = value.strip().lower()
                self.keep_alive = value == b"keep-alive" or (self.keep_alive and value != b"close")
        if self.status in (204, 304) or 100 <= self.status < 200:
            self.length = 0
        if self.length == -1:
            self.keep_alive = False

    def _chunks(self) -> None:
        buf = self.buf
        while True:
            if self.chunk_left:
                take = min(self.chunk_left, len(buf))
                self.body += buf[:take]
                del buf[:take]
                self.chunk_left -= take
                if self.chunk_left:
                    return
                self.crlf_left = 2
            if self.crlf_left:
                take = min(self.crlf_left, len(buf))
                del buf[:take]
                self.crlf_left -= take
                if self.crlf_left:
                    return
            line_end = buf.find(b"\r\n")
            if line_end < 0:
                return
            try:
                size = int(bytes(buf[:line_end]).split(b";")[0].strip(), 16)
            except ValueError:
                raise HttpError(f"bad chunk size line: {bytes(buf[:line_end])[:40]!r}") from None
            if size == 0:  # the last chunk: then trailers (if any) and an empty line
                rest = buf[line_end + 2:]
                if not (rest.startswith(b"\r\n") or b"\r\n\r\n" in rest):
                    return
                buf.clear()
                return self._done()
            del buf[:line_end + 2]
            self.chunk_left = size

    def _done(self) -> None:
        waiter, response = self.waiter, Response(self.status, bytes(self.body))
        keep = self.keep_alive and not self.buf  # bytes past the response: the stream is out of step
        self.buf.clear()
        self._reset()
        self.waiter = None
        if not keep:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _fail(self, exc: HttpError) -> None:
        self.closed = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class Connection:
    """One keep-alive connection to ``host:port``, opened on first use and reopened when the
    server closed it or it sat idle (see the module docstring). One request at a time."""

    def __init__(self, host: str, port: int, connect_timeout: float):
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.proto: _Protocol | None = None
        self.idle_since = 0.0
        self._timer: asyncio.TimerHandle | None = None

    async def _open(self) -> _Protocol:
        self.close()
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(loop.create_connection(_Protocol, self.host, self.port),
                                              self.connect_timeout)
        except asyncio.TimeoutError:
            raise HttpTimeout(f"ConnectTimeout: no connection to {self.host}:{self.port} within "
                              f"{self.connect_timeout}s", connect=True) from None
        except OSError as exc:
            raise HttpError(f"{type(exc).__name__}: {exc}", connect=True) from None
        self.proto = proto
        return proto

    async def request(self, data: bytes, timeout: float) -> Response:
        """Send ``data`` (a whole request, see :func:`build_request`) and return the response.

        Raises :class:`HttpTimeout` when no byte arrived for ``timeout`` seconds and
        :class:`HttpError` when the exchange failed; the connection is then closed.
        """
        loop = asyncio.get_running_loop()
        proto = self.proto
        if proto is None or proto.closed or loop.time() - self.idle_since > IDLE_REOPEN_S:
            proto = await self._open()
        waiter: asyncio.Future[Response] = loop.create_future()
        proto.waiter = waiter
        proto.last_data = time.monotonic()
        transport = proto.transport
        if transport is None or transport.is_closing():  # the server closed it as it opened
            self.close()
            raise HttpError("ConnectionResetError: the server closed the connection before the request went out")
        transport.write(data)
        self._timer = loop.call_later(timeout, self._check_idle, proto, waiter, timeout)
        try:
            return await waiter
        finally:
            self._timer.cancel()
            if not waiter.done():  # cancelled mid-request: the connection's state is unknown
                self.close()
            self.idle_since = loop.time()

    def _check_idle(self, proto: _Protocol, waiter: asyncio.Future[Response], timeout: float) -> None:
        if waiter.done():
            return
        quiet = time.monotonic() - proto.last_data
        if quiet >= timeout:
            proto._fail(HttpTimeout(f"ReadTimeout: no answer for {timeout}s"))
        else:
            self._timer = asyncio.get_running_loop().call_later(timeout - quiet, self._check_idle, proto,
                                                                waiter, timeout)

    def close(self) -> None:
        if self.proto is not None:
            self.proto.closed = True
            if self.proto.transport is not None:
                self.proto.transport.close()
            self.proto = None


async def fetch(host: str, port: int, data: bytes, timeout: float) -> Response:
    """One request on a connection of its own (a health check, a model list)."""
    conn = Connection(host, port, timeout)
    try:
        return await conn.request(data, timeout)
    finally:
        conn.close()
