"""Where kvrepro keeps its caches (wheels, overlays, the runtime env).

Everything lives under ``$KVREPRO_HOME`` (default ``~/.cache/kvrepro``) so that a fresh clone
reuses the work of an earlier one and ``rm -r`` of that folder is a full reset.
"""

from __future__ import annotations

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
