"""A running engine made of containers: log streaming, the watchdog, health gate and teardown.

Logs are the evidence (the classifier reads the crash out of them), so every container's
output is streamed to the run folder while it runs, not fetched at the end: a container that is
removed, a daemon that goes away or a Ctrl-C must not lose what was already printed. A Docker
log stream can hang without closing (seen with remote daemons and dockerd restarts), so a
watchdog compares each stream with what the daemon holds and reopens a stream that fell behind.
"""

from __future__ import annotations

import calendar
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import docker.errors
import requests

from ...secrets import redact
from .errors import EngineNeverHealthyError, EngineStartCancelled
from .hosts import DockerHost
from .launch import NodeLaunch
from . import shm

_TS = re.compile(rb"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z ")
_API_ERRORS = (docker.errors.DockerException, requests.RequestException, OSError)


def parse_ts(stamp: bytes) -> tuple[int, bytes] | None:
    """(unix time in ns, rest of the line) for a line Docker prefixed with an RFC 3339 timestamp."""
    match = _TS.match(stamp)
    if not match:
        return None
    seconds = calendar.timegm(time.strptime(match.group(1).decode(), "%Y-%m-%dT%H:%M:%S"))
    frac = (match.group(2) or b"0").ljust(9, b"0")
    return int(seconds) * 1_000_000_000 + int(frac), stamp[match.end():]


