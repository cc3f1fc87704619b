"""The docker target against the local daemon and the CPU base image (real Docker, real images).

Image assembly (labels, reuse, patch failures), and every named way a run fails before the
engine serves: each must come back from the runner as an INFRA verdict with a reason, never a
traceback, and leave no container behind. Needs dockerd and `kvrepro images base-cpu`
(`.ci/docker-setup.sh` does both); fails instead of skipping when CI is set.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import tarfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, require
from kvrepro.deploy.docker import DockerTarget
from kvrepro.deploy.docker import labels as L
from kvrepro.deploy.docker.records import ImageManifest
from kvrepro.deploy.docker.basecpu import default_tag
from kvrepro.deploy.docker.errors import DockerInfraError
from kvrepro.deploy.docker.hosts import connect, local_host_spec
from kvrepro.builds.records import BuildArtifact, BuildManifest
from kvrepro.records import Outcome, Verdict
from kvrepro.matrix.runner import SilentProgress, run_one
from kvrepro.spec.matrix import load_matrix

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def docker_host():
    try:
        host = connect(local_host_spec(), timeout=20)
    except DockerInfraError as exc:
        require(False, f"no Docker daemon answers: {exc}")
    yield host
    host.close()


@pytest.fixture(scope="module")
def cpu_base(docker_host) -> str:
    """The CPU base image, with its engine layer brought up to date with this checkout's engine
    (a second or two when nothing changed; the heavy layers are never rebuilt here)."""
    import docker.errors

    from kvrepro.deploy.docker.basecpu import build_base_cpu

    version = load_matrix(ROOT / "matrix.yaml").matrix.base
    tag = default_tag(version)
    try:
        docker_host.client.images.get(tag)
    except docker.errors.ImageNotFound:
        require(False, f"{tag} is missing: run `bash .ci/docker-setup.sh` (or `kvrepro images base-cpu`)")
    build_base_cpu(version, host=docker_host)
    return tag


def docker_matrix(folder: Path, base_image: str, **sections):
    """A copy of the default matrix (and its patches) for the docker target, with overrides."""
    folder.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data.update(target="docker", base_image=base_image)
    for key, value in sections.items():
        data[key] = value
    if not (folder / "builds").exists():
        shutil.copytree(ROOT / "builds", folder / "builds")
    (folder / "matrix.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return load_matrix(folder / "matrix.yaml")


def session_containers(host) -> list:
    return host.client.containers.list(all=True, filters={"label": f"{L.LABEL_SESSION}={L.SESSION}"},
                                      ignore_removed=True)


def read_from_image(host, image: str, path: str) -> bytes:
    container = host.client.containers.create(image, entrypoint=["true"], labels=L.managed("probe"))
    try:
        stream, _ = container.get_archive(path)
        tar = tarfile.open(fileobj=io.BytesIO(b"".join(stream)))
        return tar.extractfile(tar.next()).read()
    finally:
        container.remove(force=True)


def test_assembled_images_carry_base_and_patch_labels(tmp_path, docker_host, cpu_base):
    loaded = docker_matrix(tmp_path, cpu_base)
    base = docker_host.client.images.get(cpu_base)
    target = DockerTarget(loaded)
    try:
        artifacts = {p.name: (p, target.prepare(p)) for p in loaded.plans()}
    finally:
        target.close()
    tags = set()
    for name, (plan, artifact) in artifacts.items():
        assert artifact.ok, artifact.error
        assert artifact.ref.startswith(f"kvrepro/vllm:{plan.base}-") and len(artifact.ref.rsplit("-", 1)[1]) == 12
        tags.add(artifact.ref)
        image = docker_host.client.images.get(artifact.ref)
        labels = image.labels
        assert labels[L.OCI_BASE_NAME] == cpu_base
        assert labels[L.OCI_BASE_DIGEST] == base.id  # a local-only base: its image id is the digest
        assert json.loads(labels[L.LABEL_PATCHES]) == [{"name": p.name, "sha256": p.sha256} for p in plan.patches]
        manifest = json.loads(labels[L.LABEL_MANIFEST])
        assert manifest["base_digest"] == base.id and manifest["vllm_version_in_base"] == "0.26.0"
        assert [p["sha256"] for p in manifest["patches"]] == [p.sha256 for p in plan.patches]
        assert labels[L.LABEL_IMAGE] == "assembled"
        assert labels[L.LABEL_MANAGED] == ""  # so that containers a user runs from it are not "ours"

        # the image holds exactly the host's patched file, and the probe loads via a .pth
        site = manifest["site_dir"]
        for rel, sums in manifest["files"].items():
            in_image = read_from_image(docker_host, artifact.ref, f"{site}/{rel}")
            assert hashlib.sha256(in_image).hexdigest() == sums["after"] != sums["before"]
            assert in_image == (Path(artifact.source_root) / rel).read_bytes()
        assert read_from_image(docker_host, artifact.ref, f"{site}/kvrepro_probe.pth") == b"import kvrepro_probe\n"
        probe = read_from_image(docker_host, artifact.ref, f"{site}/kvrepro_probe.py")
        assert hashlib.sha256(probe).hexdigest() == labels[L.LABEL_PROBE]
    assert len(tags) == len(loaded.plans())  # every build (A-E) differs


def test_identical_inputs_reuse_the_image(tmp_path, docker_host, cpu_base):
    loaded = docker_matrix(tmp_path, cpu_base)
    [plan] = loaded.plans(["D"])
    first_target, second_target = DockerTarget(loaded), DockerTarget(loaded)
    try:
        first = first_target.prepare(plan)
        started = time.monotonic()
        second = second_target.prepare(plan)
        seconds = time.monotonic() - started
    finally:
        first_target.close()
        second_target.close()
    assert first.ok and second.ok
    assert second.reused and second.ref == first.ref
    assert ImageManifest.of(second.manifest).image.id == ImageManifest.of(first.manifest).image.id
    assert seconds <= 15.0


def test_patch_that_does_not_apply_names_step_and_patch(tmp_path, docker_host, cpu_base):
    patches = yaml.safe_load((ROOT / "matrix.yaml").read_text())["patches"]
    patches["pr-52807"].pop("sha256", None)  # the pin would (rightly) refuse the edited file
    docker_matrix(tmp_path, cpu_base, patches=patches)
    patch = tmp_path / "builds" / "pr-52807.patch"
    lines = patch.read_text().splitlines(keepends=True)
    first_context = next(i for i, l in enumerate(lines) if l.startswith("@@")) + 1
    lines[first_context] = " this context line is not in vLLM 0.26.0\n"
    patch.write_text("".join(lines))
    loaded = load_matrix(tmp_path / "matrix.yaml")  # re-read: patch sha256s are taken at load
    target = DockerTarget(loaded)
    try:
        results = {p.name: target.prepare(p) for p in loaded.plans(["A", "B"])}
    finally:
        target.close()
    assert results["A"].ok  # the other builds go on
    broken = results["B"]
    assert not broken.ok and broken.ref is None
    assert "step 'apply patch pr-52807'" in broken.error and "hunk #1" in broken.error
    assert "Traceback" not in broken.error


@pytest.mark.parametrize("pull", [False, True])
def test_missing_base_image_is_image_missing_and_infra(tmp_path, docker_host, pull):
    loaded = docker_matrix(tmp_path, "kvrepro/no-such-base:v0", docker={"pull": pull})
    [plan] = loaded.plans(["A"])
    target = DockerTarget(loaded)
    try:
        artifact = target.prepare(plan)
        result = run_one(loaded, target, artifact, tmp_path / "run", 0, SilentProgress(), threading.Event())
    finally:
        target.close()
    assert not artifact.ok and artifact.manifest.error_kind == "image_missing"
    assert "kvrepro/no-such-base:v0 is not present" in artifact.error
    assert "kvrepro images base-cpu" in artifact.error
    assert result.verdict is Verdict.INFRA and result.outcome is Outcome.INFRA
    assert "no-such-base" in result.infra_error


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_failure_cases(tmp_path: Path, cpu_base: str):
    """(name, matrix for the failing run, expected words in the INFRA reason) per failure."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    dead_sock = tmp_path / "nowhere" / "docker.sock"
    cases = [
        ("never_healthy", {"docker": {"health_timeout_s": 1}}, "did not answer 200 within 1s"),
        ("port_in_use", {"docker": {"api_port": port}}, f"port {port} is already in use"),
        ("daemon_down", {"hosts": [{"name": "dead", "docker": f"unix://{dead_sock}"}]}, "no Docker daemon socket"),
        ("unknown_host", {"hosts": [{"name": "a", "docker": "unix:///var/run/docker.sock"}],
                          "docker": {"nodes": ["a", "gpu-7"]}}, "'gpu-7'"),
        ("unresolvable_host", {"hosts": [{"name": "far", "docker": "ssh://ops@no-such-gpu-node.invalid"}]},
         "Could not resolve hostname"),
    ]
    return busy, cases


