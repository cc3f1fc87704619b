"""The records of the classify stage: what killed the engine (Classification), what the probe and
the shadow KV saw run (Exposure, and the table of the probe's plain counters), the engine's own
totals, one log judged (Judgement), and the rule that settles a run early (StopRule).

Frozen dataclasses, written to JSON with :func:`kvrepro.records.to_jsonable`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..records import OMIT_UNSET, Outcome, PathEvidence, Signature, Verdict


@dataclass(frozen=True)
class Classification:
    outcome: Outcome
    title: str
    signature: Signature | None = None
    # `vllm serve` refused its arguments (argparse): its message; the run tested nothing (INFRA),
    # and the suite reads an option the release lacks from here (NOT TESTABLE)
    refused_arguments: str | None = field(default=None, metadata=OMIT_UNSET)


@dataclass(frozen=True)
class Exposure(PathEvidence):
    """Evidence that the code path under test actually ran (read from the probe's output).

    ``trigger_calls``: calls of update_state_after_alloc with both a local prefix hit and an
    offload hit -- the crash's precondition. ``external_hit_calls``: calls with an offload hit at
    all. A SURVIVED verdict needs trigger_calls > 0.
    """

    trigger_calls: int = 0
    # trigger calls in which the bug's own state was there (a non-null, unhashed block below the
    # local boundary in some group); the rest of what the probe and the shadow KV saw is PathEvidence's
    state_calls: int = 0
    shadow_seen: bool = False  # the shadow KV's installed line was in the log

    @property
    def kv_check(self) -> str:
        """``"corrupt"``, ``"ok"`` or ``"off"`` (no shadow KV ran: docker, or a real GPU)."""
        if self.kv_violations:
            return "corrupt"
        return "ok" if self.shadow_seen and self.kv_checks else "off"


# The probe's plain counters (kvrepro/probe/kvrepro_probe.py prints them as ``name=<N>`` on its
# counts line): name -> what it counts. Each is a field of kvrepro.records.PathEvidence, which
# Exposure (read from a log) and RunResult (a run's record) both are; the probe's reader
# (classify/exposure.py) adds them up over processes and the suite offers them as "path ran"
# counters, both from this table. A new probe counter is a line here, its field, and the probe's
# own code: nothing else changes.
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
