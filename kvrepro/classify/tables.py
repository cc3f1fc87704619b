"""Reading a table of classify/ whose entries are one module each (signatures/, corruptions/, infra/).

Each module of the package defines one entry under a fixed attribute name; entries are returned
sorted by name, and a module without its entry, or a name used twice, is a programming error
named by its file. One helper, so the three tables cannot drift in how they are found.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from types import ModuleType
from typing import TypeVar

Entry = TypeVar("Entry")


def table_entries(package: ModuleType, attribute: str, kind: type[Entry], what: str,
                  reserved: Iterable[str] = ()) -> tuple[Entry, ...]:
    """The ``attribute`` of every module in ``package`` (each an instance of ``kind``), by name."""
    found: dict[str, Entry] = {}
    taken = set(reserved)
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        entry = getattr(module, attribute, None)
        if not isinstance(entry, kind):
            raise TypeError(f"{module.__file__}: a {what} module must define {attribute} = {kind.__name__}(...)")
        name = entry.name
        if name in found or name in taken:
            raise ValueError(f"{module.__file__}: {what} name {name!r} is already used")
        found[name] = entry
    return tuple(found[name] for name in sorted(found))
