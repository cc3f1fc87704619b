"""Deploy targets: turn a built engine into a running one that answers HTTP.

A target is one module in this package (``sim.py``, ``docker.py``, ...) that defines a class
implementing :class:`kvrepro.deploy.base.Target` and registers it with :func:`register`.
Adding a target is adding a file; nothing else changes.
"""

from __future__ import annotations

import importlib

from ..errors import SpecError
from .base import EngineHandle, Target

_TARGETS: dict[str, type[Target]] = {}


def register(name: str):
    def deco(cls: type[Target]) -> type[Target]:
        _TARGETS[name] = cls
        cls.name = name
        return cls

    return deco


def known_targets() -> list[str]:
    """Every target this installation has (one module or package per target in this folder)."""
    import pkgutil

    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in ("base",))


def get_target(name: str) -> type[Target]:
    if name not in _TARGETS:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
            getattr(module, "load", lambda: None)()  # a package may import its heavy parts on demand
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    if name not in _TARGETS:
        raise SpecError(f"unknown target {name!r}; known targets: {', '.join(known_targets())}")
    return _TARGETS[name]


__all__ = ["EngineHandle", "Target", "get_target", "known_targets", "register"]
