"""Docker hosts: connecting to a daemon (local socket, ssh://, tcp with TLS) and checking it.

A failed connection is turned into a named error here, once, so that everything above can say
"host gpu-1: daemon down" (or ssh's own reason) instead of showing docker-py's or urllib3's stack.
ssh:// hosts go through one kept OpenSSH connection each (ssh.py), not docker-py's ssh transport.

Whether a host is *this machine* decides bind mounts versus uploads and where the engine API
is reached. An address says nothing about that (ssh://u@127.0.0.1:2222 is often a VM behind a
port forward), so it is decided by comparing the daemon's ID with the local daemon's.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import docker
import docker.errors
import requests

from ...errors import SpecError
from ...spec.matrix import Matrix
from .settings import HostSpec, docker_settings
from .errors import DaemonDownError, SshError, UnknownHostError
from .labels import MANAGED_FILTER, managed
from .ssh import SshConnection

DEFAULT_SOCKET = "unix:///var/run/docker.sock"


def remove_quietly(container) -> None:
    """Remove a container kvrepro made, ignoring a daemon that already lost it or went away.

    Used in ``finally`` blocks: an error here must never replace the error being handled, and
    whatever stays behind carries kvrepro's labels, so ``kvrepro clean`` finds it.
    """
    try:
        container.remove(force=True)
    except (docker.errors.DockerException, requests.RequestException, OSError):
        pass


def local_host_spec() -> HostSpec:
    """The daemon this machine's `docker` CLI talks to (DOCKER_HOST, else the default socket)."""
    return HostSpec(name="local", docker=os.environ.get("DOCKER_HOST") or DEFAULT_SOCKET)


def host_of(spec: HostSpec) -> str:
    """The machine name in a host's docker URL ('' for a unix socket)."""
    parsed = urlparse(spec.docker)
    return "" if parsed.scheme == "unix" else (parsed.hostname or "")


def is_local(spec: HostSpec, daemon_id: str | None = None) -> bool:
    """True when the daemon runs on this machine, so its bind mounts and 127.0.0.1 are ours.

    A unix socket is local; otherwise hosts[].local if set, else whether ``daemon_id`` (from
    `docker info` of that host) is the local daemon's. Without an ID: not local.
    """
    if urlparse(spec.docker).scheme == "unix":
        return True
    if spec.local is not None:
        return spec.local
    return daemon_id is not None and daemon_id == local_daemon_id()


@functools.lru_cache(maxsize=1)
def local_daemon_id() -> str | None:
    """The ID of the daemon behind this machine's default socket (None: there is none)."""
    path = urlparse(DEFAULT_SOCKET).path
    if not Path(path).exists():
        return None
    try:
        client = docker.DockerClient(base_url=DEFAULT_SOCKET, timeout=10, version="auto")
        try:
            return client.info().get("ID")
        finally:
            client.close()
    except (docker.errors.DockerException, requests.RequestException, OSError):
        return None


def reach_address(spec: HostSpec, local: bool | None = None) -> str:
    """How other nodes reach a host (hosts[].address, else 127.0.0.1 for this machine, else its name)."""
    if spec.address:
        return spec.address
    return "127.0.0.1" if (is_local(spec) if local is None else local) else host_of(spec)


def engine_hosts(matrix: Matrix) -> list[HostSpec]:
    """The hosts that together run one engine, head first (docker.nodes, else the first host)."""
    settings = docker_settings(matrix)
    known = {h.name: h for h in settings.hosts}
    if settings.docker.nodes:
        missing = [n for n in settings.docker.nodes if n not in known]
        if missing:
            raise UnknownHostError(
                f"docker.nodes names host(s) {', '.join(map(repr, missing))} that hosts: does not define "
                f"(defined: {', '.join(known) or 'none'}); add them under hosts: with name and docker URL"
            )
        return [known[n] for n in settings.docker.nodes]
    if settings.hosts:
        return [settings.hosts[0]]
    return [local_host_spec()]


def all_hosts(matrix: Matrix | None) -> list[HostSpec]:
    if matrix is None or not matrix.section("hosts"):
        return [local_host_spec()]
    return list(docker_settings(matrix).hosts)


