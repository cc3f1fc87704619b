"""Docker orphans: a signalled docker run leaves no container, `kvrepro clean` removes a dead kvrepro's
containers and leaves live runs alone, the next run reaps a killed one's (issue 8's faults, injected for
real: tests/reliability.py says how).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import require
from kvrepro.deploy.docker.hosts import remove_quietly
from reliability import (TOKEN, kvrepro, show, small_matrix, start_run, wait_until)


@pytest.fixture(scope="module")
def docker_base():
    try:
        import docker

        client = docker.from_env(timeout=20)
        client.ping()
    except Exception as exc:  # noqa: BLE001
        require(False, f"no Docker daemon answers: {exc}")
    tag = "kvrepro/vllm-openai-cpu:v0.26.0"
    try:
        client.images.get(tag)
    except Exception:  # noqa: BLE001
        require(False, f"{tag} is missing: run `bash .ci/docker-setup.sh`")
    yield client
    client.close()


def owned_containers(client, pid: int) -> list:
    from kvrepro.deploy.docker import labels as L

    return client.containers.list(all=True, filters={"label": f"{L.LABEL_OWNER_PID}={pid}"}, ignore_removed=True)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_signal_leaves_no_container_docker(tmp_path, docker_base, sig):
    """The same with the docker target: no container of the run stays (SIGKILL: the session's
    watcher removes them, and the next kvrepro command would too), the run reads back
    interrupted / aborted, and the token is nowhere under results/."""
    matrix = small_matrix(tmp_path, target="docker", base_image="kvrepro/vllm-openai-cpu:v0.26.0")
    results = tmp_path / "results"
    proc = start_run(matrix, results, "-b", "A", "-b", "B")
    try:
        assert wait_until(lambda: len([c for c in owned_containers(docker_base, proc.pid) if c.status == "running"]) >= 1
                          or proc.poll() is not None, 900, every=1)
        assert proc.poll() is None, proc.stderr_text()[-3000:]
        proc.send_signal(sig)
        proc.wait(timeout=120)
        if sig == signal.SIGKILL:
            kvrepro("clean", "--dry-run")  # "the next kvrepro command"; the watcher normally has done it
        assert wait_until(lambda: not owned_containers(docker_base, proc.pid), 60, every=0.5), \
            [c.name for c in owned_containers(docker_base, proc.pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for container in owned_containers(docker_base, proc.pid):
            remove_quietly(container)  # may be being removed by the reaper already
    stderr = proc.stderr_text()
    assert "Traceback" not in stderr, stderr[-3000:]
    run = show(results)
    assert run["status"] == ("interrupted" if sig == signal.SIGTERM else "aborted")
    leaked = subprocess.run(["grep", "-rl", TOKEN, str(results)], capture_output=True, text=True)
    assert leaked.stdout == "", leaked.stdout


@pytest.mark.docker
def test_clean_removes_orphans_and_leaves_live_runs_alone(docker_base):
    """Two containers labelled as kvrepro's: one owned by this (live) process, one by a process
    that has exited. `kvrepro clean` removes only the orphan; --all removes both."""
    from kvrepro import lifetime
    from kvrepro.deploy.docker import labels as L

    dead = subprocess.Popen(["true"])
    dead.wait()
    made = []
    try:
        for name, record in (("live", lifetime.owner()), ("orphan", {"pid": str(dead.pid), "host": lifetime.hostname(),
                                                                     "start": "1"})):
            labels = {L.LABEL_MANAGED: "1", L.LABEL_KIND: "engine", L.LABEL_SESSION: f"test-{os.getpid()}",
                      L.LABEL_OWNER_PID: record["pid"], L.LABEL_OWNER_HOST: record["host"],
                      L.LABEL_OWNER_START: record["start"]}
            made.append(docker_base.containers.create("kvrepro/vllm-openai-cpu:v0.26.0", entrypoint=["true"],
                                                      labels=labels, name=f"kvrepro-reliability-{name}-{os.getpid()}"))
        proc = kvrepro("clean", "--json")
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        report = json.loads(proc.stdout)
        removed = {c["name"] for r in report for c in r["containers"]}
        kept = {c["name"] for r in report for c in r["kept"]}
        assert f"kvrepro-reliability-orphan-{os.getpid()}" in removed
        assert f"kvrepro-reliability-live-{os.getpid()}" in kept
        left = {c.name for c in docker_base.containers.list(all=True, filters={"label": f"{L.LABEL_SESSION}=test-{os.getpid()}"})}
        assert left == {f"kvrepro-reliability-live-{os.getpid()}"}
    finally:
        for container in made:
            remove_quietly(container)


@pytest.mark.docker
def test_next_docker_run_reaps_containers_of_a_killed_kvrepro(tmp_path, docker_base):
    """A container whose kvrepro was SIGKILLed (its owner pid is a real process that has exited)
    is removed when the next docker-target kvrepro connects to the host; a live owner's stays."""
    from kvrepro import lifetime
    from kvrepro.deploy.docker import labels as L
    from kvrepro.deploy.docker.hosts import local_host_spec
    from kvrepro.deploy.docker.target import DockerTarget
    from kvrepro.spec.matrix import load_matrix

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    live_record = lifetime.owner()
    dead_record = lifetime.owner(victim.pid)
    victim.kill()  # SIGKILL, as a CI runner would
    victim.wait()
    made = []
    try:
        for name, record in (("live", live_record), ("dead", dead_record)):
            labels = {L.LABEL_MANAGED: "1", L.LABEL_KIND: "engine", L.LABEL_SESSION: f"reap-{os.getpid()}",
                      L.LABEL_OWNER_PID: record["pid"], L.LABEL_OWNER_HOST: record["host"],
                      L.LABEL_OWNER_START: record["start"]}
            made.append(docker_base.containers.create("kvrepro/vllm-openai-cpu:v0.26.0", entrypoint=["sleep", "600"],
                                                      labels=labels, name=f"kvrepro-reap-{name}-{os.getpid()}"))
            made[-1].start()
        target = DockerTarget(load_matrix(small_matrix(tmp_path, target="docker")))
        try:
            target.host(local_host_spec())
        finally:
            target.close()
        left = {c.name for c in docker_base.containers.list(all=True, filters={"label": f"{L.LABEL_SESSION}=reap-{os.getpid()}"})}
        assert left == {f"kvrepro-reap-live-{os.getpid()}"}
    finally:
        for container in made:
            remove_quietly(container)
