"""Deploy targets: turn a built engine into a running one that answers HTTP.

A target is one module in this package (``sim.py``, ``docker.py``, ...) that defines a class
implementing :class:`kvrepro.deploy.base.Target` and registers it with :func:`register`.
A target with its own matrix settings lists the top-level sections it owns in ``SECTIONS`` and
defines ``check_settings(matrix)`` at module level (it reads them with ``matrix.section(name)``,
types them, and raises the spec's FieldError); :func:`check_settings` applies every target's and
refuses a top-level key no target owns. Adding a target is adding a module or package here;
nothing else changes (docs/targets.md lists the files).
"""

from __future__ import annotations

import importlib
import os

from collections.abc import Callable
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

    # base.py (the contract) and records.py (the run manifest) are the stage's own, not targets
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in ("base", "records"))


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


def target_sections() -> dict[str, str]:
    """matrix.yaml's top-level sections the targets own (a target module's ``SECTIONS``) -> the target."""
    owned: dict[str, str] = {}
    for name in known_targets():
        for section in getattr(importlib.import_module(f"{__name__}.{name}"), "SECTIONS", ()):
            owned[section] = name
    return owned


def check_settings(matrix: "Matrix") -> None:
    """Every target's own settings in ``matrix`` checked by that target (a target module's optional
    ``check_settings``), whichever target the matrix runs on: a section is right or wrong on its
    own; a top-level key neither the spec nor a target knows is refused. kvrepro.matrix hands this
    to the spec's parser as its target-settings check."""
    from ..spec.matrix import FieldError

    owned = target_sections()
    for key in matrix.sections:
        if key not in owned:
            allowed = ", ".join([*type(matrix).model_fields, *owned])
            raise FieldError((key,), f"unknown field; allowed here: {allowed}")
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
        # only a package with a cli module is imported: importing one to find none cost every command
        # that package's settings (the ray package's: pydantic and the matrix spec, ~0.1 s of ~0.4)
        if not any(os.path.exists(os.path.join(folder, name, "cli.py")) for folder in __path__):
            continue
        try:
            module = importlib.import_module(f"{__name__}.{name}.cli")
        except ImportError:  # not a package with commands, or its extra (e.g. docker) is not installed
            continue
        commands.extend(getattr(module, "COMMANDS", {}).items())
    return commands


def _module_of(target: str) -> object | None:
    """``target``'s module (its package's light __init__), or None for a name that is no target."""
    return importlib.import_module(f"{__name__}.{target}") if target in known_targets() else None


def where_ran(record: Any) -> str | None:
    """Words for where a run ran, from its record's target sections (``by_target``; a target
    module's optional ``where_ran(section)``, e.g. ray's node); None: no target recorded any."""
    words = [hook(section) for name, section in record.by_target.items()
             if (hook := getattr(_module_of(name), "where_ran", None)) is not None]
    return "; ".join(words) or None


def lift_target_keys(data: Any, fields: set[str]) -> Any:
    """A verdict.json or manifest.json from before records had target sections: the top-level keys
    a target declares it wrote there (its module's ``TOP_LEVEL_BEFORE``; ray's ``node``) moved
    under ``by_target`` as that target's section. ``fields``: the record's own fields; a file
    without other keys is returned as it is, without importing any target."""
    if not isinstance(data, dict) or not set(data) - fields:
        return data
    lifted = dict(data)
    for name in known_targets():
        keys = [k for k in getattr(_module_of(name), "TOP_LEVEL_BEFORE", ()) if k in lifted and k not in fields]
        if keys:
            moved = {k: lifted.pop(k) for k in keys}
            if any(v not in (None, [], {}) for v in moved.values()):  # an empty ray key on a run that was not Ray's
                lifted["by_target"] = {**lifted.get("by_target", {}), name: moved}
    return lifted


def fetches_hub_models(target: str) -> bool:
    """Whether ``target``'s engine fetches a Hugging Face model id itself (inside its container), so
    ``engine.model`` need not be a local folder: the target module's ``FETCHES_HUB_MODELS``."""
    return bool(getattr(_module_of(target), "FETCHES_HUB_MODELS", False))


