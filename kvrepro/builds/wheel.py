"""vLLM release wheels: download once, extract the pure-Python package, read its requirements.

The GPU-free engine needs vLLM's Python sources, not its CUDA kernels, so we keep the wheel (the
ground truth, identified by its sha256) and extract ``vllm/`` without compiled extensions.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from .. import paths
from ..errors import SetupError

# Requirements that only make sense next to a CUDA build (or that we provide ourselves: torch
# comes from the CPU wheel the runtime env pins). Everything else in Requires-Dist is needed for
# vLLM's scheduler and config code to import.
_NOT_FOR_CPU = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "flashinfer-cubin", "flashinfer-jit-cache", "apache-tvm-ffi", "tilelang", "nvtx",
    "fastsafetensors", "quack-kernels", "tokenspeed-mla", "humming-kernels", "xformers",
    "triton", "cupy-cuda12x", "ray", "deep-gemm", "deep-ep",
}
_NOT_FOR_CPU_PREFIXES = ("nvidia-", "cuda-")


# the package index kvrepro reads vLLM's files from (wheels here, sdists in sdist.py); unset: pip's own
INDEX_ENV = "KVREPRO_INDEX_URL"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_sha256(wheel: Path) -> str:
    """sha256 of a wheel, memoised next to it (hashing 300 MB takes a second each time)."""
    sidecar = wheel.with_name(wheel.name + ".sha256")
    stat = wheel.stat()
    stamp = f"{stat.st_size}:{int(stat.st_mtime)}"
    if sidecar.exists():
        stored_stamp, _, digest = sidecar.read_text().partition(" ")
        if stored_stamp == stamp and len(digest.strip()) == 64:
            return digest.strip()
    digest = _sha256_file(wheel)
    sidecar.write_text(f"{stamp} {digest}\n")
    return digest


def cached_wheel(version: str) -> Path | None:
    folder = paths.wheels_dir() / version
    found = sorted(folder.glob(f"vllm-{version}-*.whl")) if folder.is_dir() else []
    return found[0] if found else None


def fetch_wheel(version: str, log: Path | None = None) -> Path:
    """The vLLM wheel for ``version``, downloaded with pip on first use and cached.

    Raises SetupError with pip's own last words when the download fails (no such version,
    no network), so a person can act on it.
    """
    found = cached_wheel(version)
    if found:
        return found
    folder = paths.wheels_dir() / version
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, f"vllm=={version}"]
        if index := os.environ.get(INDEX_ENV):  # another index (a mirror; a planted release in tests)
            cmd[4:4] = ["--index-url", index]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a") as fh:
                fh.write(proc.stdout + proc.stderr)
        wheels = sorted(Path(tmp).glob(f"vllm-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("ERROR")]
            tail = "\n".join(said[-3:] or (proc.stdout + proc.stderr).strip().splitlines()[-5:])
            raise SetupError(
                f"could not download the vLLM {version} wheel from the package index "
                f"(`pip download --no-deps vllm=={version}` exited {proc.returncode}):\n{tail}\n"
                "Check the version exists (`pip index versions vllm`) and that PyPI is reachable."
            )
        final = folder / wheels[0].name
        os.replace(wheels[0], final)
    wheel_sha256(final)
    return final


def vllm_requirements(wheel: Path) -> list[str]:
    """vLLM's own Requires-Dist for this platform, without the CUDA-only ones."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta_name is None:
            raise SetupError(f"{wheel}: no METADATA in the wheel; delete it and let kvrepro download it again")
        metadata = zf.read(meta_name).decode("utf-8", "replace")
    reqs: list[str] = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        try:
            req = Requirement(line.split(":", 1)[1].strip())
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name in _NOT_FOR_CPU or name.startswith(_NOT_FOR_CPU_PREFIXES):
            continue
        req.marker = None
        reqs.append(str(req))
    return sorted(set(reqs), key=str.lower)


def _is_compiled(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.endswith((".so", ".pyd", ".cubin", ".fatbin")) or ".so." in base


def extract_sources(wheel: Path, dest: Path) -> Path:
    """Extract ``vllm/`` (sources and data, no compiled extensions) into ``dest``.

    Done into a temporary sibling and renamed, so an interrupted extraction never leaves a
    half tree that later runs would trust.
    """
    if (dest / "vllm" / "__init__.py").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.startswith("vllm/") and not _is_compiled(n)]
            zf.extractall(tmp, members)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def extract_dist_info(wheel: Path, dest: Path, names: tuple[str, ...]) -> list[Path]:
    """Copy the named files of the wheel's ``*.dist-info/`` folder into ``dest`` (same layout)."""
    written = []
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            folder, _, name = member.partition("/")
            if folder.endswith(".dist-info") and name in names:
                target = dest / member
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(member))
                written.append(target)
    return written
