"""A build's overlay as a content-addressed bundle: packed once on the driver, unpacked once per node.

An overlay (kvrepro/builds/overlay.py) is the release's pristine ``vllm/`` tree hard-linked, with
the patched files, the probe and the dist-infos as private copies. The bundle holds only what is
not the pristine tree's: every file whose inode differs from the pristine file at the same path
(or that the pristine tree lacks), and the paths a patch removed. A node rebuilds the overlay
from its own pristine tree of the same wheel (checked by the wheel's sha256) plus the bundle, in
``<node cache>/overlays/<bundle sha256>``, once; every later run there finds it complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from ... import builds, paths
from ...errors import InfraError

MANIFEST = ".kvrepro-bundle.json"
COMPLETE = ".kvrepro-complete"


@dataclass(frozen=True)
class BundleRef:
    """What a Ray task needs to find or make a build on its node (the bytes travel separately)."""

    sha256: str
    base: str
    wheel_sha256: str
    size: int


def _pristine(base: str) -> tuple[Path, str]:
    _, tree, digest = builds.pristine_tree(base)
    return tree, digest


def pack(overlay: Path, base: str) -> tuple[BundleRef, bytes]:
    """The bundle of ``overlay`` (a build of release ``base``): its reference and its bytes (a tar)."""
    pristine, wheel_digest = _pristine(base)
    private: list[str] = []
    for path in sorted(overlay.rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(overlay).as_posix()
        twin = pristine / rel
        try:
            if twin.is_file() and os.path.samestat(path.stat(), twin.stat()):
                continue  # the pristine file itself (a hard link): the node has it
        except OSError:
            pass
        private.append(rel)
    present = {p.relative_to(overlay).as_posix() for p in overlay.rglob("*") if p.is_file()}
    removed = sorted(p.relative_to(pristine).as_posix() for p in (pristine / "vllm").rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts
                     and p.relative_to(pristine).as_posix() not in present)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        meta = json.dumps({"base": base, "wheel_sha256": wheel_digest, "removed": removed}, sort_keys=True).encode()
        for name, data in [(MANIFEST, meta)] + [(rel, (overlay / rel).read_bytes()) for rel in private]:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0  # deterministic: same build, same bytes
            tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    return BundleRef(sha256=hashlib.sha256(data).hexdigest(), base=base, wheel_sha256=wheel_digest,
                     size=len(data)), data


def node_cache(node_id: str) -> Path:
    """Where a node keeps what it unpacked. Keyed by node id, so that nodes sharing one file system
    (several raylets on one machine) still each unpack their own: the design does not rely on sharing."""
    return Path(os.environ.get("KVREPRO_RAY_NODE_CACHE") or paths.home() / "ray-nodes") / node_id[:16]


def unpacked(ref: BundleRef, node_id: str) -> Path | None:
    """The node's overlay for ``ref`` when it is already complete there."""
    dest = node_cache(node_id) / "overlays" / ref.sha256[:32]
    return dest if (dest / COMPLETE).is_file() else None


def unpack(ref: BundleRef, data: bytes, node_id: str) -> Path:
    """Make the overlay of ``ref`` on this node (once; concurrent tasks wait for the first)."""
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise InfraError(f"ray: the bundle of build {ref.sha256[:12]} arrived damaged (sha256 differs)")
    root = node_cache(node_id) / "overlays"
    root.mkdir(parents=True, exist_ok=True)
    dest = root / ref.sha256[:32]
    with open(root / f"{ref.sha256[:32]}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / COMPLETE).is_file():
            return dest
        pristine, wheel_digest = _pristine(ref.base)
        if wheel_digest != ref.wheel_sha256:
            raise InfraError(f"ray: node {node_id[:8]} has another vLLM {ref.base} wheel (sha256 {wheel_digest[:12]}, "
                             f"the build wants {ref.wheel_sha256[:12]})")
        tmp = root / f"{ref.sha256[:32]}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(pristine / "vllm", tmp / "vllm", copy_function=os.link,
                        ignore=shutil.ignore_patterns("__pycache__"))
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            meta = json.loads(tar.extractfile(MANIFEST).read())  # type: ignore[union-attr]
            for rel in meta["removed"]:
                (tmp / rel).unlink(missing_ok=True)
            for member in tar.getmembers():
                if member.name == MANIFEST:
                    continue
                target = (tmp / member.name).resolve()
                if not target.is_relative_to(tmp.resolve()):
                    raise InfraError(f"ray: bundle {ref.sha256[:12]}: a path outside the overlay: {member.name}")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.unlink(missing_ok=True)  # never write through a hard link into the pristine tree
                target.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
        (tmp / COMPLETE).write_text(ref.sha256 + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
    return dest
