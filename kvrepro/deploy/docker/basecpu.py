"""The CPU base image: a `vllm/vllm-openai`-shaped image that runs with no GPU and no registry.

Tests and laptops have neither a GPU nor (here) a registry, yet the docker target must be
exercised for real. So the image is made from nothing but Debian's archive and PyPI:

1. OS layer: `debootstrap` a minimal Debian (its python3 is 3.11) and `docker import` it.
2. torch (CPU) + vLLM's pure-Python requirements, pip-installed system-wide (as vllm-openai does).
3. The vLLM release wheel itself (`--no-deps`, its compiled kernels are simply never loaded).
4. kvrepro's vLLM plugin (the GPU-free platform and executor, ``kvrepro_sim`` entry point) and a
   `vllm` shim: with no GPU present, `vllm serve ARGS` is vLLM's own `vllm serve ARGS` with the
   plugin switched on (``KVREPRO_SIM=1``). This is the only layer that changes with kvrepro's code.

Steps 2 and 3 run in a container with the wheels mounted read-only and are committed, so the
wheels never become part of a layer. Every step's image is tagged with a hash of its inputs
and reused while they do not change; step 4's tag carries the engine sources' hash.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker.errors
import requests
from docker.types import Mount

from ... import paths
from ...builds.plugin_dist import dist_info_files
from ...errors import SetupError
from . import labels as L
from .hosts import DockerHost, connect, local_host_spec, remove_quietly
from ...builds.wheel import fetch_wheel, vllm_requirements, wheel_sha256
from ...builds.runtime import TORCH_PIN

FORMAT = 2
CPU_REPO = "kvrepro/vllm-openai-cpu"
SUITE = "bookworm"  # python3 3.11: matches the cp311 CPU torch wheel
MIRROR = os.environ.get("KVREPRO_DEBIAN_MIRROR", "http://deb.debian.org/debian")
OS_PACKAGES = ("python3", "python3-pip", "ca-certificates")
CA_BUNDLE_CANDIDATES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
DATA = paths.PACKAGE_ROOT / "data" / "docker"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

OnLine = Callable[[str], None]


def _quiet(line: str) -> None:
    pass


def default_tag(version: str) -> str:
    return f"{CPU_REPO}:v{version}"


def _h(material: Any) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    return wheel_sha256(path)  # memoised next to the file: hashing 300 MB once is enough


def _image(host: DockerHost, tag: str, key: str):
    try:
        image = host.client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    return image if (image.labels or {}).get(L.LABEL_KEY) == key else None


def _labels(kind: str, key: str, **extra: str) -> dict[str, str]:
    return L.image_labels(kind, **{L.LABEL_KEY: key}, **extra)


def _change_labels(labels: dict[str, str]) -> list[str]:
    return [f"LABEL {json.dumps(k)}={json.dumps(v)}" for k, v in labels.items()]


# ------------------------------------------------------------------ inputs


def torch_version() -> str:
    return TORCH_PIN.split("==", 1)[1] if "==" in TORCH_PIN else TORCH_PIN


def find_torch_wheel(version: str, on_line: OnLine = _quiet) -> Path:
    """The CPU torch wheel for cp311 (the base's python): KVREPRO_TORCH_WHEEL, pip's find-links
    folders, kvrepro's cache; else downloaded from PyTorch's CPU index into the cache."""
    explicit = os.environ.get("KVREPRO_TORCH_WHEEL")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise SetupError(f"KVREPRO_TORCH_WHEEL={explicit} does not exist")
        return path
    folders = [Path(p) for p in os.environ.get("PIP_FIND_LINKS", "").split() if p and "://" not in p]
    folders += [Path("/opt/wheels"), paths.wheels_dir() / "torch"]
    for folder in folders:
        if not folder.is_dir():
            continue
        found = sorted(folder.glob(f"torch-{version}*-cp311-cp311-*linux*x86_64.whl"),
                       key=lambda p: ("+cpu" not in p.name, p.name))
        if found:
            return found[0]
    dest = paths.wheels_dir() / "torch"
    dest.mkdir(parents=True, exist_ok=True)
    on_line(f"downloading the CPU build of torch {version} for Python 3.11")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
           "--platform", "manylinux_2_28_x86_64", "--index-url", "https://download.pytorch.org/whl/cpu",
           "-d", str(dest), f"torch=={version}+cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"torch-{version}*-cp311-cp311-*.whl"))
    if proc.returncode != 0 or not found:
        raise SetupError(f"no CPU torch {version} wheel for cp311 found (looked in {', '.join(map(str, folders))}) "
                         f"and downloading it failed:\n{(proc.stdout + proc.stderr)[-800:]}\n"
                         "Put the wheel in one of those folders or set KVREPRO_TORCH_WHEEL=/path/to/torch-...whl")
    return found[0]


def ca_bundle() -> Path | None:
    """This machine's CA bundle, mounted for pip inside the build (proxies that re-sign TLS)."""
    for name in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), *CA_BUNDLE_CANDIDATES):
        if name and Path(name).is_file():
            return Path(name)
    return None


