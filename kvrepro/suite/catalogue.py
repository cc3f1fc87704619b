"""defects/: the catalogue of known defects, one YAML file per defect, validated.

An entry says what a defect is (kind, signature), how to reach it (a matrix.yaml fragment merged
over the default matrix), where it is expected present and where fixed (releases and patch
stacks), what "the path ran" means for it (a counter every run records) and which run measured
it. Errors name ``file:line``, the field and what is allowed, as matrix.yaml's do.

Build keys: ``0.26.0`` (a release as shipped) or ``0.26.0+pr-52807+pr-48425`` (a release with
patches from builds/ applied in that order). :func:`expected_state` says what an entry expects
of one build; docs/suite.md has the rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .. import paths, untrusted
from ..errors import SpecError
from ..classify.records import PROBE_COUNTERS
from ..spec.yamltext import StrictLoader, line_for, line_index
from ..versions import unsupported

# the catalogue kvrepro ships (a checkout's top-level defects/, or the wheel's copy of it)
DEFAULT_CATALOGUE = paths.shipped_catalogue()
MAX_ENTRY_BYTES = 64 * 1024

# RunResult fields an entry may name as its "path ran" counter, and what each counts
COUNTERS: dict[str, str] = {
    "trigger_count": "update_state_after_alloc calls with a local hit and an offload hit (probe)",
    "state_count": "trigger calls with a fresh unhashed block below the local boundary (probe)",
    "external_hit_calls": "update_state_after_alloc calls with an offload hit (probe)",
    "kv_checks": "request contexts the shadow KV checked",
    "prefix_cache_hits": "prefix-cache hit tokens (vllm:prefix_cache_hits_total)",
    "external_prefix_cache_hits": "offload-tier hit tokens (vllm:external_prefix_cache_hits_total)",
    "offload_load_jobs": "offload load jobs the GPU-free engine ran",
    "offload_store_jobs": "offload store jobs the GPU-free engine ran",
    "engine_steps": "engine steps",
    **PROBE_COUNTERS,  # the probe's plain counters (kvrepro/records.py)
    "injected_load_faults": "offload load jobs failed on purpose (engine.sim.offload_faults; kvrepro-fault: lines)",
    "requests": "requests sent",
}
# RunResult per-kind counters an entry names as ``<field>.<key>`` (kv_hit_reads.mamba): the key is
# a KV-group kind (full_attention, mamba, sliding_window), "+offload" for requests with blocks loaded
KEYED_COUNTERS: dict[str, str] = {
    "kv_hit_reads": "requests resumed from a prefix hit that read the hit's KV or Mamba state, per group kind "
                    "(<kind>+offload: those of them with blocks loaded) (shadow KV)",
    "kv_stored": "blocks stored to the offload tier per group kind; a Mamba block only when it held a state (shadow KV)",
}
_KEY = re.compile(r"^[a-z_]+(\+offload)?$")


def counter_value(run: object, name: str) -> int:
    """The value of counter ``name`` (COUNTERS, or ``field.key`` of KEYED_COUNTERS) in a RunResult."""
    field_name, _, key = name.partition(".")
    value = getattr(run, field_name, None)
    if key:
        value = value.get(key, 0) if isinstance(value, dict) else 0
    return int(value) if isinstance(value, int) else 0
# only these parts of a matrix describe how a defect is reached; builds and expectations are the suite's
FRAGMENT_KEYS = ("engine", "load", "runs", "target_signature")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_RELEASE = re.compile(r"^\d+\.\d+\.\d+$")
_PATCH = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def parse_build_key(key: str) -> tuple[str, tuple[str, ...]]:
    """``0.26.0+pr-52807+pr-48425`` -> ("0.26.0", ("pr-52807", "pr-48425")); ValueError if malformed."""
    parts = key.strip().split("+")
    release, patches = parts[0], tuple(parts[1:])
    if not _RELEASE.match(release):
        raise ValueError(f"{key!r}: must start with a release such as 0.26.0 (then +patch+patch...)")
    for patch in patches:
        if not _PATCH.match(patch):
            raise ValueError(f"{key!r}: {patch!r} is not a patch name from builds/ (e.g. pr-52807)")
    return release, patches


def build_key(release: str, patches: tuple[str, ...] | list[str] = ()) -> str:
    return "+".join((release, *patches))


def _version(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("."))


class PathSpec(_Strict):
    counter: str = Field(description="a RunResult counter (see COUNTERS)")
    at_least: int = Field(1, ge=1, description="every repetition must reach this count for ABSENT")
    absent_after: int = Field(1, ge=1, le=100, description="repetitions a build needs before it can be ABSENT: a "
                              "timing-dependent defect (a stall) that shows in some runs only needs several; "
                              "`suite run --reps` never runs it fewer times")
    means: str = Field("", description="what the counter shows for this defect, in one line")

    @field_validator("counter")
    @classmethod
    def _known(cls, v: str) -> str:
        field_name, dot, key = v.partition(".")
        if dot and field_name in KEYED_COUNTERS and _KEY.match(key):
            return v
        if v not in COUNTERS:
            keyed = ", ".join(f"{k}.<group kind>[+offload]" for k in KEYED_COUNTERS)
            raise ValueError(f"{v!r} is not a counter runs record; use one of {', '.join(COUNTERS)}, {keyed}")
        return v


class Reproduced(_Strict):
    suite_run: str = Field(description="the suite run folder (results/suite-...) that measured it")
    date: str
    command: str
    builds: dict[str, str] = Field(default_factory=dict, description="build key -> the row it got (PRESENT, ABSENT)")


# what `kvrepro triage` compares an entry's `triage.requires` with: facets of the deployed configuration
# read from a log (kvrepro/triage/deployed.py, DeployedConfig.facets), each with the values it can take
TRIAGE_FACETS: dict[str, tuple[str, ...]] = {
    "connector": ("offloading", "lmcache", "nixl", "other", "none"),
    "mamba_cache_mode": ("align", "all", "none"),
    "speculative": ("mtp", "eagle", "eagle3", "ngram", "suffix", "other", "none"),
    "prefix_caching": ("on", "off"),
    "scheduling_policy": ("fcfs", "priority"),
    # the OffloadingConnector's tiers: CPU only (--kv-offloading-size, CPUOffloadingSpec) or CPU and
    # secondary tiers (TieringOffloadingSpec: fs, p2p, object store); none without it
    "offload_tiers": ("single", "multi", "none"),
}


class TriageSpec(_Strict):
    requires: dict[str, list[str]] = Field(default_factory=dict, description="facet -> the values the defect needs "
                                           "(see TRIAGE_FACETS); a log with another value is a near miss")
    evidence: list[str] = Field(default_factory=list, description="regexes a log's failure lines (the stall's "
                                "stats line, the crash's exception line) show when it is this defect; each "
                                "found ranks the entry higher")

    @field_validator("requires")
    @classmethod
    def _facets(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for facet, values in v.items():
            if facet not in TRIAGE_FACETS:
                raise ValueError(f"{facet!r} is not a facet; use {', '.join(TRIAGE_FACETS)}")
            bad = [x for x in values if x not in TRIAGE_FACETS[facet]]
            if bad or not values:
                raise ValueError(f"{facet}: {bad or '[]'}; allowed: {', '.join(TRIAGE_FACETS[facet])}")
        return v

    @field_validator("evidence")
    @classmethod
    def _regexes(cls, v: list[str]) -> list[str]:
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regex: {exc}") from None
        return v


class EntrySpec(_Strict):
    name: str
    kind: Literal["crash", "corruption", "stall", "invariant"]
    title: str
    signature: str = Field(description="crash: a signature name (`kvrepro signatures`); corruption: a defect "
                                       "name (`kvrepro signatures`); stall: `stall`; invariant: an invariant's "
                                       "name (kvrepro/classify/invariants.py)")
    testable: bool = True
    not_testable: str | None = Field(None, description="why the suite cannot test it here (testable: false)")
    matrix: dict[str, Any] = Field(default_factory=dict, description="merged over the default matrix.yaml")
    present_in: list[str] = Field(default_factory=list)
    fixed_in: list[str] = Field(default_factory=list)
    masked_in: list[str] = Field(default_factory=list, description="builds (releases or stacks) where another "
                                 "catalogued defect ends the entry's load first: the suite expects MASKED there, "
                                 "not present or fixed (present_in/fixed_in stay what the code says, for triage)")
    unreached_in: list[str] = Field(default_factory=list, description="builds (releases or stacks) the entry's load "
                                    "cannot reach its path on (the code is there or fixed, the load goes blind): the "
                                    "suite expects UNREACHED there; present_in/fixed_in stay what the code says")
    upstream: list[str] = Field(default_factory=list)
    path: PathSpec | None = None
    notes: str = ""
    reproduced: list[Reproduced] = Field(default_factory=list)
    triage: TriageSpec | None = Field(None, description="what `kvrepro triage` needs beyond the signature and "
                                      "releases: configuration requirements and log evidence")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("lower-case letters, digits and '-', at most 63 (it names the file and the build)")
        return v

    @field_validator("present_in", "fixed_in", "masked_in", "unreached_in")
    @classmethod
    def _keys(cls, v: list[str]) -> list[str]:
        for key in v:
            release, _ = parse_build_key(key)
            if (problem := unsupported(release, unported_ok=False)) is not None:
                raise ValueError(f"{key!r}: {problem}")
        return v

    @field_validator("matrix")
    @classmethod
    def _fragment(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in v:
            if key not in FRAGMENT_KEYS:
                raise ValueError(f"{key!r}: a defect says how it is reached with {', '.join(FRAGMENT_KEYS)}; "
                                 "the suite chooses builds and expectations")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "EntrySpec":
        from ..classify.corruption import known_corruptions
        from ..classify.patterns import known_patterns

        if not self.testable:
            pass  # its signature may be one kvrepro does not know yet (nothing is matched against it)
        elif self.kind == "crash":
            names = sorted(p.name for p in known_patterns())
            if self.signature not in names:
                raise _FieldError("signature", f"{self.signature!r} is not a crash signature; known: {', '.join(names)}")
        elif self.kind == "corruption":
            names = sorted(c.name for c in known_corruptions())
            if self.signature not in names:
                raise _FieldError("signature", f"{self.signature!r} is not a corruption defect; known: "
                                  f"{', '.join(names)}")
        elif self.kind == "invariant":
            from ..classify.invariants import INVARIANTS

            if self.signature not in INVARIANTS:
                raise _FieldError("signature", f"{self.signature!r} is not an invariant; known: {', '.join(INVARIANTS)}")
        elif self.kind == "stall" and self.signature != "stall":
            raise _FieldError("signature", "a stall entry's signature is `stall`")
        if not self.testable and not (self.not_testable or "").strip():
            raise _FieldError("not_testable", "testable: false needs the reason here")
        if self.testable and self.not_testable:
            raise _FieldError("not_testable", "given on a testable entry; set testable: false or remove it")
        if self.testable and self.path is None:
            raise _FieldError("path", "a testable entry needs path: {counter: ..., at_least: 1}: what shows its "
                              "path ran when the defect does not show")
        reps = (self.matrix.get("runs") or {}).get("repetitions") if isinstance(self.matrix.get("runs"), dict) else None
        if self.path is not None and isinstance(reps, int) and reps < self.path.absent_after:
            raise _FieldError("path.absent_after", f"{self.path.absent_after} repetitions needed for ABSENT, but "
                              f"matrix.runs.repetitions runs {reps}: raise runs.repetitions")
        both = set(self.present_in) & set(self.fixed_in)
        if both:
            raise _FieldError("fixed_in", f"{', '.join(sorted(both))} also in present_in")
        return self


class _FieldError(ValueError):
    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class Measurement:
    """A suite run that measured an entry (``reproduced:``)."""

    suite_run: str
    date: str
    command: str
    builds: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Entry:
    """One catalogue entry, validated; ``fragment`` is the matrix.yaml fragment (plain YAML data)."""

    name: str
    kind: str
    title: str
    signature: str
    testable: bool
    not_testable: str | None
    present_in: tuple[str, ...]
    fixed_in: tuple[str, ...]
    upstream: tuple[str, ...]
    path_counter: str | None
    path_at_least: int
    path_means: str
    absent_after: int
    notes: str
    reproduced: tuple[Measurement, ...]
    file: Path
    fragment_yaml: str = ""  # the `matrix:` fragment, as YAML text (merged by suite.run)
    # `triage:` (kvrepro triage): facet -> values the defect needs, and regexes of its log evidence
    triage_requires: tuple[tuple[str, tuple[str, ...]], ...] = ()
    triage_evidence: tuple[str, ...] = ()
    masked_in: tuple[str, ...] = ()  # builds where another catalogued defect ends the entry's load first
    unreached_in: tuple[str, ...] = ()  # builds where the entry's load cannot reach its path

    @property
    def fragment(self) -> dict[str, Any]:
        return yaml.safe_load(self.fragment_yaml) or {} if self.fragment_yaml else {}


@dataclass(frozen=True)
class Catalogue:
    folder: Path
    entries: tuple[Entry, ...] = field(default_factory=tuple)

    def select(self, names: list[str] | None) -> list[Entry]:
        if not names:
            return list(self.entries)
        names = list(dict.fromkeys(names))  # --entry X --entry X: one run of X, not two racing for its record
        known = {e.name: e for e in self.entries}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SpecError(f"--entry {', '.join(unknown)}: not in {self.folder}; known: {', '.join(known)}")
        return [known[n] for n in names]


def expected_state(entry: Entry, release: str, patches: tuple[str, ...] = ()) -> str | None:
    """What ``entry`` expects of a build: "present", "fixed", "masked", "unreached" or None (no claim).

    A key with patches (``0.26.0+pr-52807``) matches a build on that release whose stack holds all
    of them; the key with the most patches wins. A release in ``present_in`` matches that release
    with any stack; a release in ``fixed_in`` means fixed from that release on (any stack). Rank:
    patch keys (by patch count) over an exact release over a "from this release on"; at equal rank
    fixed wins. A key in ``masked_in`` names one build exactly (that release with those patches,
    in any order; a release alone: the release as shipped) and overrides: "masked", another
    catalogued defect ends the entry's load on that build before the entry can show (the suite's
    MASKED row). Masking depends on every patch of the stack, so it claims no other build; what the
    code itself holds is the claim without ``masked_in`` (triage asks that). ``unreached_in`` names
    builds the same way where the entry's load cannot reach its path: "unreached" (an UNREACHED row).
    """
    for state, keys in (("masked", entry.masked_in), ("unreached", entry.unreached_in)):
        for key in keys:
            rel, need = parse_build_key(key)
            if rel == release and set(need) == set(patches):
                return state
    best: tuple[int, bool, str] | None = None  # (rank, fixed wins ties, state)
    for state, keys in (("present", entry.present_in), ("fixed", entry.fixed_in)):
        for key in keys:
            rel, need = parse_build_key(key)
            if need:
                if rel != release or not set(need) <= set(patches):
                    continue
                rank = 2 + len(need)
            elif rel == release:
                rank = 1
            elif state == "fixed" and _version(release) >= _version(rel):
                rank = 0
            else:
                continue
            candidate = (rank, state == "fixed", state)
            if best is None or candidate[:2] > best[:2]:
                best = candidate
    return best[2] if best else None


def named_builds(entry: Entry) -> tuple[str, ...]:
    """Every build key the entry's claims name (present_in, fixed_in, masked_in, unreached_in), once each:
    what a check of the catalogue against measurement must run (scripts/measured.py suite)."""
    return tuple(dict.fromkeys((*entry.present_in, *entry.fixed_in, *entry.masked_in, *entry.unreached_in)))


def _read(path: Path) -> tuple[str, Any]:
    try:
        # bounded, never blocks on a FIFO, never follows a link (kvrepro/untrusted.py): a catalogue
        # folder is copied and edited by hand, and one bad file must not hang every suite command
        text = untrusted.read_bytes(path, MAX_ENTRY_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}:1: not UTF-8 text ({exc.reason}); save it as UTF-8") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=StrictLoader)  # noqa: S506 (spec's SafeLoader subclass)
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply to read; an entry is a few levels deep") from None
    except yaml.YAMLError as exc:
        line = getattr(exc, "line", None)
        mark = getattr(exc, "problem_mark", None)
        position = getattr(exc, "position", None)  # a ReaderError (a NUL or control character) has no mark
        if not line and mark is None and isinstance(position, int):
            line = text[:position].count("\n") + 1
        line = line or (mark.line + 1 if mark else 1)
        problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or str(exc).splitlines()[0]
        raise SpecError(f"{path}:{line}: not valid YAML: {problem}") from None
    return text, data


def _where(path: Path, text: str, loc: tuple[Any, ...]) -> str:
    try:
        line = line_for(line_index(text), loc)
    except yaml.YAMLError:
        line = None
    return f"{path}:{line or 1}"


def load_entry(path: Path, check_fragment: Any = None) -> Entry:
    """One file; SpecError ``file:line: field: problem`` for a bad one.

    ``check_fragment(entry_spec) -> None`` may raise SpecError("field.path: problem") for a
    fragment that does not make a valid matrix (suite.run passes one)."""
    try:
        return _load_entry(path, check_fragment)
    except RecursionError:  # YAML that parses but nests deeper than validation and merging can walk
        raise SpecError(f"{path}: nested too deeply to read; an entry is a few levels deep") from None


def _load_entry(path: Path, check_fragment: Any) -> Entry:
    text, data = _read(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path}:1: an entry is a mapping (name:, kind:, title:, signature:, ...)")
    try:
        spec = EntrySpec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        ctx = (err.get("ctx") or {}).get("error")
        if isinstance(ctx, _FieldError):
            loc, msg = tuple(ctx.path.split(".")), str(ctx)
        elif err["type"] == "extra_forbidden":
            msg = f"unknown field; allowed: {', '.join(EntrySpec.model_fields)}" if len(loc) == 1 else "unknown field"
        elif err["type"] == "missing":
            msg = "missing (required)"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        field_name = ".".join(str(p) for p in loc) or "(top level)"
        raise SpecError(f"{_where(path, text, loc)}: {field_name}: {msg}") from None
    if spec.name != path.stem:
        raise SpecError(f"{_where(path, text, ('name',))}: name: {spec.name!r}, but the file is {path.name}; "
                        f"name the file {spec.name}.yaml")
    if check_fragment is not None and spec.testable:
        try:
            check_fragment(spec)
        except FragmentError as exc:
            loc = ("matrix",) + tuple(exc.field.split("."))
            raise SpecError(f"{_where(path, text, loc)}: matrix.{exc.field}: {exc}") from None
    fragment_yaml = yaml.safe_dump(spec.matrix, sort_keys=False) if spec.matrix else ""
    return Entry(name=spec.name, kind=spec.kind, title=spec.title, signature=spec.signature, testable=spec.testable,
                 not_testable=spec.not_testable, present_in=tuple(spec.present_in), fixed_in=tuple(spec.fixed_in),
                 upstream=tuple(spec.upstream), path_counter=spec.path.counter if spec.path else None,
                 path_at_least=spec.path.at_least if spec.path else 1, path_means=spec.path.means if spec.path else "",
                 absent_after=spec.path.absent_after if spec.path else 1,
                 notes=spec.notes,
                 reproduced=tuple(Measurement(r.suite_run, r.date, r.command, dict(r.builds)) for r in spec.reproduced),
                 file=path, fragment_yaml=fragment_yaml,
                 triage_requires=tuple((k, tuple(v)) for k, v in (spec.triage.requires if spec.triage else {}).items()),
                 triage_evidence=tuple(spec.triage.evidence if spec.triage else ()),
                 masked_in=tuple(spec.masked_in), unreached_in=tuple(spec.unreached_in))


class FragmentError(ValueError):
    """A matrix fragment that does not validate: ``field`` is its dotted path inside ``matrix:``."""

    def __init__(self, field_path: str, message: str):
        super().__init__(message)
        self.field = field_path


def load_catalogue(folder: Path = DEFAULT_CATALOGUE, check_fragment: Any = None) -> Catalogue:
    """Every ``*.yaml`` in ``folder``, sorted by name; the first bad file raises SpecError."""
    if not folder.is_dir():
        raise SpecError(f"--catalogue {folder}: not a folder of defect files (defects/*.yaml)")
    files = sorted(folder.glob("*.yaml"), key=lambda f: f.stem)  # by entry name
    if not files:
        raise SpecError(f"--catalogue {folder}: no *.yaml entries in it")
    return Catalogue(folder=folder, entries=tuple(load_entry(f, check_fragment) for f in files))