def _tls_config(spec: HostSpec) -> docker.tls.TLSConfig | None:
    if not spec.tls:
        return None
    folder = Path(os.path.expanduser(spec.cert_path or os.environ.get("DOCKER_CERT_PATH", "~/.docker")))
    files = {name: folder / name for name in ("ca.pem", "cert.pem", "key.pem")}
    absent = [str(p) for p in files.values() if not p.is_file()]
    if absent:
        raise DaemonDownError(
            f"host {spec.name}: TLS is on but {', '.join(absent)} do not exist; set hosts[].cert_path to the "
            "folder holding ca.pem, cert.pem and key.pem (as for `docker --tlsverify`)"
        )
    return docker.tls.TLSConfig(
        client_cert=(str(files["cert.pem"]), str(files["key.pem"])),
        ca_cert=str(files["ca.pem"]) if spec.tls_verify else None,
        verify=spec.tls_verify,
    )


@dataclass
class DockerHost:
    """A connected daemon, the spec it came from, and (ssh://) the kept ssh connection."""

    spec: HostSpec
    client: docker.DockerClient
    info: dict[str, Any] = field(default_factory=dict)
    tunnel: SshConnection | None = None
    local: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def address(self) -> str:
        return reach_address(self.spec, self.local)

    def api_bind_ip(self) -> str:
        """Where an engine publishes its API on this host: never all interfaces by default.

        This machine: 127.0.0.1. hosts[].api_address when set. An ssh:// host: its loopback,
        reached through the kept ssh connection (:meth:`api_url`). A remote tcp:// host offers
        no such path, so it needs api_address.
        """
        if self.local:
            return "127.0.0.1"
        if self.spec.api_address:
            return self.spec.api_address
        if self.tunnel is not None:
            return "127.0.0.1"
        raise SpecError(
            f"host {self.name}: {self.spec.docker} is another machine reached without ssh, so its engine API cannot "
            "stay on its loopback; set hosts[].api_address to the IP of that host to publish the API on "
            "(kvrepro never publishes it on all interfaces), or reach the host with ssh://"
        )

    def api_url(self, port: int) -> tuple[str, int | None]:
        """(base URL the load generator uses for an API published on ``port`` of this host, the
        local port forwarded over ssh for it or None)."""
        if self.local:
            return f"http://127.0.0.1:{port}", None
        if self.spec.api_address:
            return f"http://{self.spec.api_address}:{port}", None
        if self.tunnel is None:
            self.api_bind_ip()  # raises the explanation
        assert self.tunnel is not None
        forwarded = self.tunnel.forward(port)
        return f"http://127.0.0.1:{forwarded}", forwarded

    def drop_forward(self, local_port: int | None) -> None:
        if local_port is not None and self.tunnel is not None:
            self.tunnel.cancel(local_port)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # closing a broken connection must not hide the error that broke it
            pass
        if self.tunnel is not None:
            self.tunnel.close()


def connect(spec: HostSpec, timeout: float = 60.0) -> DockerHost:
    """Connect to a host's daemon and ping it; raise UnknownHostError, SshError or DaemonDownError."""
    parsed = urlparse(spec.docker)
    machine = host_of(spec)
    tunnel: SshConnection | None = None
    base_url = spec.docker
    if parsed.scheme == "unix":
        sock = parsed.path
        if not Path(sock).exists():
            raise DaemonDownError(
                f"host {spec.name}: no Docker daemon socket at {sock}; start the daemon "
                "(`sudo systemctl start docker`, or `dockerd &`) or fix hosts[].docker"
            )
    elif parsed.scheme == "ssh":
        # ssh resolves the name itself (it may be an alias from ~/.ssh/config) and says so if it cannot.
        tunnel = SshConnection(spec, timeout=timeout).open()
        base_url = tunnel.docker_url
    elif machine not in ("localhost", "127.0.0.1", "::1", ""):
        try:
            socket.getaddrinfo(machine, None)
        except (socket.gaierror, UnicodeError) as exc:
            raise UnknownHostError(
                f"host {spec.name}: {machine!r} (from {spec.docker}) does not resolve ({exc.strerror or exc}); "
                "check the name in hosts[].docker or your DNS"
            ) from None
    try:
        client = docker.DockerClient(base_url=base_url, tls=_tls_config(spec), timeout=int(timeout), version="auto")
        client.ping()
        info = client.info()
    except (docker.errors.DockerException, requests.RequestException, OSError) as exc:
        if tunnel is not None:
            time.sleep(0.2)  # ssh logs why the forwarded channel failed just after the client sees it
            reason = tunnel.reason() or _short(exc)
            tunnel.close()
            raise SshError(
                f"host {spec.name}: connected with {tunnel.describe()}, but the Docker daemon socket "
                f"{tunnel.remote_socket} does not answer through it ({reason}); start the daemon there, check "
                "that this user may use it, or give its path in the URL (ssh://user@host/run/user/1000/docker.sock)"
            ) from None
        raise DaemonDownError(
            f"host {spec.name}: the Docker daemon at {spec.docker} does not answer ({_short(exc)}); "
            "start it, or check hosts[].docker / TLS settings, then `kvrepro hosts check`"
        ) from None
    return DockerHost(spec=spec, client=client, info=info, tunnel=tunnel, local=is_local(spec, info.get("ID")))


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[-1] if text else type(exc).__name__)[:300]


