"""The records every stage shares, and the one way records go to JSON and back.

Each stage owns its records (``kvrepro/<stage>/records.py``: spec's build plan, builds' manifests,
deploy's run manifest, classify's judgement, results' run.json, suite's suite.json, ...). What stays
here is what every stage from the targets to the report passes on: a run's verdict and outcome, the
record of one repetition (:class:`RunResult`, which a target returns and the report reads) and the
two records it holds (the crash's :class:`Signature`, the load's :class:`LoadSummary`), and the
reflective pair :func:`to_jsonable` / :func:`from_jsonable` that writes and reads every record
(typed, field by field; a record whose file format differs from its fields says so in a
``__json__`` / ``from_json`` of its own that goes through the same pair).
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


Json = Any  # a value as json.loads returns it


@dataclass(frozen=True)
class Signature:
    """A crash signature extracted from a traceback (syzkaller-style title material)."""

    exception: str
    function: str
    file: str
    line: int | None
    expression: str


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


# Version of the layout of results/<run>/run.json and every verdict.json. Bump it when a field
# changes meaning or type (adding an optional field with a default does not need a bump);
# results.load_run refuses other versions with one line naming the folder and what to do.
RESULTS_SCHEMA = 2


@dataclass(frozen=True, kw_only=True)
class PathEvidence:
    """What the probe and the shadow KV saw run, defined once: classify's Exposure is it read from an
    engine log, and a run's RunResult records it (kvrepro.classify.judge.run_result copies it field
    by field from the one into the other). Keyword-only, so each record's own fields come first.

    ``external_hit_calls``: calls of update_state_after_alloc with an offload hit at all.
    """

    external_hit_calls: int = 0
    probe_source_sha256: str | None = None
    probe_seen: bool = False
    # per kind of KV group, the trigger calls in which the bug's own state was there (a non-null,
    # unhashed block below the local boundary in that kind of group)
    state_groups: dict[str, int] = field(default_factory=dict)
    # the sim engine's shadow KV: contexts checked, violations (silent KV corruption), the first
    kv_checks: int = 0
    kv_violations: int = 0
    # violation class (kvrepro.engine.shadow: group kind[+offload]/read/region) -> violations
    kv_violations_by: dict[str, int] = field(default_factory=dict)
    kv_first_violation: str | None = None
    kv_first_violation_class: str | None = None
    kv_groups: tuple[str, ...] = ()  # kinds of the engine's KV groups, from the shadow KV's installed line
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


@dataclass(frozen=True)
class RunResult(PathEvidence):
    """The verdict of one repetition of one build, as written to verdict.json and read back.

    Everything a report, a comparison or CI needs is a typed field here (no free-form dicts to
    dig through); fields added later carry defaults so that older verdict.json files of the same
    schema still read. What the probe and the shadow KV saw is :class:`PathEvidence`'s fields
    (keyword-only: ``external_hit_calls``, ``kv_checks``, the probe's counters, ...).
    """

    build: str
    rep: int
    verdict: Verdict
    outcome: Outcome
    title: str
    trigger_count: int
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
    kv_check: str = "off"
    # violations per known corruption defect (kvrepro.classify.corruption; "unknown" for a class
    # no signature knows), attributed when the run was classified
    kv_defects: dict[str, int] = field(default_factory=dict)
    # what the probe had to log as the wrapped method's hash (the build manifest's); None: unknown
    probe_expected_sha256: str | None = None
    load: LoadSummary | None = None
    engine_exit: int | None = None
    # the engine's own totals (None: unknown, which is not 0) and its /metrics at the end of the run
    offload_load_jobs: int | None = None
    offload_store_jobs: int | None = None
    engine_steps: int | None = None
    engine_start_s: float | None = None  # from launch until the engine answered /health
    external_prefix_cache_hits: int = 0
    prefix_cache_hits: int = 0
    # a target that runs whole runs elsewhere (ray): why earlier attempts of this run were INFRA (a
    # node lost mid-run; the run was retried elsewhere and this record is the retry's)
    retried_after: tuple[str, ...] = ()
    # the target's own part of the record, by target name (kvrepro/deploy/<target>/records.py types
    # and writes its section, e.g. ray's node): a new target adds no field here
    by_target: dict[str, Json] = field(default_factory=dict)
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


# How a record's file format may differ from its fields, said on the field (dataclasses.field(metadata=...))
# and read by the one pair below, so that no record writes its JSON by hand:
# OMIT_UNSET: the key is left out while the field holds its default (files written before it read the same);
# REST: a dict field holding the object's keys no other field names, written flat beside them (a format
# open to keys of other writers: a target's own keys of a build manifest, a newer kvrepro's).
# A record whose every field is OMIT_UNSET says so once: ``__json_omit_unset__ = True``.
OMIT_UNSET: Mapping[str, str] = types.MappingProxyType({"json": "omit_unset"})
REST: Mapping[str, str] = types.MappingProxyType({"json": "rest"})


def _omitted(record: Any, f: dataclasses.Field) -> bool:
    if f.metadata.get("json") != "omit_unset" and not getattr(record, "__json_omit_unset__", False):
        return False
    value = getattr(record, f.name)
    if f.default is not dataclasses.MISSING:
        return value == f.default
    return f.default_factory is not dataclasses.MISSING and value == f.default_factory()


@functools.cache
def _written_order(cls: type) -> tuple[dataclasses.Field, ...]:
    """A record's fields as written: its own first, then those of the records it extends."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    return tuple(sorted(dataclasses.fields(cls), key=lambda f: f.name in inherited))


def fields_to_jsonable(record: Any) -> dict[str, Any]:
    """A record's JSON object, field by field (OMIT_UNSET and REST fields as they say): what
    :func:`to_jsonable` writes for a dataclass, for a record's own ``__json__`` to go through."""
    data: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for f in _written_order(type(record)):
        if f.metadata.get("json") == "rest":
            rest = getattr(record, f.name)
        elif not _omitted(record, f):
            data[f.name] = to_jsonable(getattr(record, f.name))
    data.update(to_jsonable(rest))
    return data


def to_jsonable(value: Any) -> Any:
    """Turn records (and nested containers of them) into JSON-ready values."""
    if hasattr(value, "__json__") and not isinstance(value, type):  # a record with its own JSON form
        return value.__json__()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return fields_to_jsonable(value)
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
        return fields_from_jsonable(cls, value, where, **more)
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


def fields_from_jsonable(cls: Any, value: Any, where: str = "", *,
                         readers: Mapping[Any, Callable[[Any, str], Any]] | None = None,
                         ignore_unknown: bool = False) -> Any:
    """A record read back field by field from its JSON object (what :func:`from_jsonable` does for
    a dataclass, for a record's own ``from_json`` to go through): a key no field names raises
    RecordError, unless the record has a REST field, which then holds it as it was."""
    more = {"readers": readers, "ignore_unknown": ignore_unknown}
    if not isinstance(value, dict):
        raise RecordError(where or cls.__name__, f"expected an object, found {type(value).__name__}")
    hints = type_hints(cls)
    rest = next((f.name for f in dataclasses.fields(cls) if f.metadata.get("json") == "rest"), None)
    names = {f.name for f in dataclasses.fields(cls) if f.init and f.name != rest}
    unknown = sorted(set(value) - names)
    if unknown and not ignore_unknown and rest is None:
        raise RecordError(f"{where}.{unknown[0]}" if where else unknown[0], f"not a field of {cls.__name__}")
    kwargs: dict[str, Any] = {rest: {k: value[k] for k in value if k not in names}} if rest is not None else {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name == rest:
            continue
        if f.name in value:
            kwargs[f.name] = from_jsonable(hints[f.name], value[f.name], f"{where}.{f.name}" if where else f.name,
                                           **more)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecordError(f"{where}.{f.name}" if where else f.name, "missing")
    return cls(**kwargs)
