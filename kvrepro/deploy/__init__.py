"""Deploy targets: turn a built engine into a running one that answers HTTP.

A target is one module in this package (``sim.py``, ``docker.py``, ...) that defines a class
implementing :class:`kvrepro.deploy.base.Target` and registers it with :func:`register`.
A target with its own matrix settings (``docker:``, ``hosts:``) also defines
``check_settings(matrix)`` at module level, raising the spec's FieldError; :func:`check_settings`
applies every target's. Adding a target is adding a file; nothing else changes.
"""

from __future__ import annotations

import importlib

from typing import TYPE_CHECKING, Any

from ..errors import SpecError
from .base import EngineHandle, Target

if TYPE_CHECKING:
    from ..spec.matrix import Matrix

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


def check_settings(matrix: "Matrix") -> None:
    """Every target's own settings in ``matrix`` checked by that target (a target module's optional
    ``check_settings``), whichever target the matrix runs on: a section is right or wrong on its
    own. kvrepro.matrix hands this to the spec's parser as its target-settings check."""
    for name in known_targets():
        check = getattr(importlib.import_module(f"{__name__}.{name}"), "check_settings", None)
        if check is not None:
            check(matrix)


def target_commands() -> list[tuple[str, Any]]:
    """Each target's own commands, for kvrepro/cli.py to mount: a target package's ``cli`` module
    lists them in ``COMMANDS`` (command name -> a Typer app or a command function). A target
    whose optional dependencies are not installed has none."""
    commands: list[tuple[str, Any]] = []
    for name in known_targets():
        try:
            module = importlib.import_module(f"{__name__}.{name}.cli")
        except ImportError:  # not a package with commands, or its extra (e.g. docker) is not installed
            continue
        commands.extend(getattr(module, "COMMANDS", {}).items())
    return commands


def check_environment(target: str, matrix: "Matrix") -> None:
    """What ``target`` takes from the environment (ray: $RAY_ADDRESS), checked before anything is
    recorded: the target module's optional ``check_environment`` raises SpecError (exit 2)."""
    if target not in known_targets():
        return
    check = getattr(importlib.import_module(f"{__name__}.{target}"), "check_environment", None)
    if check is not None:
        check(matrix)


__all__ = ["EngineHandle", "Target", "check_environment", "check_settings", "get_target", "known_targets",
           "register", "target_commands"]