def engine_files() -> dict[str, bytes]:
    """kvrepro's files the GPU-free engine needs in the image: kvrepro/__init__.py, the engine
    package, the probe (the engine's fallback copy) and any kvrepro module they import."""
    root = paths.PACKAGE_ROOT
    wanted = [root / "__init__.py", *sorted((root / "engine").rglob("*.py")), root / "probe" / "kvrepro_probe.py"]
    files: dict[str, bytes] = {}
    queue = list(wanted)
    while queue:
        path = queue.pop()
        if "__pycache__" in path.parts or not path.is_file():
            continue
        rel = path.relative_to(paths.SOURCE_ROOT).as_posix()
        if rel in files:
            continue
        files[rel] = path.read_bytes()
        queue += _kvrepro_imports(path)
    return dict(sorted(files.items()))


def _kvrepro_imports(path: Path) -> list[Path]:
    import ast

    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return []
    package = path.parent
    found: list[Path] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.parent
                parts = (node.module or "").split(".") if node.module else []
            elif node.module and node.module.split(".")[0] == "kvrepro":
                base = paths.SOURCE_ROOT
                parts = node.module.split(".")
            else:
                continue
            target = base.joinpath(*parts) if parts else base
            found += [target.with_suffix(".py"), target / "__init__.py"]
            found += [target / f"{alias.name}.py" for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvrepro":
                    target = paths.SOURCE_ROOT.joinpath(*alias.name.split("."))
                    found += [target.with_suffix(".py"), target / "__init__.py"]
    return [p for p in found if p.is_file() and paths.PACKAGE_ROOT in p.parents]


# ------------------------------------------------------------------ steps


def _os_image(host: DockerHost, on_line: OnLine, rebuild: bool):
    key = _h({"format": FORMAT, "suite": SUITE, "mirror": MIRROR, "packages": OS_PACKAGES, "step": "os"})
    tag = f"kvrepro/cpu-os:{SUITE}-{key[:12]}"
    image = None if rebuild else _image(host, tag, key)
    if image is not None:
        on_line(f"OS layer: reusing {tag}")
        return image, tag, True
    if shutil.which("debootstrap") is None:
        raise SetupError("debootstrap is not installed; `apt-get install debootstrap` (Debian/Ubuntu), then retry")
    if os.geteuid() != 0:
        raise SetupError("building the OS layer runs debootstrap, which needs root; run as root (or in CI)")
    work = Path(tempfile.mkdtemp(prefix="kvrepro-rootfs-", dir=_scratch()))
    rootfs = work / "rootfs"
    try:
        on_line(f"OS layer: debootstrap {SUITE} (minbase + {', '.join(OS_PACKAGES)}) from {MIRROR}")
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(OS_PACKAGES)}", SUITE, str(rootfs), MIRROR]
        _run_host(cmd, on_line, "debootstrap")
        # Caches that only debootstrap needed: 40+ MB of .deb files nobody will read again.
        for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / sub).glob("*"):
                if p.is_file():
                    p.unlink()
        on_line(f"OS layer: docker import -> {tag}")
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            changes = [f"ENV {PATH_ENV}", "ENV LANG=C.UTF-8", 'CMD ["bash"]', *_change_labels(_labels("base-os", key))]
            host.client.api.import_image(src=tar.stdout, repository=tag.split(":")[0], tag=tag.split(":")[1],
                                         changes=changes, stream_src=True)
        finally:
            tar.stdout.close()
            if tar.wait() != 0:
                raise SetupError("tar of the debootstrap tree failed")
        return host.client.images.get(tag), tag, False
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _scratch() -> str:
    folder = paths.home() / "docker" / "scratch"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


def _run_host(cmd: list[str], on_line: OnLine, what: str) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-10:]
        on_line(line.rstrip())
    if proc.wait() != 0:
        raise SetupError(f"{what} failed (exit {proc.returncode}):\n  " + "\n  ".join(tail))


