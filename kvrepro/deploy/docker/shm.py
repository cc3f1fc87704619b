"""The /dev/shm regions of engines in containers that share the host's IPC namespace, removed with them.

vLLM's multi-tier CPU offloading maps ``/dev/shm/vllm_offload_<engine id>.mmap`` and unlinks it only
when its engine shuts down cleanly (kvrepro/engine/shm_region.py has the file:line). A container run
with ``ipc_host: true`` (the docker target's default, as vLLM's docs run it) sees the *host's*
/dev/shm, so the region outlives the container: measured 2026-12-05 with the default matrix on
TieringOffloadingSpec, builds A-D once each on 0.26.0, the engine that was still serving when its run
ended (B) left its 4 MiB region on the host; with ``kv_offloading_size_gib: 1`` that is 1 GiB of RAM
a run. (With ``ipc_host: false`` the container's own /dev/shm goes with it.)

The engine in the container claims its region as on the sim target: :data:`CLAIMS` (a folder inside
the container, named by ``KVREPRO_SHM_CLAIMS`` in its environment) gets one file named after the
region. Whoever removes an engine container -- the run's teardown, ``kvrepro clean``, the next run's
orphan reaper, the reaper that outlives a SIGKILLed kvrepro -- reads those names first
(:func:`claimed_regions`), removes the container, then unlinks the regions on its host
(:func:`release`): on this machine directly (only a regular file whose name matches
``vllm_offload_<id>.mmap``, never through a link); on another host with a short container of the same
image sharing that host's IPC namespace, running ``rm -f`` on the validated paths (argv, no shell).
The container is gone by then, so no engine of it maps the region any more.

What a container holds is untrusted: its claims come back as a tar stream, read up to
:data:`MAX_TAR_BYTES`; only regular members directly in the claims folder whose names match the
region pattern count.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass, field
from pathlib import PurePosixPath

import docker.errors
import requests

from ...scratch import SHM_ENV, SHM_REGION, unlink_region

CLAIMS = "/tmp/kvrepro-shm-claims"  # inside the container
MAX_TAR_BYTES = 1 << 20  # a claim is ~100 bytes; a container that sends more is not believed past this

_ERRORS = (docker.errors.DockerException, requests.RequestException, OSError)


def engine_env(ipc_host: bool) -> dict[str, str]:
    """The environment that makes the engine in a container claim its region (only when the region
    would outlive the container: it shares the host's /dev/shm)."""
    return {SHM_ENV: CLAIMS} if ipc_host else {}


def claimed_regions(container) -> list[str]:
    """The region names the container's engines claimed; [] when none (or unreadable). Never raises."""
    try:
        stream, _ = container.get_archive(CLAIMS)
        data = bytearray()
        for chunk in stream:
            data += chunk
            if len(data) > MAX_TAR_BYTES:
                break
    except _ERRORS:
        return []
    names = []
    try:
        with tarfile.open(fileobj=io.BytesIO(bytes(data[:MAX_TAR_BYTES])), mode="r:") as tar:
            for member in tar:
                path = PurePosixPath(member.name)
                if member.isreg() and len(path.parts) == 2 and SHM_REGION.match(path.name):
                    names.append(path.name)
    except (tarfile.TarError, EOFError, ValueError):
        pass  # a stream cut at the limit: the names read before it
    return sorted(set(names))


def release(host, names: list[str], image: str | None) -> tuple[list[str], str | None]:
    """Unlink the regions ``names`` on ``host`` (their container is gone). Returns the names
    unlinked and, when some could not be, why in words. Never raises."""
    names = [n for n in names if SHM_REGION.match(n)]
    if not names:
        return [], None
    if getattr(host, "local", False):
        done = [n for n in names if unlink_region(n)]
        return done, None
    if not image:
        return [], "no image to run the removal with on that host"
    try:
        host.client.containers.run(image, entrypoint=["rm", "-f", "--"], command=[f"/dev/shm/{n}" for n in names],
                                   ipc_mode="host", network_mode="none", remove=True, stdout=False, stderr=True)
    except _ERRORS as exc:
        return [], f"removing them on that host failed: {exc}"
    return names, None


@dataclass
class Removal:
    """What :func:`remove_and_release` did: ``error`` when the container could not be removed (then
    nothing was released: its engine may still map them), the region names ``released``, ``why`` some
    claimed ones were left."""

    claimed: list[str] = field(default_factory=list)
    error: str | None = None
    already_gone: bool = False  # the daemon had no such container any more
    released: list[str] = field(default_factory=list)
    why: str | None = None


def remove_and_release(host, container) -> Removal:
    """Remove an engine container, then the /dev/shm regions its engines claimed on ``host`` (the one
    way every remover of engine containers goes: teardown, clean, the reapers). Never raises."""
    done = Removal(claimed=claimed_regions(container))
    image = image_of(container)
    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        done.already_gone = True
    except _ERRORS as exc:
        done.error = str(exc)
        return done
    done.released, done.why = release(host, done.claimed, image)
    return done


def image_of(container) -> str | None:
    try:
        return container.attrs.get("Image") or None
    except (AttributeError, TypeError):
        return None


__all__ = ["CLAIMS", "MAX_TAR_BYTES", "Removal", "claimed_regions", "engine_env", "image_of", "release",
           "remove_and_release"]
