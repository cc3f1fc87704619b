"""Typed records passed between pipeline stages.

Each stage (spec -> builds -> deploy -> loadgen -> classify -> results -> report) takes and
returns these records and nothing else, so that a stage can be replaced (a new deploy target, a
new load profile) without the others knowing. They are plain frozen dataclasses so that they
serialise to JSON with :func:`to_jsonable` and can be read back from ``results/``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Verdict(str, enum.Enum):
    """What one run of one build proves (mozregression-style: verdicts are data)."""

    CRASH = "CRASH"  # the engine died; `outcome` says whether on the target signature
    CORRUPT = "CORRUPT"  # the engine lived but the shadow KV check caught stale/missing/misplaced KV
    SURVIVED = "SURVIVED"  # the whole budget ran AND the bug's state occurred (state_count > 0)
    UNREACHED = "UNREACHED"  # the both-hit path ran but the bug's state never occurred
    VACUOUS = "VACUOUS"  # the whole budget ran but the trigger path never ran: proves nothing
    STALL = "STALL"  # the engine stopped making progress without dying
    INTERRUPTED = "INTERRUPTED"  # stopped by the user (Ctrl-C) before the budget was spent
    INFRA = "INFRA"  # could not build, start or drive the engine: says nothing about the code
    # read back only, never written: the repetition left files but no verdict (kvrepro was killed)
    INCOMPLETE = "INCOMPLETE"
    # read back only, never written: its verdict.json is damaged (truncated, empty, not a verdict)
    DAMAGED = "DAMAGED"


class Outcome(str, enum.Enum):
    """What the classifier found in an engine log."""

    TARGET = "target"  # the crash signature the matrix is about
    OTHER_CRASH = "other_crash"  # some other fatal error
    INFRA = "infra"  # the log shows the engine never got going (import error, bad config)
    NONE = "none"  # no fatal error in the log



# How kvrepro's load names each request to the engine (X-Request-Id ``kvrepro-<index>``; vLLM makes
# it ``cmpl-kvrepro-<index>-0-<hex>``): the load sends it, the classifier reads it back from what the
# engine logs about a request. Here, not in loadgen, so that reading a log does not import the client.
REQUEST_ID_PREFIX = "kvrepro-"

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
class PatchFailure:
    """A hunk that did not apply: names the patch, the file and the hunk."""

    patch: str
    file: str
    hunk: str
    detail: str

    def __str__(self) -> str:
        return f"patch {self.patch}: {self.file}: hunk {self.hunk} does not apply ({self.detail})"


Json = Any  # a value as json.loads returns it


@dataclass(frozen=True)
class ManifestPatch:
    """A patch as a build manifest names it."""

    name: str
    sha256: str
    upstream: str | None = None
    reverse: bool = False  # the build applied it in reverse (reverted the upstream change)

    def __json__(self) -> dict[str, Any]:
        # `reverse` only when set: manifests of forward builds read and write back as before
        data: dict[str, Any] = {"name": self.name, "sha256": self.sha256, "upstream": self.upstream}
        return {**data, "reverse": True} if self.reverse else data


@dataclass(frozen=True)
class FileChange:
    """A file a docker build's patches touched: its sha256 before and after (None: added/removed)."""

    before: str | None
    after: str | None


@dataclass(frozen=True)
class ProbeRef:
    """Where an image holds the probe, and its sha256."""

    path: str
    sha256: str


@dataclass(frozen=True)
class ImageRef:
    tag: str
    id: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HostImage:
    """One docker host's copy of a build's image."""

    image_id: str
    reused: bool
    seconds: float


def _json_of(value: Any) -> Any:
    return to_jsonable(value)