def _run_and_commit(host: DockerHost, image_id: str, script: str, mounts: list[Mount], tag: str,
                    changes: Callable[[], list[str]], on_line: OnLine, what: str) -> tuple[Any, str]:
    """Run ``script`` (sh) in a container of ``image_id``, stream its output, commit it as ``tag``
    with the Dockerfile instructions ``changes()`` returns once the script has finished."""
    client = host.client
    container = client.containers.create(image_id, entrypoint=["/bin/sh", "-c"], command=[script], mounts=mounts,
                                         labels=L.managed("layer-step"), detach=True,
                                         name=f"kvrepro-layer-{L.SESSION}-{os.urandom(3).hex()}")
    output: list[str] = []
    try:
        container.start()
        buffer = b""
        for chunk in container.logs(stream=True, follow=True):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                text = line.decode("utf-8", "replace").rstrip()
                output.append(text)
                on_line(text)
        code = container.wait().get("StatusCode")
        if code != 0:
            raise SetupError(f"{what} failed in the container (exit {code}); last lines:\n  "
                             + "\n  ".join(output[-12:]))
        on_line(f"{what}: committing {tag}")
        repo, _, version = tag.partition(":")
        image = container.commit(repository=repo, tag=version, changes=changes())
        return image, "\n".join(output)
    finally:
        remove_quietly(container)


def _pip(*args: str, cert: bool) -> str:
    flags = ["--break-system-packages", "--no-cache-dir", "--root-user-action=ignore", "--progress-bar=off",
             "--disable-pip-version-check"]
    if cert:
        flags.append("--cert=/kvrepro/ca.crt")
    return "python3 -m pip install " + " ".join(flags + list(args))


def _deps_image(host: DockerHost, os_image, torch_wheel: Path, requirements: list[str], on_line: OnLine,
                rebuild: bool):
    key = _h({"format": FORMAT, "step": "deps", "os": os_image.id, "torch": _file_sha256(torch_wheel),
              "requirements": requirements})
    tag = f"kvrepro/cpu-deps:{key[:12]}"
    image = None if rebuild else _image(host, tag, key)
    if image is not None:
        on_line(f"torch + dependencies layer: reusing {tag}")
        return image, tag, True
    scratch = Path(tempfile.mkdtemp(prefix="kvrepro-deps-", dir=_scratch()))
    try:
        (scratch / "requirements.txt").write_text("\n".join(requirements) + "\n")
        mounts = [Mount("/kvrepro/wheels", str(torch_wheel.parent), type="bind", read_only=True),
                  Mount("/kvrepro/requirements.txt", str(scratch / "requirements.txt"), type="bind", read_only=True)]
        cert = ca_bundle()
        if cert:
            mounts.append(Mount("/kvrepro/ca.crt", str(cert), type="bind", read_only=True))
        script = _pip("--find-links=/kvrepro/wheels", f"/kvrepro/wheels/{torch_wheel.name}",
                      "-r", "/kvrepro/requirements.txt", cert=cert is not None)
        on_line(f"torch + dependencies layer: installing {torch_wheel.name} and {len(requirements)} requirements")
        changes = [f"ENV {PATH_ENV}", "ENV LANG=C.UTF-8", 'CMD ["bash"]',
                   *_change_labels(_labels("base-deps", key, **{"io.kvrepro.torch": torch_wheel.name}))]
        image, _ = _run_and_commit(host, os_image.id, script, mounts, tag, lambda: changes, on_line,
                                   "pip install (deps)")
        return image, tag, False
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _vllm_image(host: DockerHost, deps_image, wheel: Path, version: str, on_line: OnLine, rebuild: bool):
    key = _h({"format": FORMAT, "step": "vllm", "deps": deps_image.id, "wheel": _file_sha256(wheel)})
    tag = f"kvrepro/cpu-vllm:{version}-{key[:12]}"
    image = None if rebuild else _image(host, tag, key)
    if image is not None:
        on_line(f"vLLM layer: reusing {tag}")
        return image, tag, True
    mounts = [Mount("/kvrepro/wheels", str(wheel.parent), type="bind", read_only=True)]
    script = (_pip("--no-deps", f"/kvrepro/wheels/{wheel.name}", cert=False)
              + " && python3 -c 'import sysconfig; print(\"KVREPRO_PURELIB=\" + sysconfig.get_paths()[\"purelib\"])'")
    on_line(f"vLLM layer: installing {wheel.name} (--no-deps)")
    # Where pip put vLLM is learnt from the python that installed it and kept as a label, so
    # that a reused layer still tells the engine layer where its .pth file goes.
    purelib: list[str] = []

    def watch(line: str) -> None:
        if line.startswith("KVREPRO_PURELIB="):
            purelib.append(line.split("=", 1)[1].strip())
        on_line(line)

    def changes() -> list[str]:
        labels = _labels("base-vllm", key, **{"io.kvrepro.vllm.version": version})
        if purelib:
            labels["io.kvrepro.purelib"] = purelib[-1]
        return [f"ENV {PATH_ENV}", "ENV LANG=C.UTF-8", 'ENTRYPOINT ["vllm", "serve"]', "CMD []",
                *_change_labels(labels)]

    image, _ = _run_and_commit(host, deps_image.id, script, mounts, tag, changes, watch, "pip install (vllm)")
    return image, tag, False


