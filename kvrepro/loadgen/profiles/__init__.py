"""Load profiles: what each request of a run asks for. One module per profile.

A profile module defines ``PROFILE``, a :class:`Profile` subclass whose ``name`` is what
``load.profile`` in matrix.yaml selects. Modules are discovered by listing this package, so a
new traffic shape is one new file.

A profile must be a pure function of ``(load, seed, index)``: request ``index`` gets the same
prompt whichever worker thread sends it and whenever, so two runs with the same seed send the same
requests (their order on the wire still depends on timing).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from ...errors import SpecError
from ...spec import LoadSpec


@dataclass(frozen=True)
class Prompt:
    """One request to send: token ids, output length, and what the profile wants recorded.

    ``fields`` go into the request's line of requests.jsonl as they are (the shared-prefix
    profile records which document, how long a prefix and how long a suffix).
    """

    index: int
    tokens: tuple[int, ...]
    max_tokens: int
    fields: dict[str, int] = field(default_factory=dict)


class Profile(ABC):
    """A traffic shape. Built once per run from the load spec and the run's seed."""

    name: ClassVar[str]

    def __init__(self, load: LoadSpec, seed: int):
        self.load = load
        self.seed = seed

    @abstractmethod
    def prompt(self, index: int) -> Prompt:
        """The request number ``index`` (0-based) of the run."""


@functools.lru_cache(maxsize=1)
def known_profiles() -> dict[str, type[Profile]]:
    found: dict[str, type[Profile]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        cls = getattr(module, "PROFILE", None)
        if not (isinstance(cls, type) and issubclass(cls, Profile)):
            raise TypeError(f"{module.__file__}: a profile module must define PROFILE = <Profile subclass>")
        if cls.name in found:
            raise ValueError(f"{module.__file__}: profile name {cls.name!r} is already used")
        found[cls.name] = cls
    return found


def get_profile(name: str) -> type[Profile]:
    """The profile class for ``load.profile``; a SpecError lists the known ones otherwise."""
    profiles = known_profiles()
    try:
        return profiles[name]
    except KeyError:
        known = ", ".join(sorted(profiles)) or "(none installed)"
        raise SpecError(f"load.profile: unknown profile {name!r}; known profiles: {known} "
                        f"(each is a file in kvrepro/loadgen/profiles/)") from None
