"""The records triage hands between its steps and to the CLI: what the log says was deployed, how
it failed, and which catalogue entries fit. Frozen dataclasses, serialised by records.to_jsonable."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..records import Signature


# the fields of DeployedConfig a log may or may not say; `sources` names the line each came from
READ_FIELDS = ("release", "model", "architecture", "tensor_parallel_size", "data_parallel_size",
               "pipeline_parallel_size", "prefix_caching", "mamba_cache_mode", "block_size", "kv_connector",
               "speculative_method", "num_speculative_tokens", "scheduling_policy")
# each catalogue facet and the fields that say it
FACET_FIELDS = {"connector": "kv_connector", "mamba_cache_mode": "mamba_cache_mode",
                "speculative": "speculative_method", "prefix_caching": "prefix_caching",
                "scheduling_policy": "scheduling_policy", "offload_tiers": "kv_connector"}
NOT_IN_LOG = "not in the log"


@dataclass(frozen=True)
class DeployedConfig:
    """The configuration a log shows (secrets masked), and where it shows each part.

    ``args`` are vLLM's ``non-default args`` (the dict it prints at start-up), with nested configs
    (``KVTransferConfig(...)``) as dicts carrying ``__class__``, completed by what a pasted report
    gives instead (its command line, a connector JSON, an ``LLM(...)`` call, flags in its text).
    Fields after it are derived from those args and from vLLM's own info lines (the Mamba cache
    mode and attention block size it chose for a hybrid model).

    ``sources`` maps each field of READ_FIELDS the log says to where (``line 12: vllm serve``;
    ``line 3: the non-default args line sets no kv_transfer_config`` for a default a complete
    argument list implies). A field missing from it was not in the log: its value here is vLLM's
    default, used to build a reproduction (emit) and never shown or compared as read.
    """

    release: str | None = None
    release_line: int | None = None
    args: dict[str, object] = field(default_factory=dict)
    args_problem: str | None = None  # why the args line could not be read, if it could not
    model: str | None = None
    architecture: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    engines_seen: int = 0  # distinct EngineCore processes (DP ranks) whose lines the log holds
    prefix_caching: bool = True
    mamba_cache_mode: str | None = None  # as vLLM resolved it (its info line wins over the args)
    block_size: int | None = None  # the attention block vLLM chose (its info line wins over the args)
    kv_connector: str | None = None  # OffloadingConnector for --kv-offloading-size, else kv_transfer_config's
    kv_connector_settings: dict[str, object] = field(default_factory=dict)
    offload_chunk_tokens: int | None = None
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    scheduling_policy: str = "fcfs"
    sources: dict[str, str] = field(default_factory=dict)
    problems: tuple[str, ...] = ()  # what the log gave but could not be read (a variable, bad JSON)
    version_note: str | None = None  # e.g. a nightly image: a build whose release no line says
    mamba_mode_default: bool = False  # a complete argument list leaves the mode to vLLM: align or none
    # the log line each value came from (field name -> line; derived from ``sources``, with the
    # chunk's), for messages about a value (emit's bounds checks)
    lines: dict[str, int | None] = field(default_factory=dict)

    @property
    def hybrid(self) -> bool:
        return self.mamba_cache_mode is not None

    def known(self, name: str) -> bool:
        return name in self.sources

    def source(self, name: str) -> str:
        return self.sources.get(name, NOT_IN_LOG)

    def connectors(self) -> tuple[str, ...]:
        """The connector kinds (TRIAGE_FACETS) in use: one, or a MultiConnector's members (each
        runs: a defect of one of them is reachable)."""
        return tuple(dict.fromkeys(_connector_kind(name) for name in self._connector_names())) or ("none",)

    def _connector_names(self) -> list[str]:
        if (self.kv_connector or "").lower() != "multiconnector":
            return [self.kv_connector] if self.kv_connector else []
        extra = self.kv_connector_settings.get("kv_connector_extra_config")
        members = extra.get("connectors") if isinstance(extra, dict) else None
        names = [str(m.get("kv_connector")) for m in members if isinstance(m, dict) and m.get("kv_connector")] \
            if isinstance(members, list) else []
        return names or [self.kv_connector]

    def offload_tiers(self) -> str:
        """``multi`` when an OffloadingConnector has secondary tiers (TieringOffloadingSpec),
        ``single`` for the CPU tier alone, ``none`` without the OffloadingConnector."""
        if "offloading" not in self.connectors():
            return "none"
        configs = [self.kv_connector_settings.get("kv_connector_extra_config")]
        extra = configs[0]
        members = extra.get("connectors") if isinstance(extra, dict) else None
        if isinstance(members, list):
            configs += [m.get("kv_connector_extra_config") for m in members
                        if isinstance(m, dict) and "offloading" in str(m.get("kv_connector", "")).lower()]
        for config in configs:
            if isinstance(config, dict) and (config.get("secondary_tiers") or
                                             "tiering" in str(config.get("spec_name", "")).lower()):
                return "multi"
        return "single"

    def facets(self) -> dict[str, str]:
        """The configuration in catalogue terms (suite.catalogue.TRIAGE_FACETS); ``unknown`` for a
        facet the log does not say; a MultiConnector's members joined with ``+``."""
        kind = "+".join(self.connectors())
        method = (self.speculative_method or "none").lower()
        if method not in ("mtp", "eagle", "eagle3", "ngram", "suffix", "none"):
            method = "mtp" if "mtp" in method else "other"
        values = {
            "connector": kind,
            "offload_tiers": self.offload_tiers(),
            "mamba_cache_mode": self.mamba_cache_mode or "none",
            "speculative": method,
            "prefix_caching": "on" if self.prefix_caching else "off",
            "scheduling_policy": self.scheduling_policy,
        }
        out = {facet: value if self.known(FACET_FIELDS[facet]) else "unknown" for facet, value in values.items()}
        if self.mamba_mode_default:
            out["mamba_cache_mode"] = "unknown"
        return out

    def possible(self, facet: str, values: tuple[str, ...]) -> tuple[str, ...]:
        """The values ``facet`` may have for what the log says: one when it says it, all of
        ``values`` when it does not, vLLM's possible defaults when a complete argument list leaves
        it to vLLM (the Mamba cache mode: align or none by the model, never all)."""
        if facet == "mamba_cache_mode" and self.mamba_mode_default:
            return ("align", "none")
        if facet == "connector" and self.known("kv_connector") and len(self.connectors()) > 1:
            return self.connectors()
        value = self.facets()[facet]
        return values if value == "unknown" else (value,)


