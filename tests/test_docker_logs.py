"""Container logs and teardown of the docker target, with real containers on the local daemon.

The containers run small shell scripts in the CPU base image instead of an engine: what is under
test is how kvrepro streams, redacts, watches and removes containers, which does not depend on
what the container prints. Two tests fake a Docker log stream that hangs (a daemon fault no
healthy daemon shows on demand); they say so in their docstrings. Fails instead of skipping
when CI is set and no daemon or base image is there.
"""

from __future__ import annotations

import threading
import time

import docker.errors
import pytest

from kvrepro.deploy.docker.errors import EngineNeverHealthyError
from kvrepro.deploy.docker import labels as L
from kvrepro.deploy.docker.containers import ContainerEngine
from kvrepro.deploy.docker.launch import NodeLaunch
from test_docker_target import cpu_base, docker_host  # noqa: F401 (fixtures)

pytestmark = pytest.mark.docker

SECRET = "hf_" + "q" * 30
LAUNCH = NodeLaunch(rank=0, host="local", head=True, argv=(), network="bridge", container_port=8000,
                    host_port=None, bind_ip="127.0.0.1", gpus=0)


def make_engine(tmp_path, docker_host, cpu_base, script: str, log_stall_s: float = 20.0):
    container = docker_host.client.containers.create(
        cpu_base, entrypoint=["sh", "-c", script], environment={"HF_TOKEN": SECRET}, init=True,
        labels=L.managed("engine"), detach=True)
    engine = ContainerEngine(tmp_path, "http://127.0.0.1:9", stop_timeout_s=2, log_stall_s=log_stall_s,
                             secrets=[SECRET], multi_node=False)
    node = engine.attach(LAUNCH, docker_host, container)
    return engine, node, container


def start(engine, node) -> None:
    node.container.start()
    node.pump.start()
    engine.start_watchdog()


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def log_lines(engine) -> list[str]:
    return engine.engine_log.path.read_text().splitlines() if engine.engine_log.path.exists() else []


def test_logs_stream_while_running_are_redacted_and_teardown_removes(tmp_path, docker_host, cpu_base):
    engine, node, container = make_engine(
        tmp_path, docker_host, cpu_base,
        'for i in 1 2 3; do echo "line $i token=$HF_TOKEN"; sleep 0.2; done; echo "to stderr" >&2; sleep 600')
    try:
        start(engine, node)
        assert wait_for(lambda: len(log_lines(engine)) == 4)  # written while the container still runs
        assert engine.alive() and engine.exit_code() is None
        assert log_lines(engine) == ["line 1 token=***", "line 2 token=***", "line 3 token=***", "to stderr"]
    finally:
        engine.stop()
    engine.stop()  # idempotent
    with pytest.raises(docker.errors.NotFound):
        docker_host.client.containers.get(container.id)
    assert not engine.alive()
    notes = (tmp_path / "docker.log").read_text()
    assert "removed" in notes and "teardown complete" in notes
    for path in tmp_path.iterdir():
        assert SECRET not in path.read_text(), path


def test_exit_before_healthy_is_noticed_at_once(tmp_path, docker_host, cpu_base):
    engine, node, _ = make_engine(tmp_path, docker_host, cpu_base, 'echo "boom: bad flag" >&2; exit 3')
    try:
        start(engine, node)
        started = time.monotonic()
        with pytest.raises(EngineNeverHealthyError) as err:
            engine.wait_healthy(120, "build X rep 0")
        assert time.monotonic() - started < 10  # not the 120 s timeout
        assert "exit code 3" in str(err.value) and "boom: bad flag" in str(err.value)
        assert engine.exit_code() == 3
    finally:
        engine.stop()


class HangingStream:
    """A log stream that delivers nothing and never ends until closed (a hung daemon stream)."""

    def __init__(self, inner=None):
        self.inner = inner
        self.closed = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        if self.inner is not None:
            try:
                return next(self.inner)
            except StopIteration:
                self.inner = None  # the real stream ended; this one now hangs instead of ending
        self.closed.wait()
        raise StopIteration

    def close(self):
        if self.inner is not None:
            self.inner.close()
        self.closed.set()


def test_watchdog_reopens_a_stream_that_stopped_delivering(tmp_path, docker_host, cpu_base):
    """Faked: the first log stream hangs without data (daemon fault); the daemon itself is real."""
    engine, node, container = make_engine(
        tmp_path, docker_host, cpu_base, 'for i in $(seq 1 10); do echo "tick $i"; sleep 0.2; done; sleep 600',
        log_stall_s=1.0)
    real_logs = container.logs
    streams: list = []

    def logs(**kwargs):
        if kwargs.get("stream") and not streams:
            streams.append(HangingStream())
            return streams[0]
        return real_logs(**kwargs)

    container.logs = logs
    try:
        start(engine, node)
        assert wait_for(lambda: len(log_lines(engine)) == 10, timeout=30)
        assert log_lines(engine) == [f"tick {i}" for i in range(1, 11)]  # nothing lost, nothing twice
        assert node.pump.reopens >= 1 and streams[0].closed.is_set()
        assert "stopped delivering; reopened it" in (tmp_path / "docker.log").read_text()
    finally:
        engine.stop()


