"""ssh:// Docker hosts: one kept OpenSSH connection per host, carrying the daemon and the engine API.

Why the system ``ssh`` client (OpenSSH), not paramiko: it is what `docker -H ssh://` and the
user's own shell use, so ~/.ssh/config (aliases, ProxyJump, IdentityFile, the agent) and
known_hosts mean the same thing here, and when it fails its reason is the one people know
(``Connection refused``, ``Host key verification failed``, ``Permission denied (publickey)``).
Nothing beyond the ``openssh-client`` package is needed.

Why one kept connection: docker-py's ssh transport starts a new ssh session for every HTTP
connection it opens (a run with log streams and health polls held 27 at once, and an engine took
68 s to start instead of 42 s). Here one ``ssh -N`` master per host forwards the remote daemon's
socket to a local unix socket, so the Docker client speaks plain HTTP over a unix socket and
every call is a channel on that one connection. An engine's API port, published on the remote
host's loopback only, is added to the same connection as a local port forward (``ssh -O forward``
through the master's control socket).

Never an interactive prompt: ``BatchMode=yes``, no stdin, and a session of its own (no
controlling terminal), so an unknown host key or a key with a passphrase fails at once with ssh's
reason instead of waiting at a prompt. Secrets: none pass through here (keys stay with ssh).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from .settings import HostSpec
from .errors import DockerInfraError, SshError, UnknownHostError

DEFAULT_REMOTE_SOCKET = "/var/run/docker.sock"
# Lines ssh prints that are not the reason for anything.
_NOISE = ("Warning: Permanently added", "Pseudo-terminal", "Master running", "Exit request sent")

try:  # resolved in the parent: the child between fork and exec must not load libraries
    _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent() -> None:
    if _prctl is not None:
        _prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG: a SIGKILLed kvrepro ends its ssh too


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (another process may take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Spawner:
    """Starts ssh masters from one thread that lives as long as the process.

    The kernel's parent-death signal fires when the *thread* that forked the child ends, and
    hosts are connected from short-lived worker threads; forking from here ties the masters to
    the life of kvrepro itself.
    """

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="kvrepro-ssh-spawner", daemon=True)
                self._thread.start()
        done = threading.Event()
        box: list = []
        self._jobs.put((argv, kwargs, box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _serve(self) -> None:
        while True:
            argv, kwargs, box, done = self._jobs.get()
            try:
                box.append(subprocess.Popen(argv, preexec_fn=_die_with_parent, **kwargs))
            except BaseException as exc:  # handed to the caller's thread, raised there
                box.append(exc)
            done.set()


_spawner = _Spawner()


def ssh_target(spec: HostSpec) -> tuple[str, int | None, str]:
    """(destination for ssh, port or None, remote daemon socket) from an ssh:// URL.

    A path in the URL names the remote socket (rootless Docker: ssh://u@h/run/user/1000/docker.sock).
    """
    parsed = urlparse(spec.docker)
    destination = f"{parsed.username}@{parsed.hostname}" if parsed.username else (parsed.hostname or "")
    return destination, parsed.port, (parsed.path if parsed.path not in ("", "/") else DEFAULT_REMOTE_SOCKET)


def ssh_reason(text: str) -> str:
    """The line of ssh's stderr that says why (its last meaningful one)."""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(_NOISE)]
    return lines[-1].rstrip(".") if lines else ""


class SshConnection:
    """One ``ssh -N`` master to a host: its daemon socket on a local unix socket, plus port forwards."""

    def __init__(self, spec: HostSpec, timeout: float):
        self.spec = spec
        self.timeout = timeout
        self.destination, self.port, self.remote_socket = ssh_target(spec)
        self._folder: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._forwards: set[tuple[int, str, int]] = set()
        self._lock = threading.Lock()

    # -- paths and arguments

    @property
    def docker_socket(self) -> Path:
        assert self._folder is not None
        return self._folder / "docker.sock"

    @property
    def docker_url(self) -> str:
        return f"unix://{self.docker_socket}"

    def _common(self) -> list[str]:
        args = ["ssh"]
        if self.spec.ssh_config:
            args += ["-F", os.path.expanduser(self.spec.ssh_config)]
        if self.port:
            args += ["-p", str(self.port)]
        assert self._folder is not None
        return args + ["-S", str(self._folder / "control"), "-o", "BatchMode=yes"]

    def describe(self) -> str:
        config = f" -F {self.spec.ssh_config}" if self.spec.ssh_config else ""
        return f"ssh{config} {self.destination}" + (f" -p {self.port}" if self.port else "")

    # -- lifecycle

    def open(self) -> "SshConnection":
        """Start the master and wait until the daemon socket is forwarded; raise SshError with ssh's reason."""
        # Short path: unix socket paths are limited to 108 bytes.
        self._folder = Path(tempfile.mkdtemp(prefix="kvrepro-ssh-", dir="/tmp" if os.path.isdir("/tmp") else None))
        argv = self._common() + [
            "-N", "-M", "-T",
            "-o", "ControlPersist=no",
            "-o", "ExitOnForwardFailure=yes",
            "-o", f"ConnectTimeout={max(1, int(min(self.timeout, 30)))}",
            "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4",
            "-o", "StreamLocalBindUnlink=yes",
            "-L", f"{self.docker_socket}:{self.remote_socket}",
            "--", self.destination,
        ]
        log = (self._folder / "ssh.log").open("wb")
        try:
            self._proc = _spawner.popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                        start_new_session=True)
        except OSError as exc:
            self.close()
            raise SshError(f"host {self.spec.name}: cannot run the ssh client ({exc.strerror or exc}); "
                           "install OpenSSH (`apt-get install openssh-client`)") from None
        finally:
            log.close()
        try:
            self._wait_connected()
        except BaseException:  # a failure, or Ctrl-C while ssh still connects: the master goes too
            self.close()
            raise
        return self

    def _wait_connected(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.timeout
        while not self.docker_socket.exists():
            if self._proc.poll() is not None:
                raise self._error(self.reason() or f"ssh exited with code {self._proc.returncode}")
            if time.monotonic() > deadline:
                reason = self.reason()
                raise SshError(f"host {self.spec.name}: {self.describe()} did not connect within "
                               f"{self.timeout:.0f}s" + (f" ({reason})" if reason else "")
                               + "; check that the host is up and reachable on its ssh port")
            time.sleep(0.05)

    def _error(self, reason: str) -> DockerInfraError:
        hint = "check hosts[].docker and `" + self.describe() + "` by hand"
        if "Host key verification failed" in reason:
            hint = (f"the host's key is not in known_hosts; check it and add it (`{self.describe()}` once "
                    "by hand, or ssh-keyscan), kvrepro never answers ssh's prompt")
        elif "Permission denied" in reason:
            hint = "ssh refused the key; add yours to the host's authorized_keys or set IdentityFile in your ssh config"
        elif "Connection refused" in reason:
            hint = "nothing accepts ssh on that port; check the port in hosts[].docker and that sshd runs"
        elif "Could not resolve hostname" in reason:
            return UnknownHostError(f"host {self.spec.name}: {self.describe()} failed: {reason}; "
                                    "check the name in hosts[].docker, your DNS or ~/.ssh/config")
        return SshError(f"host {self.spec.name}: {self.describe()} failed: {reason}; {hint}")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def reason(self) -> str:
        """ssh's last meaningful stderr line (why it failed, or why a forwarded channel did)."""
        if self._folder is None:
            return ""
        try:
            return ssh_reason((self._folder / "ssh.log").read_text(errors="replace"))
        except OSError:
            return ""

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    # -- port forwards over the kept connection

    def forward(self, remote_port: int, remote_host: str = "127.0.0.1") -> int:
        """Forward a free local port on 127.0.0.1 to ``remote_host:remote_port`` as seen from the
        host; return the local port."""
        last = ""
        for _ in range(3):  # another process may take the free port between choosing and binding it
            local = free_local_port()
            spec = f"127.0.0.1:{local}:{remote_host}:{remote_port}"
            done = self._control("forward", spec)
            if done.returncode == 0:
                with self._lock:
                    self._forwards.add((local, remote_host, remote_port))
                return local
            last = ssh_reason(done.stderr) or f"exit code {done.returncode}"
        raise SshError(f"host {self.spec.name}: ssh could not forward a local port to {remote_host}:{remote_port} "
                       f"over the kept connection ({last}); check that the host's sshd allows TCP forwarding "
                       "(AllowTcpForwarding), or set hosts[].api_address")

    def cancel(self, local_port: int) -> None:
        """Remove a forward (best effort: closing the connection removes them all anyway)."""
        with self._lock:
            matches = [f for f in self._forwards if f[0] == local_port]
            self._forwards -= set(matches)
        for local, host, port in matches:
            if self.alive():
                self._control("cancel", f"127.0.0.1:{local}:{host}:{port}")

    def _control(self, command: str, forward: str) -> subprocess.CompletedProcess:
        argv = self._common() + ["-O", command, "-L", forward, "--", self.destination]
        try:
            return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=max(self.timeout, 10), start_new_session=True)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return subprocess.CompletedProcess(argv, 255, "", str(exc))


__all__ = ["SshConnection", "ssh_reason", "ssh_target"]
