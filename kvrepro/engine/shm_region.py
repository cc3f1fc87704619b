"""The OffloadingConnector's shared-memory region files, removed once the engine that made them is gone.

vLLM's CPU offload tier maps one file per engine, ``/dev/shm/vllm_offload_<engine id>.mmap``
(vllm/v1/kv_offload/cpu/shared_offload_region.py, 0.26.0:56 and 0.34.0:131; the engine id is
``kv_transfer_config.engine_id``, a uuid4 unless set, suffixed ``_dp<rank>`` per DP rank before
the EngineCore is built, vllm/v1/engine/core.py 0.26.0:1277). vLLM unlinks it only when the engine
shuts down cleanly (0.26.0 ``cleanup()`` :173-210; 0.34.0 unlinks early when given a barrier, else
in ``cleanup()`` :428-472). An engine that crashes -- the point of kvrepro -- or that kvrepro stops
with a signal leaves it behind: up to 256 MiB of RAM (tmpfs) a run, measured 66 files / 11 GB on
this machine after a few days of campaigns.

Why a claim, not a fixed engine id: kvrepro could set ``engine_id`` in the kv-transfer-config it
passes and know every path up front, but that changes the configuration under test (vLLM logs and
hashes it, and a DP rank suffixes it), and offline engines, the suite and explore would each have to
pass it. Instead the engine side, which knows the id vLLM really uses, *claims* the path before
the region exists:

* :func:`claim` (called by the sim executor, kvrepro/engine/executor.py, in the EngineCore process)
  writes ``<claims folder>/<file name>`` holding its owner record (pid, host, start time:
  kvrepro/lifetime.py). The claims folder is ``<kvrepro's temp folder>/shm-regions/``, given to
  every engine as :data:`ENV` by ``kvrepro.scratch.engine_env`` (the sim target, its zygotes, the
  minimizer's offline engines, the suite and explore all start engines with that environment).
* ``kvrepro.scratch.release_claimed`` unlinks the region named by each claim whose owner is gone
  (or every claim, when the caller knows its engines are stopped): through
  ``scratch.release_regions`` where every sim engine stop passes (``SimEngine.stop``) and where the
  minimizer closes an offline engine; after each offline EngineCore (kvrepro/engine/offline.py:
  an EngineCore is over though its process lives on); by ``kvrepro.scratch.remove`` (every kvrepro
  exit but SIGKILL) and ``kvrepro clean``; after a SIGKILL, the scratch janitor unlinks the claimed
  regions before it removes the folder. That half lives in kvrepro/scratch.py (the owner of what
  kvrepro's engines leave behind, a base module: it may not import this engine-side one).

A claim is untrusted data (the temp folder may be anyone's): only a name matching :data:`NAME`
directly in ``/dev/shm``, that is a regular file (never a link, never a folder) is unlinked.

The docker target: with ``ipc_host: true`` (its default, as vLLM's docs run it) the container shares
the host's /dev/shm, so a region it leaves stays on the host. Its engine claims into a folder inside
the container, and whoever removes the container reads the claims and unlinks the regions on its
host (kvrepro/deploy/docker/shm.py). With ``ipc_host: false`` the container's own /dev/shm
(``--shm-size``) goes with the container.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvrepro.scratch import SHM_ENV as ENV, SHM_REGION as NAME


def region_name(engine_id: object) -> str | None:
    """The region file name vLLM uses for ``engine_id``; None if it is not one we would ever unlink."""
    if not isinstance(engine_id, str):
        return None
    name = f"vllm_offload_{engine_id}.mmap"
    return name if NAME.match(name) else None


def claim(engine_id: object, folder: str | os.PathLike | None = None) -> Path | None:
    """Record (engine side) that this process's engine maps the region of ``engine_id``; returns the
    claim's path, or None when there is no claims folder (an engine kvrepro did not start) or no name."""
    name = region_name(engine_id)
    folder = folder if folder is not None else os.environ.get(ENV)
    if not name or not folder:
        return None
    from kvrepro import lifetime

    path = Path(folder)
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(lifetime.owner()) + "\n")
    return path / name


__all__ = ["ENV", "NAME", "claim", "region_name"]
