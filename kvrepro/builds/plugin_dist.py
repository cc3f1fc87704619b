"""The dist-info that declares kvrepro's GPU-free engine to vLLM as a platform plugin.

vLLM finds platform plugins through entry points (group ``vllm.platform_plugins``). Every build
(an overlay, or a Docker image layer) carries this hand-written ``kvrepro_sim-<version>.dist-info``
next to its ``vllm/``, so ``vllm serve`` calls :func:`kvrepro.engine.plugin.register` in each of
its processes without anything being pip-installed. It lives with the builds, which write it; the
engine side only names the function.
"""

from __future__ import annotations

ENTRY_POINT_GROUP = "vllm.platform_plugins"
DIST_NAME = "kvrepro_sim"
DIST_VERSION = "1.0"
ENTRY_POINT = "kvrepro.engine.plugin:register"


def dist_info_files() -> dict[str, str]:
    """The files of the ``kvrepro_sim`` dist-info folder (relative path -> text)."""
    folder = f"{DIST_NAME}-{DIST_VERSION}.dist-info"
    return {
        f"{folder}/METADATA": f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {DIST_VERSION}\n"
                              "Summary: kvrepro's GPU-free vLLM platform plugin\n",
        f"{folder}/entry_points.txt": f"[{ENTRY_POINT_GROUP}]\n{DIST_NAME} = {ENTRY_POINT}\n",
        f"{folder}/top_level.txt": "kvrepro\n",
    }