def engine_api_key(target: str, matrix: "Matrix") -> str | None:
    """A key ``target`` hands its engine from the environment (not from engine.extra_args), which the
    load generator must then send on /v1/*: the target module's optional ``engine_api_key(matrix)``."""
    hook = getattr(_module_of(target), "engine_api_key", None)
    return hook(matrix) if hook is not None else None


def node_engines() -> list[str]:
    """The targets whose engine another target can run on its nodes (``ray.engine``): a target
    module's ``NODE_ENGINE`` names the module of its hooks (:class:`kvrepro.deploy.base.NodeEngine`)."""
    return [name for name in known_targets() if getattr(_module_of(name), "NODE_ENGINE", None)]


def node_engine(name: str) -> Any:
    """The node-engine hooks of target ``name`` (imported on demand: an SDK comes with them)."""
    module_name = getattr(_module_of(name), "NODE_ENGINE", None)
    if module_name is None:
        raise SpecError(f"target {name!r} cannot run its engine on another target's nodes; these can: "
                        f"{', '.join(node_engines())}")
    return importlib.import_module(module_name)


# --- what a target says about itself ------------------------------------------------------------
# Each is a name at the top of the target's module (its package's light __init__), read here, so
# that no stage outside deploy/ branches on a target's name (tests/test_layout.py checks that).

def shares_one_instance(target: str) -> bool:
    """Whether one instance of ``target`` may serve many runs of different matrices at once, each
    through a shallow copy holding its own matrix (``copy.copy`` and ``.loaded`` replaced): the
    target module's ``SHARED``. explore and the suite then open it once (sim: its engine zygote
    stays warm; ray: its connection, build bundles and progress actor are made once); any other
    target is opened per run by the matrix runner."""
    return bool(getattr(_module_of(target), "SHARED", False))


def builds_commits(target: str) -> bool:
    """Whether ``target`` builds a vLLM commit's source (``bisect --kind commits``), not only a
    release with patches: the target module's ``BUILDS_COMMITS``."""
    return bool(getattr(_module_of(target), "BUILDS_COMMITS", False))


def engine_always_gpu_free(target: str) -> bool:
    """Whether ``target`` always serves the GPU-free engine, so its `vllm serve` line always holds the
    GPU-free engine's arguments (``--num-gpu-blocks-override``): the target module's ``GPU_FREE``.
    Another target decides per run (docker: from its hosts' GPUs, ``docker.gpu_free``)."""
    return bool(getattr(_module_of(target), "GPU_FREE", False))


def with_capability(capability: Callable[[str], bool]) -> list[str]:
    """The targets for which ``capability`` (one of the questions above) holds, for a message."""
    return [name for name in known_targets() if capability(name)]


def runs_upstream_tests(target: str) -> bool:
    """Whether ``target`` runs vLLM's own tests (``kvrepro builds test --target``): its module
    defines ``upstream_tests``."""
    return getattr(_module_of(target), "upstream_tests", None) is not None


def upstream_tests(target: str, loaded: Any, base: str, on_line: Callable[[str], None]) -> Any:
    """The pytest runner ``target`` runs vLLM's own tests of release ``base`` with (the protocol of
    kvrepro.builds.upstream_tests), or None to run them here: the target module's
    ``upstream_tests(loaded, base, on_line)`` (ray: a job on the cluster; sim: here)."""
    hook = getattr(_module_of(target), "upstream_tests", None)
    if hook is None:
        raise SpecError(f"target {target!r} does not run vLLM's own tests; these do: "
                        f"{', '.join(with_capability(runs_upstream_tests))}")
    return hook(loaded, base, on_line)


def check_environment(target: str, matrix: "Matrix") -> None:
    """What ``target`` takes from the environment (ray: $RAY_ADDRESS), checked before anything is
    recorded: the target module's optional ``check_environment`` raises SpecError (exit 2)."""
    if target not in known_targets():
        return
    check = getattr(importlib.import_module(f"{__name__}.{target}"), "check_environment", None)
    if check is not None:
        check(matrix)


__all__ = ["EngineHandle", "Target", "builds_commits", "check_environment", "check_settings",
           "engine_always_gpu_free", "engine_api_key", "fetches_hub_models", "get_target", "known_targets",
           "node_engine", "node_engines", "register", "runs_upstream_tests", "shares_one_instance",
           "target_commands", "target_sections", "upstream_tests", "with_capability",
           "lift_target_keys", "where_ran"]