def test_start_failures_are_named_infra_and_leave_nothing(tmp_path, docker_host, cpu_base, monkeypatch):
    """Faked: `unresolvable_host` stands in for a remote ssh:// host (none exists here)."""
    good = docker_matrix(tmp_path / "good", cpu_base)
    [plan] = good.plans(["A"])
    builder = DockerTarget(good)
    try:
        artifact = builder.prepare(plan)
    finally:
        builder.close()
    assert artifact.ok, artifact.error
    secret = "hf_" + "k" * 30
    monkeypatch.setenv("HF_TOKEN", secret)
    busy, cases = _start_failure_cases(tmp_path, cpu_base)
    seen_env: list[str] = []

    def watch_env(stop: threading.Event) -> None:
        # the token reaches the container's environment (and only that): look while it exists
        while not stop.is_set():
            for c in session_containers(docker_host):
                seen_env.extend(c.attrs.get("Config", {}).get("Env") or [])
            time.sleep(0.2)

    try:
        for name, sections, words in cases:
            loaded = docker_matrix(tmp_path / name, cpu_base, **sections)
            target = DockerTarget(loaded)
            stop = threading.Event()
            watcher = threading.Thread(target=watch_env, args=(stop,), daemon=True)
            watcher.start()
            run_dir = tmp_path / name / "run"
            try:
                result = run_one(loaded, target, artifact, run_dir, 0, SilentProgress(), threading.Event())
            finally:
                stop.set()
                watcher.join()
                target.close()
            assert result.verdict is Verdict.INFRA, (name, result)
            assert words in result.infra_error, (name, result.infra_error)
            assert "Traceback" not in result.infra_error
            assert session_containers(docker_host) == [], name
            for path in run_dir.rglob("*"):
                if path.is_file():
                    assert secret not in path.read_text(errors="replace"), path
    finally:
        busy.close()
    assert f"HF_TOKEN={secret}" in seen_env  # passed by name from our environment into the container

    # an image removed after its build: image missing at start
    gone = BuildArtifact(plan=plan, ref="kvrepro/vllm:0.26.0-000000000000", manifest=BuildManifest())
    target = DockerTarget(good)
    try:
        result = run_one(good, target, gone, tmp_path / "gone", 0, SilentProgress(), threading.Event())
    finally:
        target.close()
    assert result.verdict is Verdict.INFRA and "is not there" in result.infra_error


