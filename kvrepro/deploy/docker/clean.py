"""`kvrepro clean`: remove what kvrepro left on Docker hosts (containers; images on request).

Only objects carrying kvrepro's label are touched, so a user's own containers and images are
never at risk. Containers of a kvrepro process that is still running are removed too: `clean`
is for when no matrix run is in progress.
"""

from __future__ import annotations

from typing import Any

import docker.errors
import requests

from ...spec import Matrix
from . import labels as L
from .errors import DockerInfraError
from .hosts import all_hosts, connect

IMAGE_KINDS = ("assembled",)
BASE_KINDS = ("base-cpu", "base-vllm", "base-deps", "base-os")


def clean(matrix: Matrix | None = None, images: bool = False, base_images: bool = False,
          dry_run: bool = False) -> list[dict[str, Any]]:
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
        try:
            for container in host.client.containers.list(all=True, filters=L.MANAGED_FILTER, ignore_removed=True):
                entry = {"name": container.name, "status": container.status,
                         "kind": container.labels.get(L.LABEL_KIND), "run": container.labels.get(L.LABEL_RUN)}
                if not dry_run:
                    try:
                        container.remove(force=True)
                    except docker.errors.NotFound:
                        pass
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
        except (docker.errors.DockerException, requests.RequestException) as exc:
            report["errors"].append(f"host {spec.name}: {getattr(exc, 'explanation', None) or exc}")
        finally:
            host.close()
        reports.append(report)
    return reports