@dataclass(frozen=True)
class BuildManifest:
    """What the target wrote about a build's artifact (``build.json``'s ``manifest``, an overlay's
    ``manifest.json``, a docker image's manifest label).

    Which fields are set depends on the kind of build: a release overlay (kvrepro.builds.overlay),
    a git commit's overlay (kvrepro.builds.gitcommit: ``source``, ``repo``, ``commit``,
    ``from_wheel``), a docker image (kvrepro.deploy.docker.assemble and its target: ``format`` to
    ``probe``, then ``image`` and ``hosts``), or a failed build (``error_kind``). Keys this kvrepro
    does not know are kept in ``extra`` (and written back), so manifests already on disk are read
    whatever wrote them.
    """

    base: str | None = None
    patches: tuple[ManifestPatch, ...] | None = None
    # overlays (the sim target)
    wheel: str | None = None
    wheel_sha256: str | None = None
    probe_sha256: str | None = None
    probe_target_sha256: str | None = None  # what the probe must log as source_sha256 when this code runs
    overlay_key: str | None = None
    overlay_sha256: str | None = None
    created: str | None = None
    # a git commit's overlay
    source: str | None = None
    repo: str | None = None
    commit: str | None = None
    from_wheel: tuple[str, ...] | None = None
    # docker images
    format: int | None = None
    key: str | None = None
    tag: str | None = None
    base_image: str | None = None
    base_image_id: str | None = None
    base_digest: str | None = None
    base_digest_source: str | None = None
    vllm_version_in_base: str | None = None
    python_in_base: str | None = None
    site_dir: str | None = None
    files: dict[str, FileChange] | None = None
    probe: ProbeRef | None = None
    image: ImageRef | None = None
    hosts: dict[str, HostImage] | None = None
    # a failed build
    error_kind: str | None = None
    extra: dict[str, Json] = field(default_factory=dict)

    @classmethod
    def from_json(cls, value: Json, where: str = "manifest") -> "BuildManifest":
        """Lenient on purpose: unknown keys go to ``extra``; a known key of the wrong type raises
        :class:`RecordError` naming it."""
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise RecordError(where, f"expected an object, found {type(value).__name__}")
        hints = type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: from_jsonable(hints[k], v, f"{where}.{k}") for k, v in value.items() if k in known}
        extra = {k: v for k, v in value.items() if k not in known}
        return cls(**kwargs, extra=extra)

    def to_json(self) -> dict[str, Json]:
        """The flat JSON object it was read from: only the fields that are set, then ``extra``."""
        data = {f.name: _json_of(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name != "extra" and getattr(self, f.name) is not None}
        data.update(self.extra)
        return data

    __json__ = to_json

    @property
    def probe_hash(self) -> str | None:
        """The probe's sha256: an overlay's ``probe_sha256`` or an image's ``probe.sha256``."""
        return self.probe_sha256 or (self.probe.sha256 if self.probe is not None else None)


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
    manifest: BuildManifest
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
    # `vllm serve` refused its arguments (argparse): its message; the run tested nothing (INFRA),
    # and the suite reads an option the release lacks from here (NOT TESTABLE)
    refused_arguments: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = {
            "outcome": self.outcome.value,
            "title": self.title,
            "signature": dataclasses.asdict(self.signature) if self.signature else None,
        }
        return {**data, "refused_arguments": self.refused_arguments} if self.refused_arguments else data


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
    # violation class (kvrepro.engine.shadow: group kind[+offload]/read/region) -> violations
    kv_violations_by: dict[str, int] = field(default_factory=dict)
    kv_first_violation: str | None = None
    kv_first_violation_class: str | None = None
    kv_groups: tuple[str, ...] = ()  # kinds of the engine's KV groups, from the shadow KV's installed line
    shadow_seen: bool = False
    # paths the shadow KV saw run: requests resumed from a prefix hit per group kind ("+offload" when
    # blocks were loaded for them), and blocks stored to the offload tier per group kind
    kv_hit_reads: dict[str, int] = field(default_factory=dict)
    kv_stored: dict[str, int] = field(default_factory=dict)
    # violation class -> the first request (1-based, as load.jsonl's index + 1) a described violation
    # of it was about; only requests the load named (X-Request-Id kvrepro-<index>)
    kv_first_request_by_class: dict[str, int] = field(default_factory=dict)
    # the waiting-queue stall's path (vllm#57841; the probe's module docstring): offload lookups that
    # returned None (the request parked without blocks), and offload loads admitted after another
    # request's lookup was deferred in the same scheduling pass (a load queued behind a block-less request)
    deferred_lookups: int = 0
    loads_behind_deferred: int = 0
    finished_unscheduled: int = 0  # probe: tracked requests finished with no token computed (aborted queued)
    # probe: divergent local hybrid hits handed to the connector, and those it then loaded past
    divergent_hits: int = 0
    divergent_loads: int = 0
    # probe: partial-tail copy-on-writes, and local hits truncated to the block for a longer offload hit
    cow_calls: int = 0
    truncate_calls: int = 0
    partial_hits: int = 0
    lookups_in_flight: int = 0  # probe: lookups while the request's own transfers were in flight (#46014)
    # injected offload-tier faults (engine.sim.offload_faults; the engine's `kvrepro-fault:` lines): failed
    # load and store jobs, and the requests a failed load ended with an error on purpose (policy `fail`)
    injected_load_faults: int = 0
    injected_store_faults: int = 0
    injected_failed_requests: int = 0
    # the probe's invariants at quiescent points (kvrepro/classify/invariants.py): checks made, the
    # quiescent points each invariant failed at (by name), the first failure in words
    invariant_checks: int = 0
    invariants_broken: dict[str, int] = field(default_factory=dict)
    first_broken: str | None = None
    # where the engine waited when nothing was scheduled for a while (the probe's last stall-state
    # line): a key naming no request (the blocked request's status and queues, what it was refused
    # against, what the others hold) and its words; None: the engine never sat idle with work
    stall_where: str | None = None
    stall_state: str | None = None

    @property
    def kv_check(self) -> str:
        """``"corrupt"``, ``"ok"`` or ``"off"`` (no shadow KV ran: docker, or a real GPU)."""
        if self.kv_violations:
            return "corrupt"
        return "ok" if self.shadow_seen and self.kv_checks else "off"


# The probe's plain counters (kvrepro/probe/kvrepro_probe.py prints them as ``name=<N>`` on its
# counts line): name -> what it counts. Each is a field of Exposure and of RunResult of the same
# name; the probe's reader (classify/exposure.py) adds them up over processes and the suite offers
# them as "path ran" counters, both from this table. A new probe counter is a line here, its two
# fields, and the probe's own code: nothing else changes.
PROBE_COUNTERS: dict[str, str] = {
    "deferred_lookups": "offload lookups that returned None: the request parked without blocks (probe)",
    "loads_behind_deferred": "offload loads admitted in a scheduling pass after another request's lookup was "
                             "deferred in it: a load holding blocks behind a block-less request (probe)",
    "finished_unscheduled": "requests the OffloadingConnector tracked that finished with no token computed: "
                            "aborted while queued, never scheduled (probe)",
    "divergent_hits": "local prefix hits handed to the connector with full attention deeper than a lagging Mamba "
                      "group's (get_computed_blocks_for_connector's hit_diverged; from 0.28.0 only for a connector "
                      "declaring supports_divergent_local_hybrid_hits) (probe)",
    "divergent_loads": "divergent hits whose offload lookup then found tokens to load: the request resumes past the "
                       "lagging Mamba state, which the connector must restore (probe)",
    "cow_calls": "copy-on-writes of a shared partial tail block (SingleTypeKVCacheManager._apply_cow, 0.26.0+): "
                 "a local hit ending inside a block was taken (probe)",
    "truncate_calls": "local hits with a partial tail cut back to the block boundary because a longer offload hit "
                      "supersedes them (KVCacheManager.truncate_computed_blocks, 0.27.0+) (probe)",
    "partial_hits": "requests whose local hit ended inside a block, once each: full attention's copy-on-write or "
                    "the truncation for a longer offload hit (probe)",
    "lookups_in_flight": "offload lookups of a request whose own transfer jobs were still in flight: a preempted "
                         "request re-admitted before its flushed stores were reported done (#46014's window; "
                         "#46231 defers the lookup) (probe)",
}


@dataclass(frozen=True)
class EngineCounters:
    """The GPU-free engine's own totals (from its log); None: unknown (another engine, no report)."""

    steps: int | None = None
    offload_load_jobs: int | None = None
    offload_store_jobs: int | None = None


@dataclass(frozen=True)
class Judgement:
    """One engine log judged (kvrepro.classify.judge): what killed the engine, what the probe and the
    shadow KV saw, the engine's own totals, the corruption defects, the verdict and its title.
    The runner, the results read-back and `kvrepro classify` all take their verdict from this."""

    classification: Classification
    exposure: Exposure
    counters: EngineCounters
    defects: dict[str, int]  # violations per known corruption defect ("unknown": no signature knows it)
    verdict: Verdict | None  # None: judged from the log alone, without the run's load (`kvrepro classify`)
    title: str
    external_prefix_cache_hits: int = 0  # from the engine's /metrics at the end of the run
    prefix_cache_hits: int = 0


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

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, value: Any) -> "RequestEvents":
        if not isinstance(value, dict):
            raise TypeError(f"events must be an object, not {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise TypeError(f"unknown event field(s) {', '.join(unknown)}")
        return cls(**value)


@dataclass(frozen=True)
class LoadSummary:
    """What the load generator did in one run."""

    requests_sent: int
    requests_ok: int
    requests_failed: int
    seconds: float
    stopped_because: str  # "budget" | "duration" | "engine_dead" | "stall" | "interrupted" | "settled"
    first_failed_index: int | None = None  # the first request that failed as the engine died (or 5xx)
    # "settled": the stopping rule's words (kvrepro/classify/settle.py), e.g. "state_count 29 ..."
    settled_by: str | None = None


@dataclass(frozen=True)
class StopRule:
    """Which counts settle one run early (docs/statistics.md, "Sequential stopping per run").

    ``counter``: the events a crash rate (and a corruption rate) is bounded per -- the bug's
    state by default, a suite entry's path counter there. ``path_counter``: the path on which
    ``counter`` may arise; when it ran ``events`` times with ``counter`` still at 0 the rate of the
    state per path call is bounded instead (None: no such claim). ``events``: how many events
    without the failure settle it (kvrepro.classify.settle.events_needed: 29 for < 10% at 95%).
    Names are RunResult's counter names (``trigger_count``, ``kv_hit_reads.mamba``).
    """

    counter: str = "state_count"
    path_counter: str | None = "trigger_count"
    events: int = 29


# Version of the layout of results/<run>/run.json and every verdict.json. Bump it when a field
# changes meaning or type (adding an optional field with a default does not need a bump);
# results.load_run refuses other versions with one line naming the folder and what to do.
RESULTS_SCHEMA = 2


@dataclass(frozen=True)
class NodeInfo:
    """The cluster node a run's engine ran on (`ray` target): Ray's node id and the node's address."""

    node_id: str
    address: str

    @property
    def label(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


@dataclass(frozen=True)
class FsTierFolder:
    """One ``fs`` offload tier of a run: the root_dir the matrix named and the folder of the run's
    own the engine was given instead (kvrepro/spec/fs_tier.py says why), as the engine saw it."""

    tier: int           # index in --kv-transfer-config's secondary_tiers
    configured: str     # root_dir as the matrix wrote it
    engine_root_dir: str  # root_dir the engine got: <run folder>/fs-tier-<tier> (a container path on docker)


@dataclass(frozen=True)
class RunResult:
    """The verdict of one repetition of one build, as written to verdict.json and read back.

    Everything a report, a comparison or CI needs is a typed field here (no free-form dicts to
    dig through); fields added later carry defaults so that older verdict.json files of the same
    schema still read.
    """

    build: str
    rep: int
    verdict: Verdict
    outcome: Outcome
    title: str
    trigger_count: int
    external_hit_calls: int
    requests: int
    seconds: float  # wall time of the repetition, engine start included
    signature: Signature | None = None
    infra_error: str | None = None
    run_dir: str | None = None
    # the vLLM release this run's build sits on; None in files written before the base axis:
    # readers then take the run's top-level base (see results.MatrixRun)
    base: str | None = None
    # the bug's own state (issue 7): calls in which it occurred, by kind of KV group, and the
    # shadow-KV check's result ("ok", "corrupt" or "off" when the engine did not check)
    state_count: int = 0
    state_groups: dict[str, int] = field(default_factory=dict)
    kv_check: str = "off"
    # the shadow KV's numbers: contexts checked, violations (once per request, group and block),
    # violations by class (kind of group, "+offload" when the request had an offload hit, what the
    # read found, where), the first one
    kv_checks: int = 0
    kv_violations: int = 0
    kv_violations_by: dict[str, int] = field(default_factory=dict)
    kv_first_violation: str | None = None
    kv_first_violation_class: str | None = None
    kv_groups: tuple[str, ...] = ()  # kinds of the engine's KV groups (the shadow KV's installed line)
    # violations per known corruption defect (kvrepro.classify.corruption; "unknown" for a class
    # no signature knows), attributed when the run was classified
    kv_defects: dict[str, int] = field(default_factory=dict)
    # paths that ran (Exposure): requests resumed from a hit per group kind[+offload], blocks stored per kind
    kv_hit_reads: dict[str, int] = field(default_factory=dict)
    kv_stored: dict[str, int] = field(default_factory=dict)
    # violation class -> the first request (1-based) a described violation of it was about (Exposure);
    # kvrepro.classify.corruption.first_request names the defect's
    kv_first_request_by_class: dict[str, int] = field(default_factory=dict)
    # what the probe had to log as the wrapped method's hash (the build manifest's); None: unknown
    probe_expected_sha256: str | None = None
    load: LoadSummary | None = None
    engine_exit: int | None = None
    probe_seen: bool = False
    probe_source_sha256: str | None = None
    # the engine's own totals (None: unknown, which is not 0) and its /metrics at the end of the run
    offload_load_jobs: int | None = None
    offload_store_jobs: int | None = None
    engine_steps: int | None = None
    engine_start_s: float | None = None  # from launch until the engine answered /health
    external_prefix_cache_hits: int = 0
    prefix_cache_hits: int = 0
    # the waiting-queue stall's path (Exposure): deferred offload lookups, loads admitted behind one
    deferred_lookups: int = 0
    loads_behind_deferred: int = 0
    finished_unscheduled: int = 0  # probe: tracked requests finished with no token computed (aborted queued)
    # probe: divergent local hybrid hits handed to the connector, and those it then loaded past
    divergent_hits: int = 0
    divergent_loads: int = 0
    # probe: partial-tail copy-on-writes, and local hits truncated to the block for a longer offload hit
    cow_calls: int = 0
    truncate_calls: int = 0
    partial_hits: int = 0
    lookups_in_flight: int = 0  # probe: lookups while the request's own transfers were in flight (#46014)
    # injected offload-tier faults (Exposure): failed load and store jobs, requests failed on purpose
    injected_load_faults: int = 0
    injected_store_faults: int = 0
    injected_failed_requests: int = 0
    # the engine's invariants at quiescent points (Exposure; kvrepro/classify/invariants.py)
    invariant_checks: int = 0
    invariants_broken: dict[str, int] = field(default_factory=dict)
    first_broken: str | None = None
    # where the engine waited when nothing was scheduled for a while (the probe's last stall-state
    # line): a key naming no request (the blocked request's status and queues, what it was refused
    # against, what the others hold) and its words; None: the engine never sat idle with work
    stall_where: str | None = None
    stall_state: str | None = None
    # `ray` target: the node the engine ran on, and why earlier attempts of this run were
    # INFRA (a node lost mid-run; the run was retried elsewhere and this record is the retry's)
    node: NodeInfo | None = None
    retried_after: tuple[str, ...] = ()
    # `ray` target, ray.nodes_per_engine > 1: every node of the run's placement group, bundle
    # order (bundle 0 first: the node the engine's task ran on, the same as ``node``)
    placement_nodes: tuple[NodeInfo, ...] = ()
    # the engine's `vllm serve` refused its arguments (Classification.refused_arguments): the
    # suite's NOT TESTABLE (the release lacks an entry's engine option); None otherwise
    refused_arguments: str | None = None
    schema: int = RESULTS_SCHEMA

    @property
    def label(self) -> str:
        """CRASH(target) / CRASH(other) / SURVIVED / ... as the table and `expect:` spell it."""
        if self.verdict is Verdict.CRASH:
            return "CRASH(target)" if self.outcome is Outcome.TARGET else "CRASH(other)"
        return self.verdict.value

    @property
    def load_seconds(self) -> float:
        """Seconds under load (engine start excluded): the time axis of a time-to-crash curve."""
        return self.load.seconds if self.load is not None else self.seconds

    @classmethod
    def judged(cls, judgement: Judgement, **run: Any) -> RunResult:
        """A repetition's record from its judgement (kvrepro.classify.judge) and ``run``, the
        repetition's own fields (build, rep, requests, seconds, run_dir, base, load, ...).

        Every Exposure field that RunResult also has is copied by name: a new probe counter is a
        field of both records and a line of the probe's reader, and nothing else changes."""
        exposure, counters = judgement.exposure, judgement.counters
        own = {f.name for f in dataclasses.fields(cls)}
        fields: dict[str, Any] = {f.name: _copied(getattr(exposure, f.name)) for f in dataclasses.fields(Exposure)
                                  if f.name in own}
        fields.update(
            verdict=judgement.verdict, outcome=judgement.classification.outcome, title=judgement.title,
            refused_arguments=judgement.classification.refused_arguments,
            signature=judgement.classification.signature, trigger_count=exposure.trigger_calls,
            state_count=exposure.state_calls, kv_check=exposure.kv_check, kv_defects=dict(judgement.defects),
            offload_load_jobs=counters.offload_load_jobs, offload_store_jobs=counters.offload_store_jobs,
            engine_steps=counters.steps, external_prefix_cache_hits=judgement.external_prefix_cache_hits,
            prefix_cache_hits=judgement.prefix_cache_hits)
        return cls(**fields, **run)


def _copied(value: Any) -> Any:
    """A record's own copy of a mutable field (frozen dataclasses still hold mutable dicts)."""
    return dict(value) if isinstance(value, dict) else value


@dataclass(frozen=True)
class PatchInfo:
    """A patch of a build's stack as the results record it (name, where it came from, sha256)."""

    name: str
    upstream: str = ""
    sha256: str = ""
    reverse: bool = False  # applied in reverse: the build reverts this upstream change

    def __json__(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "upstream": self.upstream, "sha256": self.sha256}
        return {**data, "reverse": True} if self.reverse else data


@dataclass(frozen=True)
class BuildRecord:
    """results/<run>/<build>/build.json: the build's artifact, or why it failed.

    ``manifest`` is what the target wrote about the artifact (an overlay's or an image's, a
    :class:`BuildManifest`); the properties below read what every report needs of it.
    """

    ok: bool
    ref: str | None = None
    error: str | None = None
    reused: bool = False
    manifest: BuildManifest = field(default_factory=lambda: BuildManifest())

    @property
    def wheel(self) -> str | None:
        return self.manifest.wheel

    @property
    def wheel_sha256(self) -> str | None:
        return self.manifest.wheel_sha256

    @property
    def probe_sha256(self) -> str | None:
        return self.manifest.probe_hash

    @property
    def image(self) -> str | None:
        return self.manifest.image.tag if self.manifest.image is not None else None


@dataclass(frozen=True)
class RunManifest:
    """results/<run>/<build>/<rep>/manifest.json: exactly what one repetition was going to run."""

    build: str
    rep: int
    base: str
    target: str
    patches: tuple[PatchInfo, ...] = ()
    artifact: BuildRecord | None = None
    engine_args: tuple[str, ...] | None = None
    sim_seed: int | None = None
    load_seed: int | None = None
    # The matrix's ``load:`` and ``runs:`` as recorded (LoadSpec / RunsSpec .model_dump()): kept as
    # the raw JSON mapping on purpose. records is the base layer and may not import spec (pydantic)
    # and a manifest must read back whatever a kvrepro of another version recorded there; the
    # report only shows them, and a replay re-validates the trace's own copy (Trace.load_spec).
    load: dict[str, Json] = field(default_factory=dict)
    runs: dict[str, Json] = field(default_factory=dict)
    kvrepro_version: str = ""
    replay_of: str | None = None  # the trace a `kvrepro load replay` sent instead of the matrix's load
    node: NodeInfo | None = None  # `ray` target: the node the run was sent to
    placement_nodes: tuple[NodeInfo, ...] = ()  # `ray` target: its placement group's nodes, bundle order
    fs_tiers: tuple[FsTierFolder, ...] = ()  # each fs offload tier's folder of this run (engine.extra_args)


@dataclass(frozen=True)
class HostInfo:
    """Where kvrepro itself ran (the docker target's engine hosts are in the build manifests)."""

    hostname: str = ""
    platform: str = ""
    python: str = ""
    cpus: int = 0


@dataclass(frozen=True)
class RunBuildEntry:
    """One (base, build) cell as run.json lists it, under its cell name (``A`` or ``A@0.30.0``)."""

    patches: tuple[str, ...] = ()
    base: str | None = None  # default: the run's base
    build: str | None = None  # the matrix's build name (what `expect:` names); default: the cell name


@dataclass(frozen=True)
class RunInfo:
    """results/<run>/run.json: what was run, and how far it got."""

    run_id: str
    status: str  # "running" | "complete" | "interrupted" | "failed" (with ``error``)
    schema: int = RESULTS_SCHEMA
    started: float | None = None
    finished: float | None = None
    matrix: str = ""
    matrix_sha256: str = ""
    target: str = ""
    base: str | tuple[str, ...] = ""  # one release, or every release when the run spans several
    bases: tuple[str, ...] = ()
    repetitions: int = 0  # the most any build runs (with `adaptive`, each stops once decisive)
    adaptive: bool = False
    build_order: tuple[str, ...] = ()
    builds: dict[str, RunBuildEntry] = field(default_factory=dict)
    expect: dict[str, str] = field(default_factory=dict)  # by matrix build name, as matrix.yaml says
    kvrepro_version: str = ""
    host: HostInfo | None = None
    # the kvrepro process running it (kvrepro/lifetime.py): "running" + owner gone = aborted
    owner: dict[str, str] | None = None
    error: str | None = None  # status "failed": what stopped it (a full disk, a read-only folder)

    @property
    def base_text(self) -> str:
        """The release(s) for a title: ``0.26.0`` or ``0.26.0, 0.30.0``."""
        from .versions import label

        return label(self.base) if isinstance(self.base, str) else ", ".join(label(b) for b in self.base)

    @property
    def default_base(self) -> str:
        """The base of a build that names none: the run's (first) release."""
        if isinstance(self.base, str):
            return self.base
        return self.base[0] if self.base else (self.bases[0] if self.bases else "")


@dataclass(frozen=True)
class SuiteBuildRecord:
    """One build of a suite run in suite.json: a release and the patch stack on it."""

    release: str
    patches: tuple[str, ...] = ()


@dataclass(frozen=True)
class SuiteEntryRecord:
    """One entry of a suite run in suite.json: the matrix run that ran it (a folder under runs/),
    or the line that stopped it before a run existed."""

    testable: bool = True
    run: str | None = None
    reps: int | None = None
    error: str | None = None
    # `suite run --patch`: the same entry on the releases without the stack, run when the stack's
    # runs failed, so that its failures the base does not show read as introduced by the stack
    base_run: str | None = None


@dataclass(frozen=True)
class SuiteRecord:
    """results/suite-<id>/suite.json, read back typed: a hand-edited or foreign file is one line
    naming the field (kvrepro.suite.run.load_suite), never a traceback or a silent misreading."""

    suite_id: str
    status: str  # "running" | "complete" | "interrupted"; shown "aborted" when running and its owner is gone
    started: float | None = None
    finished: float | None = None
    catalogue: str = ""
    command: str = ""
    kvrepro_version: str = ""
    builds: tuple[SuiteBuildRecord, ...] = ()
    entries: dict[str, SuiteEntryRecord] = field(default_factory=dict)
    # the kvrepro process running it (kvrepro/lifetime.py), as run.json's: a SIGKILLed suite reads aborted
    owner: dict[str, str] | None = None


class BisectPoint(typing.Protocol):
    """A point of a bisection (kvrepro.bisect.points: a release, a commit or a patch set)."""

    kind: str

    @property
    def key(self) -> str: ...

    @property
    def label(self) -> str: ...

    def to_json(self) -> dict[str, str | list[str]]: ...


# what a bisection adds about its answer: direction, the last/first points, a commit's subject, per
# patch what removing it does
BisectDetail = typing.Union[str, list[str], dict[str, str]]


@dataclass(frozen=True)
class BisectStep:
    """One point of a bisection and what its runs showed (written after every step).

    ``point`` is what was tried (a :class:`BisectPoint`: a release, a commit or a set of patches);
    ``label`` a short name for it. ``verdict`` is
    good / bad / skip (kvrepro.bisect.rules decides it from ``counts``, the run verdict labels
    seen). ``state`` says for a good point whether the bug's state occurred and was handled
    ("handled"), never occurred ("unreached") or both across runs ("mixed").
    """

    point: BisectPoint
    label: str
    role: str  # "bad end" | "good end" | "midpoint" | "subset" | "complement" | "removal"
    verdict: str
    counts: dict[str, int]
    runs_needed_for_good: int | None  # None at the bad end (it measures p_bad, it is never good)
    state: str | None = None
    reason: str = ""
    probe_runs: tuple[str, ...] = ()  # run folders (under the bisection's probes/) of this point
    seconds: float = 0.0


@dataclass(frozen=True)
class BisectResult:
    """What a bisection found: ``answer`` (release, commit or patch list) or None and ``reason``."""

    kind: str  # "releases" | "commits" | "patches" | "verdict"
    answer: str | list[str] | None
    reason: str
    confidence: float | None
    p_bad: float | None
    alpha: float
    steps: tuple[BisectStep, ...]
    status: str  # "running" | "interrupted" | "complete"
    bisection_id: str = ""
    path: str = ""
    detail: dict[str, BisectDetail] = field(default_factory=dict)



# -- vLLM's own tests on each build (kvrepro builds test; kvrepro/builds/upstream_tests.py) ---------


@dataclass(frozen=True)
class UpstreamTestRef:
    """One upstream regression test a patch header names (``# Upstream-Test:``): the release whose
    ``tests/`` carries it and its node id there."""

    patch: str
    release: str
    nodeid: str


@dataclass(frozen=True)
class CopiedHelper:
    """A helper a patch's upstream test needs, copied from the later release (never edited)."""

    name: str
    release: str
    file: str
    why: str  # "not in vllm 0.26.0's tests/" | "differs from vllm 0.26.0's"


@dataclass(frozen=True)
class UpstreamTestOutcome:
    """What one test did on one tree: passed, failed (with the assertion), error or skipped."""

    nodeid: str  # the id in the release's tests/, or ``vllm <release> <id>`` for a patch's test
    outcome: str  # "passed" | "failed" | "error" | "skipped" | "missing"
    message: str = ""  # the exception line (``AssertionError: assert 41 not in [41, 42]``)
    line: str = ""  # the failing source line, as pytest marks it with ``>``
    patch: str = ""  # the patch whose Upstream-Test this is ("" for the release's own tests)
    seconds: float = 0.0  # setup + call + teardown, as pytest timed them
    spawned: bool = False  # started a process (what it ran is not in coverage data: always run)
    not_run: str = ""  # why this build did not run it and took the release's outcome (impact rule)


@dataclass(frozen=True)
class ExcludedTest:
    """A test of the release left out of every build: it does not pass on the unpatched release."""

    nodeid: str
    why: str  # "skipped: <reason>" | "failed: <assertion>" | "error: <exception>"


@dataclass(frozen=True)
class UpstreamTestChange:
    """A test whose outcome on a build differs from the unpatched release, and which patch of the
    stack changed it (the first stack prefix on which the build's outcome appears)."""

    nodeid: str
    release_outcome: str
    build_outcome: str
    changed_by: str | None  # a patch name; None if no prefix of the stack reproduced it
    stack_position: int | None  # 1-based position of that patch in the build's stack
    message: str = ""
    later: str = ""  # what a newer release changed in the same test ("" when not looked up)


@dataclass(frozen=True)
class ChangedCode:
    """A unit of code a build's patch stack changed, as the test impact rule sees it
    (kvrepro/builds/upstream_impact.py): a function's body, or module-level code of a file."""

    file: str  # vllm/... (or tests/...)
    scope: str  # "function" | "module" | "new file" | "test file" | "other"
    name: str = ""  # the function's qualified name
    note: str = ""
    lines: tuple[int, int] = (0, 0)  # the function body's lines in the release's file


@dataclass(frozen=True)
class UpstreamBuildTests:
    """vLLM's own tests on one build: counts, every outcome, and what differs from the release."""

    build: str
    patches: tuple[str, ...]
    key: str  # the cache key: overlay key + tests + selection
    passed: int
    failed: int
    excluded: int
    outcomes: tuple[UpstreamTestOutcome, ...]
    changes: tuple[UpstreamTestChange, ...] = ()
    seconds: float = 0.0
    cached: bool = False
    error: str | None = None
    ran: int = 0  # tests run on this build; the rest took the release's outcome (``not_run`` says why)
    changed_code: tuple[ChangedCode, ...] = ()  # what the impact rule saw changed


@dataclass(frozen=True)
class PatchTestModule:
    """The module kvrepro wrote for one patch's upstream tests, and what it had to copy."""

    patch: str
    release: str
    tests: tuple[str, ...]
    helpers: tuple[CopiedHelper, ...] = ()
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class UpstreamTestRun:
    """``kvrepro builds test``: the release's CPU-runnable tests and the patches' tests on every build."""

    base: str
    sdist_sha256: str
    roots: tuple[str, ...]
    selected: int  # the release's tests that pass unpatched (run on every build)
    excluded: tuple[ExcludedTest, ...]
    patch_tests: tuple[PatchTestModule, ...]
    release: UpstreamBuildTests  # the unpatched release itself
    builds: tuple[UpstreamBuildTests, ...]
    seconds: float
    command: str = ""
    created: str = ""
    offline_models: tuple[str, ...] = ()  # model configs (config.json only) put in an offline HF hub cache
    impact_rule: bool = False  # builds ran only the tests that reach a change (False: --all)


def to_jsonable(value: Any) -> Any:
    """Turn records (and nested containers of them) into JSON-ready values."""
    if hasattr(value, "__json__") and not isinstance(value, type):  # a record with its own JSON form
        return value.__json__()
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


class RecordError(ValueError):
    """A JSON value does not fit the record type it should hold; ``field`` names where."""

    def __init__(self, field_path: str, problem: str):
        super().__init__(f"{field_path}: {problem}")
        self.field_path = field_path
        self.problem = problem


@functools.cache
def type_hints(cls: Any) -> dict[str, Any]:
    """``typing.get_type_hints`` once per record class: it compiles every annotation string each
    time, most of what reading a results folder cost (`results list` over 500 runs)."""
    return typing.get_type_hints(cls)


def from_jsonable(cls: Any, value: Any, where: str = "", *, readers: Mapping[Any, Callable[[Any, str], Any]] | None = None,
                  ignore_unknown: bool = False) -> Any:
    """Read back what :func:`to_jsonable` wrote, as the typed record it was.

    Strict on purpose: a key the record does not have, or a value of the wrong type, raises
    :class:`RecordError` naming the field, so a results folder from another kvrepro is reported
    instead of silently misread. Missing fields take their defaults.

    ``readers``: how to read a type records cannot know (a later stage's, e.g. a bisection's point:
    type -> ``read(value, where)``). ``ignore_unknown``: keys a record does not have are skipped,
    for a file format that promised to read files of newer kvrepros (bisect.json).
    """
    if readers and cls in readers:
        return readers[cls](value, where)
    more = {"readers": readers, "ignore_unknown": ignore_unknown}
    origin = typing.get_origin(cls)
    if cls is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(cls)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return from_jsonable(option, value, where, **more)
            except RecordError as exc:
                errors.append(exc.problem)
        raise RecordError(where or "value", "; ".join(errors) or f"unexpected {value!r}")
    if isinstance(cls, type) and hasattr(cls, "__json__") and hasattr(cls, "from_json"):
        return cls.from_json(value, where or cls.__name__)
    if dataclasses.is_dataclass(cls):
        if not isinstance(value, dict):
            raise RecordError(where or cls.__name__, f"expected an object, found {type(value).__name__}")
        hints = type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(value) - names)
        if unknown and not ignore_unknown:
            raise RecordError(f"{where}.{unknown[0]}" if where else unknown[0], f"not a field of {cls.__name__}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.name in value:
                kwargs[f.name] = from_jsonable(hints[f.name], value[f.name], f"{where}.{f.name}" if where else f.name,
                                               **more)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecordError(f"{where}.{f.name}" if where else f.name, "missing")
        return cls(**kwargs)
    if isinstance(cls, type) and issubclass(cls, enum.Enum):
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in cls)
            raise RecordError(where or cls.__name__, f"{value!r} is not one of {allowed}") from None
    if origin in (dict,):
        key_type, value_type = typing.get_args(cls) or (Any, Any)
        if not isinstance(value, dict):
            raise RecordError(where or "value", f"expected an object, found {type(value).__name__}")
        return {from_jsonable(key_type, k, where, **more): from_jsonable(value_type, v, f"{where}.{k}", **more)
                for k, v in value.items()}
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise RecordError(where or "value", f"expected a list, found {type(value).__name__}")
        args = typing.get_args(cls)
        item_type = args[0] if args else Any
        items = [from_jsonable(item_type, v, f"{where}[{i}]", **more) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if cls is Path:
        if not isinstance(value, str):
            raise RecordError(where or "value", f"expected a path, found {type(value).__name__}")
        return Path(value)
    if cls is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise RecordError(where or "value", f"expected a number, found {value!r}")
    if cls is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # counters scraped as floats
            return int(value)
        raise RecordError(where or "value", f"expected an integer, found {value!r}")
    if cls in (str, bool):
        if isinstance(value, cls):
            return value
        raise RecordError(where or "value", f"expected {cls.__name__}, found {value!r}")
    raise RecordError(where or "value", f"cannot read a {cls!r}")
