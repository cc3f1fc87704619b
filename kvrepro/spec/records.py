"""The records the matrix spec hands on: what to build (a base release and a patch stack, or a
git commit) and what the load does to each request besides sending it.

Frozen dataclasses, written to JSON and read back with :func:`kvrepro.records.to_jsonable` /
:func:`kvrepro.records.from_jsonable`. ``RequestEvents`` lives here rather than in loadgen because
the matrix's ``load.events`` already types it (spec is the earliest stage that needs it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PatchRef:
    """One patch file of the stack, as matrix.yaml declares it."""

    name: str
    path: Path
    upstream: str
    sha256: str
    reverse: bool = False  # applied with `patch --reverse`: the build reverts the upstream change the file holds

    @property
    def label(self) -> str:
        """How reports and errors name it: a revert says so."""
        return f"{self.name} (reverse of {self.path.name})" if self.reverse else self.name


@dataclass(frozen=True)
class GitCommitSource:
    """A build's Python tree taken from a commit of a vLLM git checkout instead of the release
    wheel (the wheel of ``BuildPlan.base`` still supplies what git does not track)."""

    repo: str
    commit: str  # full sha


@dataclass(frozen=True)
class BuildPlan:
    """What to build: a base vLLM version plus an ordered patch stack.

    ``source`` None: the release wheel's ``vllm/``; a GitCommitSource: that commit's ``vllm/``
    on top of the release wheel (vLLM's precompiled developer install).

    ``name`` names the cell of the matrix: the build's name when the matrix has one base,
    ``<build>@<base>`` when ``base:`` lists several (see :func:`cell_name`). ``build`` is the
    matrix's build name (what ``expect:`` and ``--build`` refer to).
    """

    name: str
    base: str
    patches: tuple[PatchRef, ...]
    source: GitCommitSource | None = None
    build: str = ""

    @property
    def build_name(self) -> str:
        return self.build or self.name


def cell_name(build: str, base: str, several_bases: bool) -> str:
    """The name of one (base, build) cell: ``A`` with one base, ``A@0.30.0`` with several."""
    return f"{build}@{base}" if several_bases else build


@dataclass(frozen=True)
class StarterProject:
    """What `kvrepro init` wrote: a folder a new user can run the default experiment from."""

    folder: Path
    written: tuple[Path, ...]  # relative to ``folder``, in the order they were written
    catalogue: Path | None  # the defects/ override folder, when asked for
    next_steps: tuple[str, ...]  # the commands to run next, in order


@dataclass(frozen=True)
class RequestEvents:
    """What the load does to one request besides sending it (``load.events``), as the trace records it.

    ``pause_s`` and ``reset_prefix_cache`` happen before the request is sent (a phase boundary);
    ``priority`` goes in its body; ``abort`` is when the client gives up on it: ``queued`` (sent
    while the request before it is still in flight, dropped ``abort_after_s`` later without an
    answer), ``first_token`` (after the first streamed token) or ``tokens`` (after
    ``abort_after_tokens`` streamed tokens). An abort is a closed connection, which vLLM's server
    turns into an engine abort: the same thing a client that goes away does. ``burst``/``replay_of``:
    a burst sends earlier prompts again, ``burst`` of them at once.
    """

    abort: str | None = None  # "queued" | "first_token" | "tokens"
    abort_after_tokens: int | None = None
    abort_after_s: float | None = None
    priority: int | None = None
    pause_s: float | None = None
    reset_prefix_cache: str | None = None  # "local" | "external" (local and the connector's tier)
    burst: int | None = None  # on the first of a burst: it and the next burst-1 requests go out together
    replay_of: int | None = None  # the earlier request whose prompt this one sends again (a burst's)

    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))

    def merged(self, other: "RequestEvents") -> "RequestEvents":
        """This with ``other``'s set fields laid over it (two events on one request)."""
        return dataclasses.replace(self, **{f.name: getattr(other, f.name) for f in dataclasses.fields(other)
                                            if getattr(other, f.name) is not None})

    __json_omit_unset__ = True  # only the events that are set are written (load.jsonl, trace.jsonl)