def _connector_kind(name: str) -> str:
    name = name.lower()
    return ("offloading" if "offloading" in name else "lmcache" if "lmcache" in name
            else "nixl" if "nixl" in name else "other")


@dataclass(frozen=True)
class Stall:
    """An engine that stopped: nothing running, requests waiting, no throughput, for ``seconds``."""

    engine: str
    line: int
    seconds: float
    waiting: int
    deferred: int
    stats_line: str


@dataclass(frozen=True)
class Failure:
    """How the log's engine failed: ``kind`` crash, infra (did not start, an infrastructure cause),
    stall or none."""

    kind: str
    title: str
    outcome: str = "none"  # classify's Outcome value; target only for the matrix target's own statement
    signature: Signature | None = None
    pattern: str | None = None  # the known crash signature (kvrepro/classify/signatures/), if any
    line: int | None = None  # where the fatal traceback starts (or the exception line the text holds)
    exception_line: str = ""
    excerpt: tuple[str, ...] = ()
    stall: Stall | None = None
    phase: str = "unknown"  # a crash's: runtime (the engine was serving), startup, unknown
    evidence: str = ""  # how the failure was read from the text
    fits: tuple[str, ...] = ()  # signatures the text fits equally (it cannot tell them apart)

    @property
    def evidence_text(self) -> str:
        return "\n".join(filter(None, (self.title, self.exception_line, self.stall.stats_line if self.stall else "")))


@dataclass(frozen=True)
class Match:
    """One catalogue entry against the log: a match (``fits``) or a near miss, with the reasons."""

    entry: str
    title: str
    kind: str
    fits: bool
    score: float
    why: tuple[str, ...]
    why_not: tuple[str, ...]
    upstream: tuple[str, ...]
    fixed_in_releases: tuple[str, ...]  # releases from which on it is fixed
    backports: tuple[tuple[str, ...], ...]  # patch stacks the catalogue says fix it on the base
    release_state: str  # present / before-fix / fixed / no claim


@dataclass(frozen=True)
class Tie:
    """Entries that fit the log equally well at the top, and what the log would need to show to
    tell them apart."""

    entries: tuple[str, ...]
    would_decide: tuple[str, ...]


@dataclass(frozen=True)
class Triage:
    """Everything `kvrepro triage` found in one log."""

    log: str
    lines: int
    bytes_read: int
    config: DeployedConfig
    failure: Failure
    matches: tuple[Match, ...]  # best first
    near_misses: tuple[Match, ...]
    base: str | None  # the supported release a reproduction runs on (None: the log's release is not near one)
    warnings: tuple[str, ...] = ()
    minimal_clean_set: tuple[str, ...] | None = None  # patches on base that leave no catalogue entry present
    still_present: tuple[str, ...] = ()  # entries present on base that no backport in the catalogue fixes
    tie: Tie | None = None  # the best matches could not be told apart

    @property
    def unknown(self) -> bool:
        return self.failure.kind != "none" and not self.matches

    @property
    def best(self) -> Match | None:
        return self.matches[0] if self.matches else None