class LogSink:
    """An append-only log file several pumps may write to, line-atomic, flushed per write."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh: BinaryIO = path.open("ab")
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.write(data)
                self._fh.flush()

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()


class LogPump:
    """Streams one container's stdout+stderr into sinks, from where it left off on reopen."""

    def __init__(self, container, sinks: list[LogSink], secrets: list[str], note: Callable[[str], None]):
        self.container = container
        self.sinks = sinks
        self.secrets = secrets
        self.note = note
        self.last_ns = 0
        self.last_activity = time.monotonic()
        self.reopens = 0
        self.finished = threading.Event()
        self._stream = None
        self._lock = threading.Lock()
        self._feed_lock = threading.Lock()
        self._reopen = False
        self._closed = False
        self._pending = b""  # a line Docker split into partial messages, until its newline
        self._thread = threading.Thread(target=self._run, name=f"kvrepro-logs-{container.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _open(self):
        since = max(self.last_ns / 1e9 - 1e-6, 0.0) if self.last_ns else None
        kwargs: dict[str, Any] = dict(stream=True, follow=True, timestamps=True, stdout=True, stderr=True)
        if since:
            kwargs["since"] = since
        return self.container.logs(**kwargs)

    def _run(self) -> None:
        try:
            while not self._closed:
                try:
                    stream = self._open()
                except _API_ERRORS as exc:
                    self.note(f"log stream of {self.container.name} could not be opened: {exc}")
                    break
                with self._lock:
                    self._stream = stream
                try:
                    for chunk in stream:
                        self.feed(chunk)
                except _API_ERRORS:
                    pass
                with self._lock:
                    self._stream = None
                    reopen, self._reopen = self._reopen, False
                if reopen and not self._closed:
                    self.reopens += 1
                    continue
                if not self._closed and self._still_running():
                    # The stream ended but the container did not (a dropped connection, a
                    # restarted daemon): pick up where it left off.
                    self.reopens += 1
                    self.note(f"log stream of {self.container.name} ended early; reopened it")
                    time.sleep(0.5)
                    continue
                break
        finally:
            self._flush_pending()
            self.finished.set()

    def _still_running(self) -> bool:
        try:
            self.container.reload()
        except _API_ERRORS:
            return False
        return self.container.attrs.get("State", {}).get("Status") == "running"

    def feed(self, chunk: bytes) -> None:
        """Take one or more timestamped messages; write the text of those not seen yet."""
        with self._feed_lock:  # the stream thread and a catch-up may feed at the same time
            self._feed(chunk)

    def _feed(self, chunk: bytes) -> None:
        self.last_activity = time.monotonic()
        out = []
        for piece in chunk.splitlines(keepends=True):
            parsed = parse_ts(piece)
            if parsed is None:
                out.append(piece)  # a continuation without a stamp: keep as is
                continue
            stamp, text = parsed
            if stamp < self.last_ns or (stamp == self.last_ns and self.last_ns):
                continue  # already written before a reopen
            self.last_ns = stamp
            out.append(text)
        if out:
            self._write(b"".join(out))

    def _write(self, data: bytes) -> None:
        data = self._pending + data
        head, sep, tail = data.rpartition(b"\n")
        if not sep:
            self._pending = data
            return
        self._pending = tail
        text = redact((head + sep).decode("utf-8", "replace"), self.secrets).encode()
        for sink in self.sinks:
            sink.write(text)

    def _flush_pending(self) -> None:
        if self._pending:
            data, self._pending = self._pending, b""
            text = redact(data.decode("utf-8", "replace"), self.secrets).encode()
            for sink in self.sinks:
                sink.write(text + (b"" if text.endswith(b"\n") else b"\n"))

    def reopen(self) -> None:
        """Drop a stream that stopped delivering; the pump continues from the last timestamp."""
        with self._lock:
            self._reopen = True
            stream = self._stream
        if stream is not None:
            _close_quietly(stream)

    def drain(self) -> None:
        """The container is gone and its stream never ended: read the rest in one request, stop."""
        self._closed = True
        with self._lock:
            stream = self._stream
        if stream is not None:
            _close_quietly(stream)
        if not self.finished.wait(2):
            self.note(f"log stream of {self.container.name} did not end; fetched the rest instead")
        self.catch_up()

    def _logs_after_last_line(self) -> bytes | None:
        """What the daemon holds from our last line on (None: it would not say)."""
        try:
            since = max(self.last_ns / 1e9 - 1e-6, 0.0)
            kwargs: dict[str, Any] = dict(stream=False, timestamps=True, stdout=True, stderr=True)
            if since:
                kwargs["since"] = since
            return self.container.logs(**kwargs)
        except _API_ERRORS:
            return None

    def catch_up(self) -> bool:
        """Write what the daemon holds beyond our last line; True if there was any."""
        data = self._logs_after_last_line()
        if data is None:
            return False
        before = self.last_ns
        self.feed(data)
        return self.last_ns != before

    def has_unseen(self) -> bool:
        """Whether the daemon holds lines newer than what the stream delivered (a hung stream)."""
        data = self._logs_after_last_line()
        if data is None:
            return False
        for piece in data.splitlines():
            parsed = parse_ts(piece + b"\n")
            if parsed and parsed[0] > self.last_ns:
                return True
        return False

    def join(self, timeout: float) -> bool:
        return self.finished.wait(timeout)


def _close_quietly(stream) -> None:
    try:
        stream.close()
    except Exception:  # closing an already broken socket: nothing left to do
        pass


@dataclass(frozen=True)
class NodeStatus:
    state: str = "created"
    exit_code: int | None = None


@dataclass
class Node:
    """One container of a running engine."""

    launch: NodeLaunch
    host: DockerHost
    container: Any
    pump: LogPump | None = None
    exited_at: float | None = None
    status: NodeStatus = field(default_factory=NodeStatus)


class ContainerEngine:
    """The containers of one engine; the EngineHandle in target.py wraps it."""

    def __init__(self, run_dir: Path, base_url: str, stop_timeout_s: float, log_stall_s: float,
                 secrets: list[str], multi_node: bool):
        self.run_dir = run_dir
        self.base_url = base_url
        self.stop_timeout_s = stop_timeout_s
        self.log_stall_s = log_stall_s
        self.secrets = secrets
        self.nodes: list[Node] = []
        self.engine_log = LogSink(run_dir / "engine.log")
        self.docker_log = LogSink(run_dir / "docker.log")
        self.multi_node = multi_node
        self._node_sinks: list[LogSink] = []
        self._stopped = False
        self._stop_lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._status_at = 0.0
        self._status_cache: list[tuple[str, int | None]] = []

    def note(self, text: str) -> None:
        """kvrepro's own account of the containers (kept apart from engine.log, which is the engine's)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.docker_log.write(f"{stamp} {redact(text, self.secrets)}\n".encode())

    def attach(self, launch: NodeLaunch, host: DockerHost, container) -> Node:
        sinks = [self.engine_log]
        if self.multi_node:
            sink = LogSink(self.run_dir / f"node{launch.rank}-{launch.host}.log")
            self._node_sinks.append(sink)
            sinks.append(sink)
        node = Node(launch=launch, host=host, container=container)
        node.pump = LogPump(container, sinks, self.secrets, self.note)
        self.nodes.append(node)
        return node

    def start_watchdog(self) -> None:
        self._watchdog = threading.Thread(target=self._watch, name="kvrepro-log-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        while not self._watch_stop.wait(1.0):
            for node in list(self.nodes):
                pump = node.pump
                if pump is None or pump.finished.is_set():
                    continue
                state, _ = self._state(node)
                if state != "running":
                    if node.exited_at is None:
                        node.exited_at = time.monotonic()
                    elif time.monotonic() - node.exited_at > 5.0:
                        self.note(f"{node.container.name} exited but its log stream stayed open; draining it")
                        pump.drain()
                    continue
                if time.monotonic() - pump.last_activity > self.log_stall_s:
                    if pump.has_unseen():
                        self.note(f"log stream of {node.container.name} stopped delivering; reopened it")
                        pump.reopen()
                    pump.last_activity = time.monotonic()

    def _state(self, node: Node) -> tuple[str, int | None]:
        try:
            node.container.reload()
        except docker.errors.NotFound:
            return "removed", None
        except _API_ERRORS:
            return "unknown", None
        state = node.container.attrs.get("State", {})
        return state.get("Status", "unknown"), state.get("ExitCode")

    def states(self, max_age: float = 0.0) -> list[tuple[str, int | None]]:
        """Each node's (status, exit code); cached for ``max_age`` seconds (alive() is polled often)."""
        now = time.monotonic()
        if now - self._status_at > max_age or len(self._status_cache) != len(self.nodes):
            self._status_cache = [self._state(n) for n in self.nodes]
            self._status_at = now
        return self._status_cache

    def alive(self) -> bool:
        if self._stopped:
            return False
        return all(state == "running" for state, _ in self.states(max_age=0.5))

    def exit_code(self) -> int | None:
        for state, code in self.states():
            if state in ("exited", "dead"):
                return code
        return None

    def wait_healthy(self, timeout: float, where: str, cancel: threading.Event | None = None) -> None:
        deadline = time.monotonic() + timeout
        session = requests.Session()
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    raise EngineStartCancelled(f"{where}: interrupted while the engine was starting")
                for node, (state, code) in zip(self.nodes, self.states()):
                    if state != "running":
                        if node.pump is not None and not node.pump.join(3.0):
                            node.pump.catch_up()  # the tail of the log is the reason: have it first
                        raise EngineNeverHealthyError(
                            f"{where}: container {node.container.name} on host {node.launch.host} "
                            f"{state} (exit code {code}) before {self.base_url}/health answered; "
                            f"last lines of its log:\n{self.tail()}"
                        )
                try:
                    if session.get(self.base_url + "/health", timeout=2).status_code == 200:
                        self.note(f"engine healthy at {self.base_url}")
                        return
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    raise EngineNeverHealthyError(
                        f"{where}: {self.base_url}/health did not answer 200 within {timeout:.0f}s "
                        f"(docker.health_timeout_s / runs.start_timeout_s); last lines of the engine log:\n{self.tail()}"
                    )
                time.sleep(0.25)
        finally:
            session.close()

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.engine_log.path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Stop and remove every container, finish their logs. Idempotent; never raises."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        threads = [threading.Thread(target=self._stop_node, args=(n,), daemon=True) for n in self.nodes]
        for t in threads:
            t.start()
        interrupted: BaseException | None = None
        deadline = time.monotonic() + self.stop_timeout_s + 30
        for t in threads:
            while t.is_alive() and time.monotonic() < deadline:
                try:
                    t.join(max(0.0, deadline - time.monotonic()))
                except KeyboardInterrupt as exc:
                    # An impatient second Ctrl-C: finish removing the containers first, then
                    # let it through; leaving a GPU engine running is the worse outcome.
                    interrupted = exc
        self._watch_stop.set()
        for sink in [self.engine_log, *self._node_sinks]:
            sink.close()
        self.note("teardown complete")
        self.docker_log.close()
        if interrupted is not None:
            raise interrupted

    def _stop_node(self, node: Node) -> None:
        name = getattr(node.container, "name", "?")
        state, code = self._state(node)
        if state == "running":
            try:
                node.container.stop(timeout=int(self.stop_timeout_s))
            except _API_ERRORS as exc:
                self.note(f"stopping {name}: {exc}")
            state, code = self._state(node)
        node.status = NodeStatus(state=state, exit_code=code)
        if node.pump is not None:
            if not node.pump.join(5.0):
                node.pump.drain()
            else:
                node.pump.catch_up()
        done = shm.remove_and_release(node.host, node.container)
        if done.error:  # its regions stay claimed: `kvrepro clean` releases them with it
            self.note(f"could not remove {name}: {done.error}; `kvrepro clean` removes it later")
            return
        if not done.already_gone:
            self.note(f"removed {name} (exit code {code})")
        if done.released:
            self.note(f"released /dev/shm region(s) {', '.join(done.released)} of {name} on {node.host.name}")
        if done.why:
            self.note(f"left /dev/shm region(s) {', '.join(done.claimed)} of {name} on {node.host.name}: {done.why}")
