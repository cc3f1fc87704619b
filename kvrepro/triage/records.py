"""The records triage hands between its steps and to the CLI: what the log says was deployed, how
it failed, and which catalogue entries fit. Frozen dataclasses, serialised by records.to_jsonable."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..records import Signature


@dataclass(frozen=True)
class DeployedConfig:
    """The configuration a log shows, as vLLM printed it (secrets masked).

    ``args`` are vLLM's ``non-default args`` (the dict it prints at start-up), with nested configs
    (``KVTransferConfig(...)``) as dicts carrying ``__class__``. Fields after it are derived from
    those args and from vLLM's own info lines (the Mamba cache mode and attention block size it
    chose for a hybrid model); None where the log does not say.
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
    # the log line each value above came from (field name -> line), for messages about a value
    lines: dict[str, int | None] = field(default_factory=dict)

    @property
    def hybrid(self) -> bool:
        return self.mamba_cache_mode is not None

    def facets(self) -> dict[str, str]:
        """The configuration in catalogue terms (suite.catalogue.TRIAGE_FACETS)."""
        connector = (self.kv_connector or "").lower()
        kind = ("none" if not connector else "offloading" if "offloading" in connector
                else "lmcache" if "lmcache" in connector else "nixl" if "nixl" in connector else "other")
        method = (self.speculative_method or "none").lower()
        if method not in ("mtp", "eagle", "eagle3", "ngram", "suffix", "none"):
            method = "mtp" if "mtp" in method else "other"
        return {
            "connector": kind,
            "mamba_cache_mode": self.mamba_cache_mode or "none",
            "speculative": method,
            "prefix_caching": "on" if self.prefix_caching else "off",
            "scheduling_policy": self.scheduling_policy,
        }


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
    """How the log's engine failed: ``kind`` crash, stall or none."""

    kind: str
    title: str
    outcome: str = "none"  # classify's Outcome value for a crash
    signature: Signature | None = None
    pattern: str | None = None  # the known crash signature (kvrepro/classify/signatures/), if any
    line: int | None = None  # where the fatal traceback starts
    exception_line: str = ""
    excerpt: tuple[str, ...] = ()
    stall: Stall | None = None

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
class Triage:
    """Everything `kvrepro triage` found in one log."""

    log: str
    lines: int
    bytes_read: int
    config: DeployedConfig
    failure: Failure
    matches: tuple[Match, ...]  # best first
    near_misses: tuple[Match, ...]
    base: str | None  # the supported release a reproduction runs on
    warnings: tuple[str, ...] = ()
    minimal_clean_set: tuple[str, ...] | None = None  # patches on base that leave no catalogue entry present
    still_present: tuple[str, ...] = ()  # entries present on base that no backport in the catalogue fixes

    @property
    def unknown(self) -> bool:
        return self.failure.kind != "none" and not self.matches

    @property
    def best(self) -> Match | None:
        return self.matches[0] if self.matches else None
