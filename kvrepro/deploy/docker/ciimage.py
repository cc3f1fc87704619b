"""The CI image: kvrepro installed on a CPU-only Debian, for a release-validation job that installs
kvrepro rather than cloning it (`docker run IMAGE suite run --base 0.26.0`).

It is built on the local daemon from the same local layers as the docker target's CPU base
(basecpu.py: debootstrap + docker import, then torch and vLLM's dependencies), so no registry is
involved. Its own layer is built with no network: everything it installs comes in the build
context, fetched on this machine through its package clients (pip, apt).
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker.errors
import requests

from ... import paths
from ...errors import BadInputError, SetupError
from . import labels as L
from .basecpu import DATA, _deps_image, _h, _os_image, _scratch, find_torch_wheel, torch_version
from .hosts import DockerHost, connect, local_host_spec
from ...builds.wheel import fetch_wheel, vllm_requirements

CI_REPO = "kvrepro/ci"
DEB_PACKAGES = ("patch",)  # GNU patch applies the build matrix's patch stacks (builds/patching.py)

OnLine = Callable[[str], None]


def default_tag(version: str) -> str:
    return f"{CI_REPO}:{version}"


def _run(cmd: list[str], cwd: Path, what: str, on_line: OnLine) -> None:
    on_line(f"{what}: {' '.join(cmd[:6])} ...")
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n  ".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise SetupError(f"{what} failed (exit {proc.returncode}):\n  {tail}")


def build_kvrepro_wheel(dest: Path, on_line: OnLine) -> Path:
    """A wheel of the checkout this kvrepro runs from (an installed kvrepro has none: pass --wheel).

    pip builds in the checkout's own build/ folder, so two builds at once (two `images ci`, or a
    test building the wheel beside one) would mix their files: they take turns on a lock there,
    held for the wheel only, not for the image build that follows."""
    if not (paths.SOURCE_ROOT / "pyproject.toml").is_file():
        raise BadInputError("kvrepro runs from an installed package, not a checkout: pass --wheel PATH/kvrepro-*.whl")
    build = paths.SOURCE_ROOT / "build"
    build.mkdir(exist_ok=True)
    with open(build / ".kvrepro-wheel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dest), str(paths.SOURCE_ROOT)],
             dest, "building the kvrepro wheel", on_line)
    return next(dest.glob("kvrepro-*.whl"))


def _context(work: Path, kvrepro_wheel: Path, vllm_wheel: Path, deps_image_id: str, version: str,
             on_line: OnLine) -> str:
    """Fill the build context folder; return the Dockerfile."""
    wheels, debs, vllm = work / "wheels", work / "debs", work / "vllm"
    for folder in (wheels, debs, vllm):
        folder.mkdir()
    shutil.copy2(kvrepro_wheel, wheels / kvrepro_wheel.name)
    # kvrepro's dependencies for the image's python (3.11, as this one's: basecpu.SUITE)
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version", "3.11",
          "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64", "-d", str(wheels),
          str(wheels / kvrepro_wheel.name)], work, "downloading kvrepro's dependencies", on_line)
    _run(["apt-get", "download", *DEB_PACKAGES], debs, "downloading " + ", ".join(DEB_PACKAGES), on_line)
    for source in vllm_wheel.parent.glob(vllm_wheel.name + "*"):  # the wheel and its memoised sha256
        try:
            (vllm / source.name).hardlink_to(source)
        except OSError:
            shutil.copy2(source, vllm / source.name)
    return ((DATA / "ci.Dockerfile").read_text().replace("{deps_image}", deps_image_id)
            .replace("{kvrepro_wheel}", kvrepro_wheel.name).replace("{version}", version))


def build_ci_image(version: str, kvrepro_wheel: Path | None = None, tag: str | None = None,
                   host: DockerHost | None = None, on_line: OnLine = lambda line: None) -> dict[str, Any]:
    """Build the CI image for vLLM ``version`` on the local daemon; return its tag and id."""
    import time

    started = time.monotonic()
    own = host is None
    host = host or connect(local_host_spec())
    tag = tag or default_tag(version)
    work = Path(tempfile.mkdtemp(prefix="kvrepro-ci-", dir=_scratch()))
    try:
        os_image = _os_image(host, on_line, False)[0]
        vllm_wheel = fetch_wheel(version)
        torch_wheel = find_torch_wheel(torch_version(), on_line)
        deps_image = _deps_image(host, os_image, torch_wheel, vllm_requirements(vllm_wheel), on_line, False)[0]
        if kvrepro_wheel is None:
            (work / "dist").mkdir()
            kvrepro_wheel = build_kvrepro_wheel(work / "dist", on_line)
        elif not kvrepro_wheel.is_file():
            raise BadInputError(f"--wheel {kvrepro_wheel}: no such file")
        context = work / "context"
        context.mkdir()
        dockerfile = _context(context, kvrepro_wheel, vllm_wheel, deps_image.id, version, on_line)
        (context / "Dockerfile").write_text(dockerfile)
        labels = L.image_labels("ci", **{L.LABEL_KEY: _h({"dockerfile": dockerfile, "wheel": kvrepro_wheel.name})},
                                **{"io.kvrepro.vllm.version": version})
        on_line(f"CI layer: building {tag}")
        try:
            for chunk in host.client.api.build(path=str(context), tag=tag, labels=labels, rm=True, forcerm=True,
                                               decode=True, network_mode="none"):
                if chunk.get("stream", "").strip():
                    on_line(chunk["stream"].rstrip())
                if "error" in chunk or "errorDetail" in chunk:
                    raise SetupError(f"CI image build failed: {chunk.get('error') or chunk.get('errorDetail')}")
        except (docker.errors.APIError, requests.RequestException) as exc:
            raise SetupError(f"CI image build failed: {getattr(exc, 'explanation', None) or exc}") from None
        image = host.client.images.get(tag)
        return {"tag": tag, "image_id": image.id, "base": deps_image.tags[0] if deps_image.tags else deps_image.id,
                "kvrepro_wheel": kvrepro_wheel.name, "vllm_wheel": vllm_wheel.name,
                "size_mb": round((image.attrs.get("Size") or 0) / 1e6), "seconds": round(time.monotonic() - started, 1)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if own:
            host.close()
