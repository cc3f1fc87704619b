"""Labels on everything kvrepro creates, so that `kvrepro clean` can find leftovers.

Containers carry the session (one kvrepro process), run, build, repetition and node; images
carry the OCI base labels plus the patch stack and the manifest they were built from.
"""

from __future__ import annotations

import os
import uuid

LABEL_MANAGED = "io.kvrepro.managed"          # "1" on every container kvrepro creates
LABEL_KIND = "io.kvrepro.kind"                # container: engine | probe | layer-step
LABEL_IMAGE = "io.kvrepro.image"              # image: assembled | base-cpu | base-vllm | base-deps | base-os
LABEL_SESSION = "io.kvrepro.session"          # one kvrepro process: what Target.close() removes
LABEL_RUN = "io.kvrepro.run"
LABEL_BUILD = "io.kvrepro.build"
LABEL_REP = "io.kvrepro.rep"
LABEL_NODE = "io.kvrepro.node"
LABEL_KEY = "io.kvrepro.key"                  # content key of an assembled image (its tag's hash)
LABEL_PATCHES = "io.kvrepro.patches"          # JSON: ordered [{"name", "sha256"}]
LABEL_MANIFEST = "io.kvrepro.manifest"        # JSON: what went into the image
LABEL_PROBE = "io.kvrepro.probe.sha256"
OCI_BASE_NAME = "org.opencontainers.image.base.name"
OCI_BASE_DIGEST = "org.opencontainers.image.base.digest"

# One id per kvrepro process: containers it starts carry it, so a Ctrl-C'd run's close()
# removes exactly its own containers and not those of another kvrepro running next to it.
SESSION = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def managed(kind: str, **extra: str) -> dict[str, str]:
    """Labels of a container kvrepro creates (`kvrepro clean` removes those with managed=1)."""
    labels = {LABEL_MANAGED: "1", LABEL_KIND: kind, LABEL_SESSION: SESSION}
    labels.update({k: str(v) for k, v in extra.items()})
    return labels


def image_labels(kind: str, **extra: str) -> dict[str, str]:
    """Labels of an image kvrepro makes.

    Containers inherit their image's labels, and a committed image inherits its container's:
    the container labels are therefore set to "" here, so that a user's own `docker run` of a
    kvrepro image is not mistaken for a kvrepro container (and removed by `kvrepro clean`).
    """
    labels = {LABEL_IMAGE: kind, LABEL_MANAGED: "", LABEL_KIND: "", LABEL_SESSION: ""}
    labels.update({k: str(v) for k, v in extra.items()})
    return labels


MANAGED_FILTER = {"label": f"{LABEL_MANAGED}=1"}