def port_free_locally(port: int) -> bool:
    """Whether nothing on this machine listens on ``port`` (IPv4, any address)."""
    for addr in ("127.0.0.1", "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((addr, port))
            except OSError:
                return False
    return True


def published_ports(host: DockerHost) -> set[int]:
    """Host ports that running containers publish (what we can see on a remote host)."""
    used: set[int] = set()
    for container in host.client.containers.list(ignore_removed=True):
        for bindings in (container.attrs.get("NetworkSettings", {}).get("Ports") or {}).values():
            for binding in bindings or []:
                if str(binding.get("HostPort", "")).isdigit():
                    used.add(int(binding["HostPort"]))
    return used


def port_state(host: DockerHost, port: int) -> str:
    """'free', 'in use', or 'unknown' (a remote host's own processes are invisible to us)."""
    if port in published_ports(host):
        return "in use"
    if host.local:
        return "free" if port_free_locally(port) else "in use"
    return "unknown"


@dataclass(frozen=True)
class BaseImageCheck:
    ref: str
    present: bool


@dataclass(frozen=True)
class HostCheck:
    """What `kvrepro hosts check` reports for one host (its ``--json`` object: :meth:`to_json`).

    Set in stages: always the host as declared; once connected, how (``local`` to ``via``); once
    the daemon answered, what it has (``server_version`` to ``warnings``); with a matrix, its ports
    and base image. ``ok`` False: ``error`` and ``error_kind`` say why."""

    name: str
    docker: str
    gpus_declared: int
    ok: bool = False
    error: str | None = None
    error_kind: str | None = None
    connected: bool = False
    local: bool | None = None
    address: str | None = None
    daemon_id: str | None = None
    via: str | None = None
    answered: bool = False
    server_version: str | None = None
    api_version: str | None = None
    cpus: int | None = None
    memory_gib: float | None = None
    runtimes: tuple[str, ...] = ()
    nvidia_runtime: bool = False
    gpus_usable: bool | None = None
    kvrepro_containers: int = 0
    ports: dict[str, str] | None = None
    base_image: BaseImageCheck | None = None
    gpus_visible: int | None = None
    gpus_checked: bool = False
    warnings: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "docker": self.docker, "gpus_declared": self.gpus_declared}
        if self.connected:
            data.update(local=self.local, address=self.address, daemon_id=self.daemon_id, via=self.via)
        if self.answered:
            data.update(server_version=self.server_version, api_version=self.api_version, cpus=self.cpus,
                        memory_gib=self.memory_gib, runtimes=list(self.runtimes),
                        nvidia_runtime=self.nvidia_runtime, gpus_usable=self.gpus_usable,
                        kvrepro_containers=self.kvrepro_containers)
            if self.ports is not None:
                data["ports"] = dict(self.ports)
            if self.base_image is not None:
                data["base_image"] = {"ref": self.base_image.ref, "present": self.base_image.present}
            if self.gpus_checked:
                data["gpus_visible"] = self.gpus_visible
        if self.warnings is not None:
            data["warnings"] = list(self.warnings)
        data["ok"] = self.ok
        if not self.ok:
            data.update(error=self.error, error_kind=self.error_kind)
        return data

    __json__ = to_json


