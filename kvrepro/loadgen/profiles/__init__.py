"""Load profiles: what each request of a run asks for. One module per profile.

A profile module defines ``PROFILE``, a :class:`Profile` subclass whose ``name`` is what
``load.profile`` in matrix.yaml selects, and whose ``Settings`` (a pydantic model) validates the
profile's own fields of the ``load:`` section. ``kvrepro matrix validate`` checks them with
``file:line`` like every other field, so a typo in a profile setting is caught before a run.
Modules are discovered by listing this package, so a new traffic shape is one new file.

A profile must be a pure function of ``(load, settings, seed, capacity, index)``: request
``index`` gets the same prompt whichever worker thread sends it and whenever, so two runs with
the same seed send the same requests (their order on the wire still depends on timing, unless
the run is sequential: ``load.concurrency: 1``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ...errors import SpecError
from ...spec.records import RequestEvents
from ...spec.matrix import FieldError, LoadSpec


class ProfileSettings(BaseModel):
    """Base of a profile's own settings: unknown fields are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class EngineCapacity:
    """How much KV the engine holds, in tokens: what eviction pressure is sized from.

    ``gpu_tokens`` is the GPU (device) prefix cache, ``offload_tokens`` the offload tier (None:
    unknown or unbounded), ``block_tokens`` the KV block and ``chunk_tokens`` the offload chunk
    (what one offload hit is counted in). Read from the engine's log when it says, else given.
    """

    gpu_tokens: int
    offload_tokens: int | None = None
    block_tokens: int = 16
    chunk_tokens: int = 16
    max_model_len: int | None = None
    source: str = "default"
    data_parallel_size: int = 1


DEFAULT_CAPACITY = EngineCapacity(gpu_tokens=1536, offload_tokens=None, block_tokens=16, chunk_tokens=16)


@dataclass(frozen=True)
class Prompt:
    """One request to send: token ids, output length, and what the profile wants recorded.

    ``fields`` go into the request's line of load.jsonl as they are (the shared-prefix
    profile records which document, how long a prefix and how long a suffix). ``rank``: the
    data-parallel rank the request is sent to (header ``X-data-parallel-rank``, which vLLM's
    server honours); None leaves the choice to vLLM's own load balancer. ``events``: aborts,
    priority, pauses and resets (:class:`~kvrepro.spec.records.RequestEvents`).
    """

    index: int
    tokens: tuple[int, ...]
    max_tokens: int
    fields: dict[str, Any] = field(default_factory=dict)
    rank: int | None = None
    # what the load does to it besides sending it (load.events; a replay: the trace's); None: not
    # decided yet (the runner asks load.events_for)
    events: RequestEvents | None = None


class Profile(ABC):
    """A traffic shape. Built once per run from the load spec, its settings and the run's seed."""

    name: ClassVar[str]
    Settings: ClassVar[type[ProfileSettings]] = ProfileSettings
    # the field of Prompt.fields that names what a request reuses (a family, a session, a
    # document): with ``load.dp_routing: affinity`` requests with the same value go to one rank
    affinity_field: ClassVar[str | None] = None

    def __init__(self, load: LoadSpec, seed: int, capacity: EngineCapacity | None = None):
        self.load = load
        self.seed = seed
        self.capacity = capacity or DEFAULT_CAPACITY
        self.settings = self.Settings.model_validate(profile_fields(load))

    @abstractmethod
    def prompt(self, index: int) -> Prompt:
        """The request number ``index`` (0-based) of the run."""

    def routed(self, index: int) -> Prompt:
        """``prompt(index)`` with its data-parallel rank set when the load routes by affinity (as
        a prefix-aware router does): every request of one family on one rank, ranks in turn."""
        prompt = self.prompt(index)
        ranks = self.capacity.data_parallel_size if self.capacity is not None else 1
        if (prompt.rank is None and ranks > 1 and getattr(self.load, "dp_routing", "engine") == "affinity"
                and self.affinity_field and self.affinity_field in prompt.fields):
            key = prompt.fields[self.affinity_field]
            rank = key % ranks if isinstance(key, int) else int(hashlib.sha256(str(key).encode()).hexdigest(), 16) % ranks
            prompt = dataclasses.replace(prompt, rank=rank)
        return prompt

    def describe(self) -> dict[str, Any]:
        """What the trace header records about how this run's prompts were made."""
        return {"profile": self.name, "seed": self.seed, "settings": self.settings.model_dump(),
                "capacity": self.capacity.__dict__}


def profile_fields(load: LoadSpec) -> dict[str, Any]:
    """The ``load:`` fields that belong to the profile (everything LoadSpec does not know)."""
    return dict(getattr(load, "model_extra", None) or {})


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


def check_settings(load: LoadSpec) -> None:
    """The profile's own ``load:`` fields, checked by its ``Settings``; raises the spec's
    FieldError (file:line and field in the message). kvrepro.matrix hands this to parse_matrix.
    """
    try:
        profile = get_profile(load.profile)
    except SpecError as exc:
        raise FieldError("load.profile", str(exc).removeprefix("load.profile: ")) from None
    try:
        profile.Settings.model_validate(profile_fields(load))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if not where:  # a cross-field check: its message starts with the field it is about
            named = [f for f in profile.Settings.model_fields if str(first["msg"]).removeprefix("Value error, ")
                     .startswith(f)]
            where = max(named, key=len) if named else ""
        if first["type"] == "extra_forbidden":
            allowed = ", ".join(list(LoadSpec.model_fields) + list(profile.Settings.model_fields))
            msg = f"unknown field (not a setting of profile {load.profile!r}); allowed here: {allowed}"
        else:
            msg = first["msg"].removeprefix("Value error, ")
        raise FieldError(f"load.{where}" if where else "load.profile",
                          f"{msg} (profile {load.profile!r})" if first["type"] != "extra_forbidden" else msg) from None