def test_watchdog_drains_a_stream_that_outlives_its_container(tmp_path, docker_host, cpu_base):
    """Faked: the stream stays open after the container exited (daemon fault)."""
    engine, node, container = make_engine(tmp_path, docker_host, cpu_base,
                                          'for i in 1 2 3 4 5; do echo "out $i"; done; exit 0')
    real_logs = container.logs
    wrapped: list = []

    def logs(**kwargs):
        if kwargs.get("stream") and not wrapped:
            wrapped.append(HangingStream(real_logs(**kwargs)))
            return wrapped[0]
        return real_logs(**kwargs)

    container.logs = logs
    try:
        start(engine, node)
        assert node.pump.finished.wait(30)  # the watchdog ended it
        assert log_lines(engine) == [f"out {i}" for i in range(1, 6)]
        assert "stayed open; draining it" in (tmp_path / "docker.log").read_text()
    finally:
        engine.stop()


class EndsEarly:
    """A log stream that ends after its first message while the container keeps running
    (a dropped connection or a restarted daemon)."""

    def __init__(self, inner):
        self.inner = inner
        self.delivered = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.delivered >= 1:
            self.inner.close()
            raise StopIteration
        self.delivered += 1
        return next(self.inner)

    def close(self):
        self.inner.close()


def test_stream_that_ends_while_the_container_runs_is_resumed(tmp_path, docker_host, cpu_base):
    """Faked: the first log stream ends early (a dropped connection); the daemon is real."""
    engine, node, container = make_engine(tmp_path, docker_host, cpu_base,
                                          'for i in $(seq 1 8); do echo "beat $i"; sleep 0.3; done; sleep 600')
    real_logs = container.logs
    wrapped: list = []

    def logs(**kwargs):
        if kwargs.get("stream") and not wrapped:
            wrapped.append(EndsEarly(real_logs(**kwargs)))
            return wrapped[0]
        return real_logs(**kwargs)

    container.logs = logs
    try:
        start(engine, node)
        assert wait_for(lambda: len(log_lines(engine)) == 8, timeout=30)
        assert log_lines(engine) == [f"beat {i}" for i in range(1, 9)]
        assert node.pump.reopens >= 1 and "ended early; reopened it" in (tmp_path / "docker.log").read_text()
    finally:
        engine.stop()


def test_teardown_releases_the_shm_regions_an_ipc_host_engine_claimed(tmp_path, docker_host, cpu_base):
    """A container sharing the host's IPC namespace (docker.ipc_host, the default) maps its offload
    region in the host's /dev/shm, where it outlives the container (kvrepro/deploy/docker/shm.py:
    measured, one per run that was still serving). The container here stands in for the engine: a
    shell script makes the region and claims it as the engine's executor does (the env var names the
    claims folder), plus claims that must not remove anything: a name that is a link on the host, a
    name that is not a region's, and a claim that is itself a link (another engine's region on the
    host carries its name). Real daemon, real /dev/shm."""
    import os
    import uuid

    from kvrepro.deploy.docker import shm

    tag = uuid.uuid4().hex[:12]
    region, linked = f"vllm_offload_{tag}.mmap", f"vllm_offload_{tag}-link.mmap"
    others = f"vllm_offload_{tag}-other.mmap"  # a region of an engine that is not this container's
    with open(f"/dev/shm/{others}", "wb") as fh:
        fh.write(b"x")
    keep = tmp_path / "host-file"
    keep.write_text("not the engine's")
    os.symlink(keep, f"/dev/shm/{linked}")
    script = (f'mkdir -p "$KVREPRO_SHM_CLAIMS" && head -c 4096 /dev/zero > /dev/shm/{region} && '
              f'for n in {region} {linked} passwd; do echo "{{}}" > "$KVREPRO_SHM_CLAIMS/$n"; done; '
              f'ln -s /etc/hostname "$KVREPRO_SHM_CLAIMS/{others}"; echo ready; sleep 600')
    container = docker_host.client.containers.create(
        cpu_base, entrypoint=["sh", "-c", script], environment=shm.engine_env(True), init=True, ipc_mode="host",
        labels=L.managed("engine"), detach=True)
    engine = ContainerEngine(tmp_path, "http://127.0.0.1:9", stop_timeout_s=2, log_stall_s=20,
                             secrets=[], multi_node=False)
    node = engine.attach(LAUNCH, docker_host, container)
    try:
        start(engine, node)
        assert wait_for(lambda: "ready" in log_lines(engine))
        assert os.path.isfile(f"/dev/shm/{region}")  # the host's /dev/shm: it would outlive the container
        assert shm.claimed_regions(container) == sorted([region, linked])  # "passwd" is no region's name
    finally:
        engine.stop()
        try:
            assert not os.path.exists(f"/dev/shm/{region}")
            assert os.path.islink(f"/dev/shm/{linked}") and keep.read_text() == "not the engine's"
            assert os.path.isfile(f"/dev/shm/{others}")
        finally:
            for name in (region, linked, others):
                if os.path.lexists(f"/dev/shm/{name}"):
                    os.unlink(f"/dev/shm/{name}")
    assert f"released /dev/shm region(s) {region} of {container.name} on local" in (tmp_path / "docker.log").read_text()