def check_host(spec: HostSpec, matrix: Matrix | None) -> HostCheck:
    """What `kvrepro hosts check` reports for one host; never raises for a bad host."""
    report = HostCheck(name=spec.name, docker=spec.docker, gpus_declared=spec.gpus)
    try:
        host = connect(spec, timeout=20)
    except (DaemonDownError, UnknownHostError) as exc:
        return replace(report, ok=False, error=str(exc), error_kind=exc.kind)
    report = replace(report, connected=True, local=host.local, address=host.address, daemon_id=host.info.get("ID"),
                     via="ssh (one kept connection)" if host.tunnel else urlparse(spec.docker).scheme)
    try:
        info = host.info  # the docker SDK's answer: a dict by the daemon's API
        runtimes = tuple(sorted((info.get("Runtimes") or {}).keys()))
        report = replace(
            report,
            ok=True,
            answered=True,
            server_version=host.client.version().get("Version"),
            api_version=host.client.api.api_version,
            cpus=info.get("NCPU"),
            memory_gib=round((info.get("MemTotal") or 0) / 2**30, 1),
            runtimes=runtimes,
            nvidia_runtime="nvidia" in runtimes,
            gpus_usable=("nvidia" in runtimes) if spec.gpus else None,
            kvrepro_containers=len(host.client.containers.list(all=True, filters=MANAGED_FILTER, ignore_removed=True)),
        )
        warnings = []
        if spec.gpus and not report.nvidia_runtime:
            warnings.append(f"declares gpus: {spec.gpus} but the daemon has no `nvidia` runtime "
                            "(install nvidia-container-toolkit)")
        if matrix is not None:
            # The API port (vLLM's 8000 unless docker.api_port says otherwise; one local node
            # publishes on any free port) and the multi-node rendezvous port.
            settings = docker_settings(matrix)
            ports = [settings.docker.api_port or 8000, settings.docker.rendezvous_port]
            report = replace(report, ports={str(p): port_state(host, p) for p in ports})
            image = settings.image_for(matrix.bases[0])
            try:
                host.client.images.get(image)
                report = replace(report, base_image=BaseImageCheck(ref=image, present=True))
            except docker.errors.ImageNotFound:
                report = replace(report, base_image=BaseImageCheck(ref=image, present=False))
                warnings.append(f"base image {image} is not on this host (`docker pull {image}`, or "
                                "`kvrepro images base-cpu` for the CPU base)")
            if report.nvidia_runtime and report.base_image is not None and report.base_image.present:
                visible = count_gpus(host, image)
                report = replace(report, gpus_checked=True, gpus_visible=visible)
                if visible is not None and visible < spec.gpus:
                    warnings.append(f"declares gpus: {spec.gpus} but a container sees {visible}")
        report = replace(report, warnings=tuple(warnings))
    except (docker.errors.DockerException, requests.RequestException) as exc:
        report = replace(report, ok=False, error=f"host {spec.name}: {_short(exc)}", error_kind="daemon_down")
    finally:
        host.close()
    return report


def count_gpus(host: DockerHost, image: str) -> int | None:
    """GPUs a container on ``host`` gets with a device request for all of them (`nvidia-smi -L`
    in a throwaway container of ``image``); None when that cannot be run."""
    from docker.types import DeviceRequest

    container = None
    try:
        container = host.client.containers.create(
            image, entrypoint=["nvidia-smi", "-L"], device_requests=[DeviceRequest(count=-1, capabilities=[["gpu"]])],
            labels=managed("probe"), network_disabled=True,
        )
        container.start()  # fails at once where the daemon has no GPU driver to hand out
        container.wait(timeout=60)
        output = container.logs()
    except (docker.errors.DockerException, requests.RequestException):
        return None
    finally:
        if container is not None:
            remove_quietly(container)
    return sum(1 for line in output.decode("utf-8", "replace").splitlines() if line.startswith("GPU "))
