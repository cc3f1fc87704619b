"""A real multi-node Ray cluster on this machine, on loopback only (for tests and benchmarks).

Every node is its own raylet (``ray start``) with its own address in 127.0.0.0/8 (127.0.0.11 the
head, 127.0.0.12, ... the workers: Linux routes all of 127/8 to loopback), logical CPUs as
given. Nothing about the nodes is faked; GPUs, if asked for (``gpus``), are only advertised
(``--num-gpus``): there is no GPU behind them. :meth:`stop` kills exactly the processes of this
cluster (those naming its temp folder, and their descendants), never by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HEAD_IP = "127.0.0.11"


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them."""
    found = set(roots)
    changed = True
    while changed:
        changed = False
        for pid in _all_pids():
            if pid not in found and _ppid(pid) in found:
                found.add(pid)
                changed = True
    return found


@dataclass
class LocalCluster:
    nodes: int = 3
    cpus_per_node: int = 1
    gpus: int = 0  # advertised only: fake
    ray_bin: str = str(Path(sys.executable).with_name("ray"))
    port: int = 0
    temp_dir: str = ""
    addresses: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{self.port}"

    def env(self) -> dict[str, str]:
        # Ray starts workers at nice 15 (worker_niceness) and the engines inherit it: on a machine
        # shared with other work that would slow ray's runs against sim's; 0 keeps them even
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_worker_niceness="0")
        env.pop("RAY_ADDRESS", None)
        return env

    def start(self) -> "LocalCluster":
        self.temp_dir = tempfile.mkdtemp(prefix="kvr-ray-", dir="/tmp")  # short: raylet socket paths
        try:
            return self._start()
        except BaseException:
            self.stop()  # a node that did not come up: nothing of this cluster stays
            raise

    def _start(self) -> "LocalCluster":
        self.port = _free_port(HEAD_IP)
        common = ["--num-cpus", str(self.cpus_per_node), "--disable-usage-stats"]
        if self.gpus:
            common += ["--num-gpus", str(self.gpus)]
        self._ray(["start", "--head", f"--node-ip-address={HEAD_IP}", f"--port={self.port}",
                   "--include-dashboard=false", f"--temp-dir={self.temp_dir}", *common])
        self.addresses = [HEAD_IP]
        for i in range(1, self.nodes):
            ip = f"127.0.0.{11 + i}"
            self._ray(["start", f"--address={self.address}", f"--node-ip-address={ip}", *common])
            self.addresses.append(ip)
        return self

    def _ray(self, args: list[str]) -> None:
        proc = subprocess.run([self.ray_bin, *args], env=self.env(), capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args[:2])} failed:\n{proc.stderr[-2000:]}")

    def processes(self) -> set[int]:
        """Every process of this cluster (raylets, GCS, workers and what they started)."""
        roots = {pid for pid in _all_pids() if self.temp_dir and pid != os.getpid()
                 and any(self.temp_dir in a for a in _cmdline(pid))}
        return descendants(roots)

    def raylet_pid(self, ip: str) -> int | None:
        for pid in self.processes():
            args = _cmdline(pid)
            if args and args[0].endswith("/raylet") and f"--node_ip_address={ip}" in args:
                return pid
        return None

    def stop(self) -> set[int]:
        """Kill every process of this cluster; return the pids that were still alive after 10 s."""
        pids = self.processes()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        left = pids
        while left and time.monotonic() < deadline:
            left = {p for p in left if Path(f"/proc/{p}").exists() and "Z" not in _state(p)}
            time.sleep(0.2)
        if not left and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)  # the session's logs and sockets
        return left

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