def test_hosts_check_reports_each_host(tmp_path, docker_host, cpu_base):
    """Faked: the ssh:// host is an unresolvable name (no remote host exists here)."""
    import subprocess
    import sys

    loaded = docker_matrix(tmp_path, cpu_base, hosts=[
        {"name": "here", "docker": "unix:///var/run/docker.sock"},
        {"name": "gone", "docker": f"unix://{tmp_path}/none.sock"},
        {"name": "far", "docker": "ssh://ops@no-such-gpu-node.invalid", "gpus": 4},
    ])
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "hosts", "check", "--json", "-m", str(loaded.path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 3, proc.stderr  # some host is down
    reports = {r["name"]: r for r in json.loads(proc.stdout)}
    assert reports["here"]["ok"] and reports["here"]["base_image"] == {"ref": cpu_base, "present": True}
    assert set(reports["here"]["ports"]) == {"8000", "29501"}
    assert set(reports["here"]["ports"].values()) <= {"free", "in use"}  # a local host: known either way
    assert reports["gone"]["ok"] is False and reports["gone"]["error_kind"] == "daemon_down"
    assert reports["far"]["ok"] is False and reports["far"]["error_kind"] == "unknown_host"
    assert "Traceback" not in proc.stderr


def test_clean_removes_labelled_leftovers_only(tmp_path, docker_host, cpu_base):
    import subprocess
    import sys

    leftover = docker_host.client.containers.create(cpu_base, entrypoint=["sleep", "600"],
                                                    labels={L.LABEL_MANAGED: "1", L.LABEL_KIND: "engine"},
                                                    name=f"kvrepro-leftover-{os.getpid()}")
    mine = docker_host.client.containers.create(cpu_base, entrypoint=["sleep", "600"], name=f"not-kvrepro-{os.getpid()}")
    cache = docker_host.client.volumes.create(f"kvrepro-vllm-cache-test-{os.getpid()}",
                                              labels={L.LABEL_VOLUME: "vllm-cache"})
    other_volume = docker_host.client.volumes.create(f"not-kvrepro-{os.getpid()}")
    leftover.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "clean", "--json", "-m", str(tmp_path / "none.yaml")],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, proc.stderr  # a named matrix that does not exist is bad input
        proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "clean", "--json"],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr
        temp, report = json.loads(proc.stdout)  # the system temp folder's entry, then the host's
        assert "temp" in temp and temp["containers"] == []
        assert leftover.name in [c["name"] for c in report["containers"]]
        names = [c.name for c in docker_host.client.containers.list(all=True)]
        assert leftover.name not in names and mine.name in names
        assert "volumes" not in report  # the caches go with the images only
        # --images takes the per-release vLLM cache volumes too, and no other volume (dry run here:
        # the assembled images stay for the other tests)
        proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "clean", "--images", "--dry-run", "--json"],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)[1]
        assert cache.name in report["volumes"] and other_volume.name not in report["volumes"]
        assert {v.name for v in docker_host.client.volumes.list()} >= {cache.name, other_volume.name}
    finally:
        cache.remove(force=True)
        other_volume.remove(force=True)
        mine.remove(force=True)
        try:
            leftover.remove(force=True)
        except Exception:
            pass


