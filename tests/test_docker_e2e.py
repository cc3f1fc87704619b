"""`kvrepro matrix run --target docker` end to end on the local daemon with the CPU base image.

The CPU base runs the same GPU-free engine as the sim target, inside images assembled from the
base by the docker target (patched files + probe), so builds A and D must get the same verdicts
on both targets; the probe's source hash in the container's log must be the hash of the patched
method on the host; and Ctrl-C must leave no container behind while keeping finished runs.
Needs dockerd and the CPU base (`bash .ci/docker-setup.sh`); fails instead of skipping under CI.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker.errors
import pytest
import yaml

from conftest import ROOT
from kvrepro.deploy.docker import labels as L
from kvrepro.deploy.docker.assemble import docker_dir
from test_docker_target import cpu_base, docker_host  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

PROBE_LINE = re.compile(r"kvrepro-probe: installed .*source_sha256=([0-9a-f]{64})")
SOURCE_HASH = r"""
import hashlib, inspect, sys
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler as S
print(hashlib.sha256(inspect.getsource(S.update_state_after_alloc).encode()).hexdigest())
"""


def docker_matrix(folder: Path, base_image: str) -> Path:
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data.update(target="docker", base_image=base_image)
    # what the engine in the image can check differs (see the D assertion below): no expectations
    data.pop("expect", None)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "matrix.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    if not (folder / "builds").exists():
        os.symlink(ROOT / "builds", folder / "builds")
    return folder / "matrix.yaml"


def kvrepro(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800, env=env)


def managed_containers(host) -> list:
    return host.client.containers.list(all=True, filters=L.MANAGED_FILTER, ignore_removed=True)


def test_docker_verdicts_match_sim_for_a_and_d(tmp_path, docker_host, cpu_base, overlays, runtime_python,
                                               runtime_scripts):
    matrix = docker_matrix(tmp_path / "m", cpu_base)
    secret = "hf_" + "e2e" * 10
    env = dict(os.environ, HF_TOKEN=secret)
    common = ["matrix", "run", "-m", str(matrix), "--build", "A", "--build", "D", "--reps", "1", "--json"]
    cache_volume = "kvrepro-vllm-cache-0.26.0"  # docker.vllm_cache's default, for the image's release
    try:
        docker_host.client.volumes.get(cache_volume).remove()  # so that this run is what fills it
    except docker.errors.NotFound:
        pass
    docker_proc = kvrepro(*common, "--target", "docker", "--results", str(tmp_path / "docker"), env=env)
    assert docker_proc.returncode == 0, docker_proc.stderr[-3000:]
    on_docker = json.loads(docker_proc.stdout)

    # the sim target's outcomes for A and D (tests/test_matrix_e2e.py runs them): not run again
    # here, which cost one more engine start and 600 requests
    for build, sim_outcome in (("A", "target"), ("D", "none")):
        d = on_docker["builds"][build]["runs"][0]
        assert d["outcome"] == sim_outcome, (build, d)
        assert d["trigger_count"] > 0 and d["state_count"] > 0, (build, d)
    a = on_docker["builds"]["A"]["runs"][0]
    assert a["verdict"] == "CRASH" and a["outcome"] == "target", a
    # D serves everything on both; whether its KV was checked depends on the engine in the image
    # (a base image made before the shadow KV existed has none: kv_check "off", verdict SURVIVED)
    d = on_docker["builds"]["D"]["runs"][0]
    assert (d["verdict"], d["kv_check"]) in {("SURVIVED", "off"), ("CORRUPT", "corrupt")}, d
    assert managed_containers(docker_host) == []

    # vLLM's model-info cache outlived the containers in the release's volume, for the next engine
    volume = docker_host.client.volumes.get(cache_volume)
    assert volume.attrs["Labels"] == {L.LABEL_VOLUME: "vllm-cache"}
    listing = docker_host.client.containers.run(cpu_base, entrypoint=["ls", "/cache/modelinfos"], remove=True,
                                                volumes={cache_volume: {"bind": "/cache", "mode": "ro"}})
    cached = listing.decode().split()
    assert any(name.endswith("Qwen3NextForCausalLM.json") for name in cached), cached
    assert any(name.endswith("Qwen3NextMTP.json") for name in cached), cached

    # the probe in the container hashed exactly the method the host patched for that build
    for build in ("A", "D"):
        run_dir = Path(on_docker["builds"][build]["runs"][0]["run_dir"])
        match = PROBE_LINE.search((run_dir / "engine.log").read_text())
        assert match, f"no probe line in {run_dir / 'engine.log'}"
        built = json.loads((run_dir.parent / "build.json").read_text())
        source_root = docker_dir() / "builds" / built["manifest"]["key"][:16]
        proc = runtime_scripts.run(runtime_python, ["-c", SOURCE_HASH],
                                   env=dict(os.environ, PYTHONPATH=str(source_root)), timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert match.group(1) == proc.stdout.strip().splitlines()[-1], build
        labels = built["manifest"]["image"]["labels"]
        assert labels[L.OCI_BASE_DIGEST] == docker_host.client.images.get(cpu_base).id
        assert [p["name"] for p in json.loads(labels[L.LABEL_PATCHES])] == \
            [p["name"] for p in built["manifest"]["patches"]]

    # the token went to the container by name only: no recorded file holds its value
    for path in (tmp_path / "docker").rglob("*"):
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), path
    assert secret not in docker_proc.stdout + docker_proc.stderr


def test_ctrl_c_leaves_no_container_and_keeps_finished_runs(tmp_path, docker_host, cpu_base):
    matrix = docker_matrix(tmp_path / "m", cpu_base)
    results = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(matrix), "--target",
                             "docker", "--build", "D", "--reps", "3", "--results", str(results)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 900
        # wait until a repetition is recorded while another one's engine container is up
        while time.monotonic() < deadline:
            done = list(results.glob("*/D/*/verdict.json"))
            running = [c for c in managed_containers(docker_host) if c.status == "running"]
            if done and running:
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("no repetition finished while another one ran")
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)  # the impatient second Ctrl-C: stop at once
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert managed_containers(docker_host) == []
    verdict = json.loads(done[0].read_text())  # the finished run is intact and complete
    assert verdict["verdict"] not in ("INFRA", "INTERRUPTED"), verdict
    for name in ("engine.log", "load.jsonl", "manifest.json", "docker.log"):
        assert (done[0].parent / name).stat().st_size > 0, name