def _engine_image(host: DockerHost, vllm_image, version: str, on_line: OnLine, rebuild: bool,
                  final_tag: str) -> tuple[Any, str, bool, str]:
    files = engine_files()
    plugin_dist = {f"plugin/{rel}": text.encode() for rel, text in dist_info_files().items()}
    shim = (DATA / "vllm-shim.sh").read_bytes()
    dockerfile_template = (DATA / "engine-layer.Dockerfile").read_text()
    purelib = (vllm_image.labels or {}).get("io.kvrepro.purelib") or "/usr/local/lib/python3.11/dist-packages"
    engine_hash = _h({name: hashlib.sha256(data).hexdigest() for name, data in (files | plugin_dist).items()}
                     | {"shim": hashlib.sha256(shim).hexdigest(), "dockerfile": dockerfile_template})
    key = _h({"format": FORMAT, "step": "engine", "vllm": vllm_image.id, "engine": engine_hash})
    engine_tag = f"{final_tag}-engine-{engine_hash[:12]}"
    image = None if rebuild else _image(host, engine_tag, key)
    if image is not None:
        on_line(f"engine layer: reusing {engine_tag}")
        return image, engine_tag, True, engine_hash
    members: dict[str, tuple[bytes, int]] = {f"opt/kvrepro/{name}": (data, 0o644) for name, data in files.items()}
    members.update({name: (data, 0o644) for name, data in plugin_dist.items()})
    members["vllm-shim.sh"] = (shim, 0o755)
    members["kvrepro-engine.pth"] = (b"/opt/kvrepro\n", 0o644)
    dockerfile = dockerfile_template.replace("{vllm_image}", vllm_image.id).replace("{purelib}", purelib)
    members["Dockerfile"] = (dockerfile.encode(), 0o644)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, (data, mode) in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    labels = _labels("base-cpu", key, **{"io.kvrepro.engine.sha256": engine_hash, "io.kvrepro.vllm.version": version,
                                         L.OCI_BASE_NAME: "debian:" + SUITE})
    on_line(f"engine layer: building {engine_tag}")
    try:
        for chunk in host.client.api.build(fileobj=io.BytesIO(buf.getvalue()), custom_context=True, tag=engine_tag,
                                           labels=labels, rm=True, forcerm=True, decode=True, network_mode="none"):
            if chunk.get("stream", "").strip():
                on_line(chunk["stream"].rstrip())
            if "error" in chunk or "errorDetail" in chunk:
                raise SetupError(f"engine layer build failed: {chunk.get('error') or chunk.get('errorDetail')}")
    except (docker.errors.APIError, requests.RequestException) as exc:
        raise SetupError(f"engine layer build failed: {getattr(exc, 'explanation', None) or exc}") from None
    return host.client.images.get(engine_tag), engine_tag, False, engine_hash


def build_base_cpu(version: str = "0.26.0", tag: str | None = None, host: DockerHost | None = None,
                   rebuild: bool = False, on_line: OnLine = _quiet) -> dict[str, Any]:
    """Build (or reuse) the CPU base for vLLM ``version``; return what was done, step by step."""
    started = time.monotonic()
    own = host is None
    host = host or connect(local_host_spec())
    final_tag = tag or default_tag(version)
    steps: list[dict[str, Any]] = []
    try:
        def step(name, fn, *args):
            t = time.monotonic()
            result = fn(*args)
            steps.append({"step": name, "tag": result[1], "image_id": result[0].id, "reused": result[2],
                          "seconds": round(time.monotonic() - t, 1)})
            return result

        os_image = step("os", _os_image, host, on_line, rebuild)[0]
        wheel = fetch_wheel(version)
        torch_wheel = find_torch_wheel(torch_version(), on_line)
        deps = step("torch+deps", _deps_image, host, os_image, torch_wheel, vllm_requirements(wheel), on_line,
                    rebuild)[0]
        vllm_image = step("vllm", _vllm_image, host, deps, wheel, version, on_line, rebuild)[0]
        image, engine_tag, reused, engine_hash = step("engine", _engine_image, host, vllm_image, version, on_line,
                                                      rebuild, final_tag)
        repo, _, name = final_tag.rpartition(":")
        image.tag(repo, name)
        return {"tag": final_tag, "engine_tag": engine_tag, "image_id": image.id, "engine_sha256": engine_hash,
                "reused": all(s["reused"] for s in steps), "seconds": round(time.monotonic() - started, 1),
                "steps": steps, "vllm_wheel": wheel.name, "torch_wheel": torch_wheel.name}
    except (docker.errors.DockerException, requests.RequestException) as exc:
        raise SetupError(f"building the CPU base failed: {getattr(exc, 'explanation', None) or exc}") from None
    finally:
        if own:
            host.close()