def test_label_values_survive_the_dockerfile_verbatim(docker_host, cpu_base):
    """Labels go through a Dockerfile LABEL line; quotes, backslashes and `$` must not be
    interpreted (a `$HOME` in a patch's upstream URL must stay `$HOME`)."""
    from kvrepro.deploy.docker.assemble import _label_word, _tar_of

    values = {"a.quote": 'say "hi"', "a.dollar": "$HOME and ${PATH}", "a.backslash": "C:\\dir\\n",
              "a.json": json.dumps({"k": ["v", 1], "p": "x=y z"})}
    base_id = docker_host.client.images.get(cpu_base).id
    dockerfile = f"FROM {base_id}\nLABEL " + " ".join(f"{_label_word(k)}={_label_word(v)}" for k, v in values.items())
    tag = f"kvrepro/label-test:{os.getpid()}"
    try:
        for _ in docker_host.client.api.build(fileobj=io.BytesIO(_tar_of({"Dockerfile": dockerfile.encode()})),
                                              custom_context=True, tag=tag, rm=True, forcerm=True, decode=True):
            pass
        labels = docker_host.client.images.get(tag).labels
        assert {k: labels[k] for k in values} == values
    finally:
        try:
            docker_host.client.images.remove(tag, force=True)
        except Exception:
            pass


def test_gpu_count_on_a_host_without_gpus_is_unknown_not_an_error(docker_host, cpu_base):
    """No GPU here: the device request fails and `hosts check` must report None, not crash."""
    from kvrepro.deploy.docker.hosts import count_gpus

    assert count_gpus(docker_host, cpu_base) is None
    assert session_containers(docker_host) == []


def test_interrupt_makes_a_starting_engine_give_up_at_once(tmp_path, docker_host, cpu_base):
    """Ctrl-C while an engine starts (Target.interrupt): start() raises a named InfraError within
    a second or two instead of waiting out the health timeout, and removes the container."""
    from kvrepro.deploy.docker.errors import EngineStartCancelled

    loaded = docker_matrix(tmp_path, cpu_base, docker={"health_timeout_s": 600})
    [plan] = loaded.plans(["A"])
    target = DockerTarget(loaded)
    try:
        artifact = target.prepare(plan)
        timer = threading.Timer(1.0, target.interrupt)
        timer.start()
        started = time.monotonic()
        with pytest.raises(EngineStartCancelled, match="interrupted while the engine was starting"):
            target.start(artifact, tmp_path / "run", 0)
        assert time.monotonic() - started < 15
        assert session_containers(docker_host) == []
    finally:
        target.close()
