"""The load generator's HTTP client, on aiohttp.

Why aiohttp: it is the client vLLM's own benchmark (``vllm bench serve``) drives engines with, and
a maintained HTTP stack is not ours to keep correct (TLS, proxies, chunked bodies, edge cases of
the protocol). kvrepro used a hand-written asyncio HTTP/1.1 client here before; it was 1.7-2.2x
faster than aiohttp against a null server, but an engine, on a GPU or not, serves a small fraction
of either rate: ``benchmarks/client_capacity.py`` measures this client against a null server side
by side with what the GPU-free engine serves (issue 17 asks for at least 10x).

What the load generator needs, and how it is kept on top of aiohttp:

* A request is sent at most once, so the engine sees exactly the requests in the trace. aiohttp
  retries a request that failed on a reused keep-alive connection only for idempotent methods
  (GET, PUT, ...; RFC 9112 section 9.3.1); a completion is a POST, never retried by it or by us.
* Keep-alive with reopening: as many pooled connections as concurrency slots (``connections``); a
  connection the server closed is not reused, nor one idle longer than :data:`IDLE_REOPEN_S`
  (uvicorn, which vLLM runs, drops idle keep-alive connections after 5 s, possibly under our feet
  as a request goes out); such a connection is replaced before the request is sent.
* ``timeout`` bounds connecting and each wait for the next bytes of an answer (an inactivity
  timeout, as ``requests`` has: a long stream that keeps sending is not cut).
* Every failure is an :class:`HttpError` (``connect`` tells whether it failed while connecting:
  the engine's port is closed, which the runner takes as death) or an :class:`HttpTimeout`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

IDLE_REOPEN_S = 2.0  # reopen a keep-alive connection idle longer than this (server timeout: 5 s)


class HttpError(Exception):
    """The exchange failed before a whole response arrived (refused, reset, closed early, bad
    response). ``connect`` tells whether it failed while connecting."""

    def __init__(self, message: str, *, connect: bool = False):
        super().__init__(message)
        self.connect = connect


class HttpTimeout(HttpError):
    """No connection, or no byte of the response, for ``timeout`` seconds."""


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


class Client:
    """Requests to one engine (``base_url``) over at most ``connections`` keep-alive connections.

    Open it on the event loop that uses it (``async with Client(...)`` or :meth:`open`); its
    requests carry ``headers`` (an API key) on top of their own.
    """

    def __init__(self, base_url: str, *, connections: int, timeout: float,
                 headers: dict[str, str] | None = None, keep_alive: bool = True):
        host, port, prefix = parse_url(base_url)
        self.base = f"http://{host}:{port}{prefix}"
        self.connections = max(1, connections)
        self.timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=timeout, sock_read=timeout)
        self.timeout_s = timeout
        self.headers = headers or {}
        self.keep_alive = keep_alive
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> Client:
        if self.keep_alive:
            connector = aiohttp.TCPConnector(limit=self.connections, keepalive_timeout=IDLE_REOPEN_S)
        else:
            connector = aiohttp.TCPConnector(limit=self.connections, force_close=True)
        # no cookies, no proxies from the environment (an engine is a loopback port or a tunnel)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self.timeout, headers=self.headers,
                                             cookie_jar=aiohttp.DummyCookieJar(), trust_env=False)
        return self

    async def __aenter__(self) -> Client:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection (requests still in flight on them are abandoned)."""
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: dict[str, str] | None = None) -> Response:
        """Send one request and read its whole answer (a streamed one to its end).

        Raises :class:`HttpTimeout` when connecting, or waiting for the next bytes of the answer,
        took ``timeout`` seconds, and :class:`HttpError` when the exchange failed otherwise.
        """
        assert self.session is not None, "Client.open() first"
        try:
            async with self.session.request(method, self.base + path, data=body, headers=headers,
                                            allow_redirects=False) as resp:
                return Response(resp.status, await resp.read())
        except aiohttp.ConnectionTimeoutError as exc:
            raise HttpTimeout(f"ConnectTimeout: no connection to {self.base} within {self.timeout_s}s",
                              connect=True) from exc
        except (aiohttp.ServerTimeoutError, asyncio.TimeoutError) as exc:
            raise HttpTimeout(f"ReadTimeout: no answer for {self.timeout_s}s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise HttpError(_describe(exc.os_error), connect=True) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise HttpError(_describe(exc)) from exc

    async def stream_until(self, path: str, body: bytes, headers: dict[str, str] | None,
                           events: int) -> tuple[int, Response | None]:
        """POST a streamed request and close its connection once ``events`` server-sent events with
        output (``choices``) arrived: (those events, None). A client that goes away mid-answer does
        just that, and vLLM's server aborts the request when its connection closes. (count, the whole
        answer) when the answer ended (or failed) first. Errors as :meth:`request`."""
        assert self.session is not None, "Client.open() first"
        seen = 0
        try:
            async with self.session.request("POST", self.base + path, data=body, headers=headers,
                                            allow_redirects=False) as resp:
                if resp.status != 200:
                    return seen, Response(resp.status, await resp.read())
                chunks: list[bytes] = []
                async for line in resp.content:
                    chunks.append(line)
                    if line.startswith(b"data:") and b'"choices":[{' in line.replace(b" ", b""):
                        seen += 1
                        if seen >= events:
                            resp.close()  # drops the connection: the server sees the client leave
                            return seen, None
                return seen, Response(resp.status, b"".join(chunks))
        except aiohttp.ConnectionTimeoutError as exc:
            raise HttpTimeout(f"ConnectTimeout: no connection to {self.base} within {self.timeout_s}s",
                              connect=True) from exc
        except (aiohttp.ServerTimeoutError, asyncio.TimeoutError) as exc:
            raise HttpTimeout(f"ReadTimeout: no answer for {self.timeout_s}s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise HttpError(_describe(exc.os_error), connect=True) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise HttpError(_describe(exc)) from exc

    async def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> Response:
        return await self.request("POST", path, body, headers)

    async def get(self, path: str) -> Response:
        return await self.request("GET", path)


async def fetch(base_url: str, path: str, timeout: float, headers: dict[str, str] | None = None) -> Response:
    """One GET on a connection of its own, closed after it (a health check, a model list)."""
    async with Client(base_url, connections=1, timeout=timeout, headers=headers, keep_alive=False) as client:
        return await client.get(path)


def _describe(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"
