"""`kvrepro clean`: remove what kvrepro left on Docker hosts (containers; images on request).

Only objects carrying kvrepro's label are touched, so a user's own containers and images are
never at risk. Containers of a kvrepro process that is still running (their owner labels name a
live process on this machine, or a process on another machine) are left alone unless ``--all``:
`clean` may run next to a matrix run. ``reap_orphans`` is the same rule, run by every docker
`matrix run` when it connects to a host: a kvrepro killed with SIGKILL left its engines running,
and the next one removes them.
"""

from __future__ import annotations

from typing import Any

import docker.errors
import requests

from ... import lifetime
from ...spec.matrix import Matrix
from . import labels as L, shm
from .errors import DockerInfraError
from .hosts import all_hosts, connect

IMAGE_KINDS = ("assembled",)
BASE_KINDS = ("base-cpu", "base-vllm", "base-deps", "base-os")


def owner_gone(labels: dict[str, str]) -> bool:
    """True if the kvrepro process that made this container is known to be gone."""
    return lifetime.owner_alive(L.owner_of(labels)) is False


def is_leftover(labels: dict[str, str]) -> bool:
    """What `kvrepro clean` removes: containers whose owner is gone, and those without an owner
    record (made by an older kvrepro); a live owner's, or another machine's, stay."""
    record = L.owner_of(labels)
    return record is None or lifetime.owner_alive(record) is False


def reap_orphans(host) -> list[str]:
    """Remove the containers on ``host`` whose kvrepro process is gone; their names."""
    removed = []
    try:
        found = host.client.containers.list(all=True, filters=L.MANAGED_FILTER, ignore_removed=True)
    except (docker.errors.DockerException, requests.RequestException, OSError):
        return removed
    for container in found:
        if owner_gone(container.labels):
            shm.remove_and_release(host, container)
            removed.append(container.name)
    return removed


def clean(matrix: Matrix | None = None, images: bool = False, base_images: bool = False,
          dry_run: bool = False, everything: bool = False) -> list[dict[str, Any]]:
    """Per host: containers (and, if asked, images) removed, or the error that prevented it."""
    reports = []
    for spec in all_hosts(matrix):
        report: dict[str, Any] = {"host": spec.name, "containers": [], "images": [], "errors": []}
        try:
            host = connect(spec, timeout=30)
        except DockerInfraError as exc:
            report["errors"].append(str(exc))
            reports.append(report)
            continue
        report["kept"] = []
        try:
            for container in host.client.containers.list(all=True, filters=L.MANAGED_FILTER, ignore_removed=True):
                entry = {"name": container.name, "status": container.status,
                         "kind": container.labels.get(L.LABEL_KIND), "run": container.labels.get(L.LABEL_RUN)}
                if not everything and not is_leftover(container.labels):
                    entry["owner"] = L.owner_of(container.labels)
                    report["kept"].append(entry)  # a live run's: not ours to remove
                    continue
                if not dry_run:
                    released = shm.remove_and_release(host, container).released
                    if released:
                        entry["shm_regions"] = released
                report["containers"].append(entry)
            kinds = (IMAGE_KINDS if images or base_images else ()) + (BASE_KINDS if base_images else ())
            if kinds:
                order = IMAGE_KINDS + BASE_KINDS  # children before the layers they are built on
                # Label AND name: an image someone built FROM ours inherits the label but not our name.
                found = [i for i in host.client.images.list(filters={"label": L.LABEL_IMAGE})
                         if i.labels.get(L.LABEL_IMAGE) in kinds and i.tags
                         and all(t.startswith("kvrepro/") for t in i.tags)]
                for image in sorted(found, key=lambda i: order.index(i.labels[L.LABEL_IMAGE])):
                    kind = image.labels[L.LABEL_IMAGE]
                    report["images"].append({"id": image.id, "tags": image.tags, "kind": kind})
                    if not dry_run:
                        try:
                            host.client.images.remove(image.id, force=True)
                        except docker.errors.NotFound:
                            pass
                        except docker.errors.APIError as exc:
                            report["errors"].append(f"image {image.tags or image.id}: {exc.explanation or exc}")
            if kinds:  # the per-release vLLM cache volumes go with the images they served
                report["volumes"], report["kept_volumes"] = [], []
                for volume in host.client.volumes.list(filters={"label": L.LABEL_VOLUME}):
                    try:
                        if not dry_run:
                            volume.remove()
                        report["volumes"].append(volume.name)
                    except docker.errors.NotFound:
                        pass
                    except docker.errors.APIError as exc:
                        if exc.status_code == 409:  # mounted by a live run's engine: kept, as its container
                            report["kept_volumes"].append(volume.name)
                        else:
                            report["errors"].append(f"volume {volume.name}: {exc.explanation or exc}")
        except (docker.errors.DockerException, requests.RequestException) as exc:
            report["errors"].append(f"host {spec.name}: {getattr(exc, 'explanation', None) or exc}")
        finally:
            host.close()
        reports.append(report)
    return reports
