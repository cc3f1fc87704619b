"""The sections of a matrix report, one file each: adding a section is adding a file here.

Each module defines ``ORDER`` (where it goes, lowest first), ``DETAILS`` (True: left out of the
short Markdown that must fit a PR comment; report.html always has it) and
``blocks(run, context) -> list[Block]`` (nothing to say: an empty list). The page model is
``kvrepro.report.pages``; ``kvrepro.report.document`` puts the sections in order under the
report's heading.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from ..pages import Block


@dataclass(frozen=True)
class SectionContext:
    """What a section may need besides the run: where images go, and a bisection's steps."""

    out_dir: Path | None = None
    bisection: tuple[Block, ...] = field(default_factory=tuple)


@functools.lru_cache(maxsize=1)
def known_sections() -> tuple[ModuleType, ...]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if not (isinstance(getattr(module, "ORDER", None), int) and callable(getattr(module, "blocks", None))):
            raise TypeError(f"{module.__file__}: a report section defines ORDER (int) and blocks(run, context)")
        found.append(module)
    return tuple(sorted(found, key=lambda m: (m.ORDER, m.__name__)))


__all__ = ["SectionContext", "known_sections"]
