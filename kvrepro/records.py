"""Typed records passed between pipeline stages.

Each stage (spec -> builds -> deploy -> loadgen -> classify -> results -> report) takes and
returns these records and nothing else, so that a stage can be replaced (a new deploy target, a
new load profile) without the others knowing. They are plain frozen dataclasses so that they
serialise to JSON with :func:`to_jsonable` and can be read back from ``results/``.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Verdict(str, enum.Enum):
    """What one run of one build proves (mozregression-style: verdicts are data)."""

    CRASH = "CRASH"  # the engine died; `outcome` says whether on the target signature
    CORRUPT = "CORRUPT"  # no crash, but the shadow KV caught a forward reading wrong KV (ranks with CRASH)
    SURVIVED = "SURVIVED"  # the whole budget ran AND the bug's state occurred (state_count > 0)
    UNREACHED = "UNREACHED"  # the trigger path ran (trigger_count > 0) but the bug's state never did
    VACUOUS = "VACUOUS"  # the whole budget ran but the trigger path never ran: proves nothing
    STALL = "STALL"  # the engine stopped making progress without dying
    INTERRUPTED = "INTERRUPTED"  # stopped by the user (Ctrl-C) before the budget was spent
    INFRA = "INFRA"  # could not build, start or drive the engine: says nothing about the code


class Outcome(str, enum.Enum):
    """What the classifier found in an engine log."""

    TARGET = "target"  # the crash signature the matrix is about
    OTHER_CRASH = "other_crash"  # some other fatal error
    INFRA = "infra"  # the log shows the engine never got going (import error, bad config)
    NONE = "none"  # no fatal error in the log


@dataclass(frozen=True)
class PatchRef:
    """One patch file of the stack, as matrix.yaml declares it."""

    name: str
    path: Path
    upstream: str
    sha256: str


@dataclass(frozen=True)
class BuildPlan:
    """What to build: a base vLLM version plus an ordered patch stack.

    ``name`` names the cell of the matrix: the build's name when the matrix has one base,
    ``<build>@<base>`` when ``base:`` lists several (see :func:`cell_name`). ``build`` is the
    matrix's build name (what ``expect:`` and ``--build`` refer to).
    """

    name: str
    base: str
    patches: tuple[PatchRef, ...]
    build: str = ""

    @property
    def build_name(self) -> str:
        return self.build or self.name


def cell_name(build: str, base: str, several_bases: bool) -> str:
    """The name of one (base, build) cell: ``A`` with one base, ``A@0.30.0`` with several."""
    return f"{build}@{base}" if several_bases else build


@dataclass(frozen=True)
class PatchFailure:
    """A hunk that did not apply: names the patch, the file and the hunk."""

    patch: str
    file: str
    hunk: str
    detail: str

    def __str__(self) -> str:
        return f"patch {self.patch}: {self.file}: hunk {self.hunk} does not apply ({self.detail})"


@dataclass(frozen=True)
class BuildArtifact:
    """The result of building one BuildPlan for a target: a runnable engine, or why not.

    ``ref`` names what the target runs: for `sim` the overlay directory holding the patched
    ``vllm`` package and the probe (put in front of the shared runtime env's ``sys.path``), for
    `docker` the image tag. ``error`` is set (and ``ref`` is None) when the build failed; every
    run of that build is then INFRA while the other builds go on.
    """

    plan: BuildPlan
    ref: str | None
    manifest: dict[str, Any]
    error: str | None = None
    reused: bool = False
    # a host folder holding the build's (patched) ``vllm/`` sources, so the classifier can turn a
    # traceback's file:line into the whole failing statement
    source_root: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ref is not None


@dataclass(frozen=True)
class Signature:
    """A crash signature extracted from a traceback (syzkaller-style title material)."""

    exception: str
    function: str
    file: str
    line: int | None
    expression: str


@dataclass(frozen=True)
class Classification:
    outcome: Outcome
    title: str
    signature: Signature | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome.value,
            "title": self.title,
            "signature": dataclasses.asdict(self.signature) if self.signature else None,
        }


@dataclass(frozen=True)
class Exposure:
    """Evidence that the code path under test actually ran (read from the probe's output).

    ``trigger_calls``: calls of update_state_after_alloc with both a local prefix hit and an
    offload hit -- the crash's precondition. ``external_hit_calls``: calls with an offload hit at
    all. A SURVIVED verdict needs trigger_calls > 0.
    """

    trigger_calls: int = 0
    external_hit_calls: int = 0
    probe_source_sha256: str | None = None
    probe_seen: bool = False
    # trigger calls in which the bug's own state was there (a non-null, unhashed block below the
    # local boundary in some group), and per kind of group how many calls it was in that kind
    state_calls: int = 0
    state_groups: dict[str, int] = field(default_factory=dict)
    # the sim engine's shadow KV: contexts checked, violations (silent KV corruption), the first
    kv_checks: int = 0
    kv_violations: int = 0
    kv_violations_by: dict[str, int] = field(default_factory=dict)  # group kind[+offload] -> violations
    kv_first_violation: str | None = None
    shadow_seen: bool = False

    @property
    def kv_check(self) -> str:
        """``"corrupt"``, ``"ok"`` or ``"off"`` (no shadow KV ran: docker, or a real GPU)."""
        if self.kv_violations:
            return "corrupt"
        return "ok" if self.shadow_seen and self.kv_checks else "off"


@dataclass(frozen=True)
class EngineCounters:
    """The GPU-free engine's own totals (from its log); None: unknown (another engine, no report)."""

    steps: int | None = None
    offload_load_jobs: int | None = None
    offload_store_jobs: int | None = None


@dataclass(frozen=True)
class LoadSummary:
    """What the load generator did in one run."""

    requests_sent: int
    requests_ok: int
    requests_failed: int
    seconds: float
    stopped_because: str  # "budget" | "duration" | "engine_dead" | "stall" | "interrupted"


@dataclass(frozen=True)
class RunResult:
    """The verdict of one repetition of one build, as written to verdict.json."""

    build: str
    rep: int
    verdict: Verdict
    outcome: Outcome
    title: str
    trigger_count: int
    external_hit_calls: int
    requests: int
    seconds: float
    state_count: int = 0  # trigger calls in which the bug's state occurred
    state_groups: dict[str, int] = field(default_factory=dict)  # kind of group -> calls
    kv_check: str = "off"  # shadow KV: "ok" | "corrupt" | "off"
    signature: Signature | None = None
    infra_error: str | None = None
    run_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    base: str = ""  # the vLLM release this run's build is based on


def to_jsonable(value: Any) -> Any:
    """Turn records (and nested containers of them) into JSON-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value
