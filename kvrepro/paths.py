"""Where kvrepro keeps its caches (wheels, overlays, the runtime env).

Everything lives under ``$KVREPRO_HOME`` (default ``~/.cache/kvrepro``) so that a fresh clone
reuses the work of an earlier one and ``rm -r`` of that folder is a full reset.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent
# The folder that holds the `kvrepro` package: put on sys.path of engine processes so that
# they import kvrepro.engine from this checkout, not from whatever is installed.
SOURCE_ROOT = PACKAGE_ROOT.parent


def home() -> Path:
    return Path(os.environ.get("KVREPRO_HOME", Path.home() / ".cache" / "kvrepro"))


def wheels_dir() -> Path:
    return home() / "wheels"


def overlays_dir() -> Path:
    return home() / "overlays"


def runtimes_dir() -> Path:
    return home() / "runtimes"


def vllm_cache(release: str) -> Path:
    """vLLM's cache folder (``VLLM_CACHE_ROOT``) for processes of one vLLM release: the sim's engines
    (kvrepro.deploy.sim.vllm_cache_root) and vLLM's own tests (kvrepro.builds.upstream_tests) learn
    the same per-model-file answers there (``modelinfos``), one folder per release so that releases
    never evict each other's."""
    return home() / "vllm-cache" / release.replace("/", "_")


def pycache_prefix() -> Path:
    """Where engine processes keep their byte code (``PYTHONPYCACHEPREFIX``): outside the overlays,
    whose unpatched files are hard links shared by every build, so no overlay gets a __pycache__."""
    return home() / "pycache"


def keep_byte_code(env: dict[str, str]) -> None:
    """``env`` (changed in place) for a process of a build's vLLM: byte code written, in
    :func:`pycache_prefix`, so the next process of that build, engine or test, does not compile again."""
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(pycache_prefix())


def shipped_project() -> Path:
    """The folder holding the project kvrepro ships: the default matrix.yaml, its patches in builds/
    and the known-defect catalogue in defects/. An installed wheel carries a copy as package data
    (setup.py puts it there); a source checkout keeps them at the repository's top level."""
    packaged = PACKAGE_ROOT / "data" / "project"
    return packaged if (packaged / "matrix.yaml").is_file() else SOURCE_ROOT


def shipped_matrix() -> Path:
    return shipped_project() / "matrix.yaml"


def shipped_catalogue() -> Path:
    return shipped_project() / "defects"


def default_catalogue() -> Path:
    """./defects when this folder has one (a project's own, `kvrepro init --defects`), else the shipped one."""
    local = Path("defects")
    return local if local.is_dir() else shipped_catalogue()


def engine_import_root() -> Path:
    """The folder an engine process gets on ``PYTHONPATH`` to import this kvrepro from.

    In a checkout that is the repository. An installed kvrepro sits in a site-packages folder,
    which would also put this env's numpy, pydantic, aiohttp... in front of the runtime env's own;
    so the engine gets a folder holding nothing but a link to the package."""
    if (SOURCE_ROOT / "pyproject.toml").is_file():
        return SOURCE_ROOT
    folder = home() / "import-roots" / hashlib.sha256(str(PACKAGE_ROOT).encode()).hexdigest()[:12]
    link = folder / "kvrepro"
    if not (link.is_symlink() and link.resolve() == PACKAGE_ROOT):
        folder.mkdir(parents=True, exist_ok=True)
        staged = folder / f".kvrepro-{os.getpid()}"
        staged.unlink(missing_ok=True)
        staged.symlink_to(PACKAGE_ROOT, target_is_directory=True)
        os.replace(staged, link)  # atomic: two kvrepros starting at once both end with a good link
    return folder
