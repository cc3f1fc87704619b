"""Labels on everything kvrepro creates, so that `kvrepro clean` can find leftovers.

Containers carry the session (one kvrepro process), run, build, repetition and node; images
carry the OCI base labels plus the patch stack and the manifest they were built from.
"""

from __future__ import annotations

import os
import uuid

from ... import lifetime

LABEL_MANAGED = "io.kvrepro.managed"          # "1" on every container kvrepro creates
LABEL_KIND = "io.kvrepro.kind"                # container: engine | probe | layer-step
LABEL_IMAGE = "io.kvrepro.image"              # image: assembled | base-cpu | base-vllm | base-deps | base-os
LABEL_VOLUME = "io.kvrepro.volume"            # volume: vllm-cache
LABEL_SESSION = "io.kvrepro.session"          # one kvrepro process: what Target.close() removes
LABEL_RUN = "io.kvrepro.run"
LABEL_BUILD = "io.kvrepro.build"
LABEL_REP = "io.kvrepro.rep"
LABEL_NODE = "io.kvrepro.node"
LABEL_KEY = "io.kvrepro.key"                  # content key of an assembled image (its tag's hash)
LABEL_PATCHES = "io.kvrepro.patches"          # JSON: ordered [{"name", "sha256"}]
LABEL_MANIFEST = "io.kvrepro.manifest"        # JSON: what went into the image
LABEL_PROBE = "io.kvrepro.probe.sha256"
# The kvrepro process that owns a container (kvrepro/lifetime.py): once it is gone (SIGKILL),
# the next kvrepro (`matrix run`, `clean`) removes the container; live runs are left alone.
LABEL_OWNER_PID = "io.kvrepro.owner.pid"
LABEL_OWNER_HOST = "io.kvrepro.owner.host"
LABEL_OWNER_START = "io.kvrepro.owner.start"
# The kvrepro that sent the run to this node (``ray.engine: docker``: the Ray driver, whose Ctrl-C
# may kill the node's worker mid-teardown); the driver removes what carries it before it exits.
LABEL_DRIVER = "io.kvrepro.driver"
OCI_BASE_NAME = "org.opencontainers.image.base.name"
OCI_BASE_DIGEST = "org.opencontainers.image.base.digest"

# One id per kvrepro process: containers it starts carry it, so a Ctrl-C'd run's close()
# removes exactly its own containers and not those of another kvrepro running next to it.
SESSION = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def managed(kind: str, **extra: str) -> dict[str, str]:
    """Labels of a container kvrepro creates (`kvrepro clean` removes those with managed=1)."""
    labels = {LABEL_MANAGED: "1", LABEL_KIND: kind, LABEL_SESSION: SESSION, **owner_labels()}
    labels.update({k: str(v) for k, v in extra.items()})
    return labels


def owner_labels() -> dict[str, str]:
    record = lifetime.owner()
    return {LABEL_OWNER_PID: record["pid"], LABEL_OWNER_HOST: record["host"], LABEL_OWNER_START: record["start"]}


def owner_of(labels: dict[str, str]) -> dict[str, str] | None:
    """The owner record in a container's labels (None for containers made before owners were recorded)."""
    if not labels.get(LABEL_OWNER_PID):
        return None
    return {"pid": labels[LABEL_OWNER_PID], "host": labels.get(LABEL_OWNER_HOST, ""),
            "start": labels.get(LABEL_OWNER_START, "")}


def image_labels(kind: str, **extra: str) -> dict[str, str]:
    """Labels of an image kvrepro makes.

    Containers inherit their image's labels, and a committed image inherits its container's:
    the container labels are therefore set to "" here, so that a user's own `docker run` of a
    kvrepro image is not mistaken for a kvrepro container (and removed by `kvrepro clean`).
    """
    labels = {LABEL_IMAGE: kind, LABEL_MANAGED: "", LABEL_KIND: "", LABEL_SESSION: "", LABEL_OWNER_PID: "",
              LABEL_OWNER_HOST: "", LABEL_OWNER_START: "", LABEL_DRIVER: ""}
    labels.update({k: str(v) for k, v in extra.items()})
    return labels


MANAGED_FILTER = {"label": f"{LABEL_MANAGED}=1"}
