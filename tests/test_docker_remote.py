"""The docker target's remote-host code paths, against the real local daemon reached over TCP.

Faked: the remoteness. No second machine exists here, so a byte relay on 127.0.0.2 forwards TCP
to the local daemon's socket, and the hosts say `local: false` (kvrepro tells this machine by the
daemon's ID, which the relay cannot change). Everything on the other side is the real daemon:
image assembly over tcp://, the model folder uploaded into the container (a remote host cannot
bind-mount this machine's files), ports that can only be seen through the daemon, and the API
published on the host's `api_address` only (never on all interfaces) and reached there.
ssh:// hosts have their own test with a real sshd (test_docker_ssh.py).
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import tarfile
import threading
import time

import docker.errors
import pytest

from kvrepro.deploy.docker import DockerTarget
from conftest import ROOT
from kvrepro.deploy.docker import labels as L
from kvrepro.deploy.docker.records import ImageManifest
from kvrepro.matrix.runner import SilentProgress, run_one
from test_docker_target import cpu_base, docker_host, docker_matrix  # noqa: F401 (fixtures)

pytestmark = pytest.mark.docker


class Relay:
    """TCP on 127.0.0.2:<port> -> the local Docker socket, byte for byte."""

    def __init__(self, unix_path: str = "/var/run/docker.sock"):
        self.unix_path = unix_path
        self.server = socket.socket()
        self.server.bind(("127.0.0.2", 0))
        self.server.listen(16)
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.unix_path)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def relay():
    r = Relay()
    yield r
    r.close()


def test_remote_host_over_tcp(tmp_path, docker_host, cpu_base, relay):
    hosts = [{"name": "peer", "docker": f"tcp://127.0.0.2:{relay.port}", "address": "127.0.0.1",
              "api_address": "127.0.0.1", "local": False}]
    loaded = docker_matrix(tmp_path, cpu_base, hosts=hosts, docker={"health_timeout_s": 300})

    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "hosts", "check", "--json", "-m", str(loaded.path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    [report] = json.loads(proc.stdout)
    assert report["ok"] and report["local"] is False and report["address"] == "127.0.0.1"
    assert report["ports"]["8000"] in ("unknown", "in use")  # a remote host's own sockets are invisible

    [plan] = loaded.plans(["A"])
    target = DockerTarget(loaded)
    seen: dict[str, bytes] = {}
    stop = threading.Event()

    def fetch_model_config() -> None:
        # while the engine container exists, read the model folder kvrepro uploaded into it
        while not stop.is_set() and "config" not in seen:
            for c in docker_host.client.containers.list(
                    all=True, filters={"label": f"{L.LABEL_SESSION}={L.SESSION}"}):
                if c.labels.get(L.LABEL_KIND) != "engine":
                    continue
                try:
                    stream, _ = c.get_archive("/kvrepro/model/qwen3-next-tiny/config.json")
                    tar = tarfile.open(fileobj=io.BytesIO(b"".join(stream)))
                    seen["config"] = tar.extractfile(tar.next()).read()
                    seen["mounts"] = json.dumps(c.attrs.get("Mounts", []))
                    seen["ports"] = json.dumps(c.attrs.get("HostConfig", {}).get("PortBindings", {}))
                except docker.errors.APIError:
                    pass
            time.sleep(0.2)

    watcher = threading.Thread(target=fetch_model_config, daemon=True)
    try:
        artifact = target.prepare(plan)
        assert artifact.ok, artifact.error
        assert ImageManifest.of(artifact.manifest).hosts["peer"].image_id == docker_host.client.images.get(artifact.ref).id
        watcher.start()
        result = run_one(loaded, target, artifact, tmp_path / "run", 0, SilentProgress(), threading.Event())
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        target.close()
    model = loaded.model_dir()
    assert seen.get("config") == (model / "config.json").read_bytes()  # uploaded, not mounted
    assert str(model) not in seen["mounts"]
    assert '"HostIp": "127.0.0.1"' in seen["ports"]  # on hosts[].api_address only, never 0.0.0.0
    assert result.infra_error is None or "Traceback" not in result.infra_error
    assert docker_host.client.containers.list(all=True, filters={"label": f"{L.LABEL_SESSION}={L.SESSION}"}) == []


def test_two_node_engine_orchestration(tmp_path, docker_host, cpu_base, relay):
    """Faked: two "nodes" that are one daemon (node 1 reached over the TCP relay), and no GPU, so
    the GPU-free engine cannot form vLLM's multi-node group and exits; what is checked is the
    orchestration: one container per node on the host network with its rank's flags, per-node
    logs in the run folder, and teardown of both."""
    hosts = [{"name": "n0", "docker": "unix:///var/run/docker.sock"},
             {"name": "n1", "docker": f"tcp://127.0.0.2:{relay.port}", "address": "127.0.0.1", "local": False}]
    loaded = docker_matrix(tmp_path, cpu_base, hosts=hosts, docker={"nodes": ["n0", "n1"], "health_timeout_s": 300})
    [plan] = loaded.plans(["A"])
    target = DockerTarget(loaded)
    seen: dict[str, dict] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                listed = docker_host.client.containers.list(all=True,
                                                            filters={"label": f"{L.LABEL_SESSION}={L.SESSION}"})
            except docker.errors.NotFound:  # the SDK inspects each listed container: one just removed (seen in CI)
                continue
            for c in listed:
                if c.labels.get(L.LABEL_KIND) == "engine":
                    seen[c.labels[L.LABEL_NODE]] = {"args": c.attrs["Args"], "network": c.attrs["HostConfig"]["NetworkMode"]}
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        artifact = target.prepare(plan)
        assert artifact.ok, artifact.error
        assert set(ImageManifest.of(artifact.manifest).hosts) == {"n0", "n1"}  # assembled on every node's host
        watcher.start()
        result = run_one(loaded, target, artifact, tmp_path / "run", 0, SilentProgress(), threading.Event())
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        target.close()
    assert set(seen) == {"0", "1"}
    for rank in ("0", "1"):
        args = seen[rank]["args"]
        assert seen[rank]["network"] == "host"
        assert args[args.index("--nnodes") + 1] == "2" and args[args.index("--node-rank") + 1] == rank
        assert args[args.index("--master-addr") + 1] == "127.0.0.1"
    assert "--headless" in seen["1"]["args"] and "--headless" not in seen["0"]["args"]
    assert "--port" in seen["0"]["args"] and "--port" not in seen["1"]["args"]
    run_dir = tmp_path / "run"
    for name in ("node0-n0.log", "node1-n1.log", "engine.log"):
        assert (run_dir / name).stat().st_size > 0, name
    if result.infra_error:
        assert "Traceback" not in result.infra_error
    assert docker_host.client.containers.list(all=True, filters={"label": f"{L.LABEL_SESSION}={L.SESSION}"}) == []
