"""Read the probe's evidence that the code path under test actually ran.

A SURVIVED verdict is only worth something if the crash's precondition happened during the run
(a request with both a local prefix hit and an offload hit reaching update_state_after_alloc).
The probe installed in the engine says so on stderr::

    kvrepro-probe: installed function=OffloadingConnectorScheduler.update_state_after_alloc file=<path> source_sha256=<64 hex>
    kvrepro-probe: counts external_hit_calls=<N> trigger_calls=<M> state_calls=<K> state_groups=<kind>:<n>,... deferred_lookups=<D> loads_behind_deferred=<L> finished_unscheduled=<F> pid=<P>

(older probes end the counts line after ``trigger_calls``, or after ``state_groups``: what they do
not print is read as zero). The
GPU-free engine's shadow KV (kvrepro/engine/shadow.py) reports what it checked the same way::

    kvrepro-shadow: installed groups=...
    kvrepro-shadow: violation step=<S> class=<class> <words>
    kvrepro-shadow: counts checks=<N> violations=<M> by=<class>:<n>,... hits=<kind>:<n>,... stored=<kind>:<n>,...

(a class is ``<group kind>[+offload]/<read>/<region>``; older engines print ``<kind>[+offload]``
alone and no ``class=``). The probe's invariants at quiescent points (kvrepro/classify/invariants.py)::

    kvrepro-probe: invariant broken name=<name> check=<N> <words>
    kvrepro-probe: invariants checks=<N> broken=<name>:<n>,... pid=<P>

and where the engine waits when nothing has been scheduled for a while (the last line counts: the
stall the run ended on; kvrepro/explore/judge.py keys a stall by it)::

    kvrepro-probe: stall-state idle_steps=<N> where=<key> <words>

Injected offload-tier faults (kvrepro/engine/faults.py) are counted from::

    kvrepro-fault: load job <J> failed on purpose (load #<k>, request <id>, policy <fail|recompute>, ...)
    kvrepro-fault: counts load_jobs=<N> load_faults=<F> store_jobs=<S> store_faults=<G> failed_requests=<R> policy=<P> load_steps_total=<L> store_steps_total=<T> pid=<P>

so that a request a failed load ended on purpose (policy ``fail``) is not taken for a defect.

The counts line is repeated with running totals, so the last one of each process counts; when
several processes print (their lines carry different ``(Name pid=N)`` prefixes, or, from vLLM
0.33 on where children's raw stderr is not prefixed, different ``pid=`` fields) their last lines
are added up. The GPU-free engine also exports the totals on ``/metrics``; the larger of the two
sources wins, since either can miss the last few calls (a log cut short, a scrape taken early).
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterable
from typing import NamedTuple

from .records import PROBE_COUNTERS, Exposure
from ..records import REQUEST_ID_PREFIX
from .lines import split_line
from .metrics import parse_prometheus, total

_TAG = "kvrepro-probe:"
_INSTALLED = re.compile(
    r"kvrepro-probe: installed function=(?P<function>\S+) file=(?P<file>.*?) source_sha256=(?P<sha>[0-9a-f]{64})\b"
)
_COUNTS = re.compile(r"kvrepro-probe: counts external_hit_calls=(?P<ext>\d+) trigger_calls=(?P<trig>\d+)\b"
                     r"(?: state_calls=(?P<state>\d+) state_groups=(?P<groups>\S+))?")
# the rest of a counts line: PROBE_COUNTERS as name=<N> (an older probe prints fewer), then pid=<P>
_NAMED_COUNT = re.compile(r" (?P<name>[a-z_]+)=(?P<n>\d+)\b")
_SHADOW_TAG = "kvrepro-shadow:"
_SHADOW_COUNTS = re.compile(r"kvrepro-shadow: counts checks=(?P<checks>\d+) violations=(?P<violations>\d+)\b"
                            r"(?: by=(?P<by>\S+))?(?: hits=(?P<hits>\S+))?(?: stored=(?P<stored>\S+))?(?: pid=(?P<pid>\d+))?")
_SHADOW_INSTALLED = re.compile(r"kvrepro-shadow: installed groups=(?P<groups>\S*)")
# the request a described violation is about, when the load named it (kvrepro.loadgen.request_id)
_VIOLATION_REQUEST = re.compile(r"\brequest (?:chat)?cmpl-" + re.escape(REQUEST_ID_PREFIX) + r"(?P<index>\d+)-")
_FAULT_TAG = "kvrepro-fault:"
FAILED_LOADS_KEPT = 100_000  # injected load failures kept in order (a run injects at most a few hundred)
_FAULT_LINE = re.compile(r"kvrepro-fault: (?P<kind>load|store) job (?P<job>\S+) failed on purpose "
                         r"\((?:(?:load|store) #\d+, )?(?:request (?P<request>[^,]+), )?(?:policy (?P<policy>\w+), )?")
_FAULT_COUNTS = re.compile(r"kvrepro-fault: counts load_jobs=\d+ load_faults=(?P<load>\d+) store_jobs=\d+ "
                           r"store_faults=(?P<store>\d+) failed_requests=(?P<failed>\d+) policy=(?P<policy>\w+)"
                           r"(?: load_steps_total=\d+ store_steps_total=\d+)?(?: pid=(?P<pid>\d+))?")
# the probe's invariants at quiescent points (its module docstring; kvrepro/classify/invariants.py)
_INVARIANTS = re.compile(r"kvrepro-probe: invariants checks=(?P<checks>\d+) broken=(?P<broken>\S+)(?: pid=(?P<pid>\d+))?")
_BROKEN = re.compile(r"kvrepro-probe: invariant broken name=(?P<name>\S+) (?:check=(?P<check>\d+) )?(?P<text>.*\S)")
_STALL_STATE = re.compile(r"kvrepro-probe: stall-state idle_steps=(?P<steps>\d+) where=(?P<where>\S+) ?(?P<text>.*\S)?")
_SHADOW_VIOLATION = re.compile(r"kvrepro-shadow: violation (?P<step>step=\S+ )?(?:class=(?P<cls>\S+) )?(?P<text>.*\S)")


class _ProbeCounts(NamedTuple):
    """One process's last probe counts line (what an older probe does not print is zero)."""

    external_hit_calls: int
    trigger_calls: int
    state_calls: int
    state_groups: dict[str, int]
    named: dict[str, int]  # PROBE_COUNTERS the line printed


def _process(stream: str, pid) -> tuple[str, str]:
    """Which process a counts line is the last word of: its pid where the line names one (vLLM's
    stream decoration sometimes leaves a process's line without its "(EngineCore pid=N)" prefix:
    keyed by prefix, one engine's counts were added twice, 702 shadow violations read for 362),
    else its stream (an older probe's line)."""
    return ("", str(pid)) if pid not in (None, "") else (stream, "")


class _ShadowCounts(NamedTuple):
    """One stream's last shadow-KV counts line."""

    checks: int
    violations: int
    violations_by: dict[str, int]
    hit_reads: dict[str, int]
    stored: dict[str, int]


def read_exposure(log_text: str | Iterable[str], metrics_text: str | None = None) -> Exposure:
    """Exposure evidence from an engine log (its text, or its lines as a stream) and, optionally,
    a ``/metrics`` scrape."""
    reader = ExposureReader()
    lines = io.StringIO(log_text, newline="\n") if isinstance(log_text, str) else log_text
    for number, raw in enumerate(lines, start=1):
        reader.feed(number, raw)
    return reader.exposure(metrics_text)


class ExposureReader:
    """:func:`read_exposure` one line at a time: :class:`kvrepro.classify.report.LogParser` feeds it
    beside the classifier, and asks :meth:`exposure` as often as it likes (the run's stop rule asks
    while the log grows); what it keeps is bounded (last counts per process, first violation)."""

    def __init__(self) -> None:
        self.sha: str | None = None
        self.seen = self.shadow_seen = False
        self.last: dict[tuple[str, str], _ProbeCounts] = {}  # (stream, pid) -> that process's last counts
        self.shadow: dict[tuple[str, str], _ShadowCounts] = {}  # process -> its last counts
        self.first_violation: str | None = None
        self.first_class: str | None = None
        self.first_request: dict[str, int] = {}  # violation class -> the first request (1-based) it was described for
        self.kv_groups: tuple[str, ...] = ()
        self.fault_lines: dict[str, set] = {"load": set(), "store": set()}  # (stream, job) per kind: each fault once
        self.failed_on_purpose: set[tuple[str, str]] = set()  # (stream, request) a failed load ended under policy fail
        # each injected load failure in order: (the request's index in the load, kv_load_failure_policy)
        self.failed_loads: list[tuple[int | None, str | None]] = []
        self.fault_counts: dict[tuple[str, str], tuple[int, int, int]] = {}  # (stream, pid) -> last counts line
        self.invariants: dict[tuple[str, str], tuple[int, dict[str, int]]] = {}  # (stream, pid) -> last line
        self.first_broken: str | None = None
        self.stall: tuple[str, str] | None = None  # the last stall-state line: (where, words)

    def feed(self, number: int, raw: str) -> None:
        if _TAG not in raw and _SHADOW_TAG not in raw and _FAULT_TAG not in raw:
            return
        line = split_line(number, raw)
        if (m := _INVARIANTS.search(line.body)) is not None:
            self.invariants[_process(line.stream, m["pid"])] = (int(m["checks"]), _groups(m["broken"]))
            return
        if (m := _STALL_STATE.search(line.body)) is not None:
            self.stall = (m["where"], (m["text"] or "").strip())
            return
        if (m := _BROKEN.search(line.body)) is not None:
            if self.first_broken is None:
                self.first_broken = f"{m['name']}: {m['text']}"
            return
        if (m := _FAULT_LINE.search(line.body)) is not None:
            self.fault_lines[m["kind"]].add((line.stream, m["job"]))
            if m["kind"] == "load" and m["policy"] == "fail" and m["request"]:
                self.failed_on_purpose.add((line.stream, m["request"]))
            if m["kind"] == "load" and len(self.failed_loads) < FAILED_LOADS_KEPT:
                named = _VIOLATION_REQUEST.search(f"request {m['request']}") if m["request"] else None
                self.failed_loads.append((int(named["index"]) if named else None, m["policy"]))
        elif (m := _FAULT_COUNTS.search(line.body)) is not None:
            self.fault_counts[_process(line.stream, m["pid"])] = (
                int(m["load"]), int(m["store"]), int(m["failed"]) if m["policy"] == "fail" else 0)
        elif (m := _INSTALLED.search(line.body)) is not None:
            self.seen = True
            self.sha = m["sha"]
        elif (m := _COUNTS.search(line.body)) is not None:
            named = {c["name"]: int(c["n"]) for c in _NAMED_COUNT.finditer(line.body, m.end())}
            self.last[_process(line.stream, named.pop("pid", None))] = _ProbeCounts(
                external_hit_calls=int(m["ext"]), trigger_calls=int(m["trig"]), state_calls=int(m["state"] or 0),
                state_groups=_groups(m["groups"]), named={k: v for k, v in named.items() if k in PROBE_COUNTERS})
        elif (m := _SHADOW_COUNTS.search(line.body)) is not None:
            self.shadow_seen = True
            self.shadow[_process(line.stream, m["pid"])] = _ShadowCounts(checks=int(m["checks"]), violations=int(m["violations"]),
                                                     violations_by=_groups(m["by"]), hit_reads=_groups(m["hits"]),
                                                     stored=_groups(m["stored"]))
        elif (m := _SHADOW_VIOLATION.search(line.body)) is not None:
            self.shadow_seen = True
            if self.first_violation is None:
                self.first_violation = (m["step"] or "") + m["text"]
                self.first_class = m["cls"]
            named_request = _VIOLATION_REQUEST.search(m["text"])
            if named_request is not None and m["cls"]:  # request numbers count from 1, as `request N` elsewhere
                index = int(named_request["index"]) + 1
                self.first_request[m["cls"]] = min(self.first_request.get(m["cls"], index), index)
        elif (m := _SHADOW_INSTALLED.search(line.body)) is not None:
            self.shadow_seen = True
            self.kv_groups = tuple(item.split(":", 1)[-1].split("/", 1)[0] for item in m["groups"].split(",") if item)

    def exposure(self, metrics_text: str | None = None) -> Exposure:
        """What the lines fed so far say (and ``metrics_text``, a ``/metrics`` scrape, if given)."""
        probes = list(self.last.values())
        external = sum(p.external_hit_calls for p in probes)
        trigger = sum(p.trigger_calls for p in probes)
        state_groups = _added_up(p.state_groups for p in probes)
        if metrics_text:
            m_ext, m_trig = _read_metrics(metrics_text)
            external, trigger = max(external, m_ext), max(trigger, m_trig)
        shadows = list(self.shadow.values())
        violations = sum(s.violations for s in shadows)
        if self.first_violation is not None:
            violations = max(violations, 1)  # the counts line may be cut off after the violation line
        fault_counts, stall, first_broken = self.fault_counts, self.stall, self.first_broken
        return Exposure(trigger_calls=trigger, external_hit_calls=external, probe_source_sha256=self.sha,
                        probe_seen=self.seen, state_calls=sum(p.state_calls for p in probes), state_groups=state_groups,
                        kv_checks=sum(s.checks for s in shadows), kv_violations=violations,
                        kv_violations_by=_added_up(s.violations_by for s in shadows),
                        kv_first_violation=self.first_violation, kv_first_violation_class=self.first_class,
                        kv_groups=self.kv_groups, shadow_seen=self.shadow_seen,
                        kv_hit_reads=_added_up(s.hit_reads for s in shadows),
                        kv_stored=_added_up(s.stored for s in shadows), kv_first_request_by_class=dict(self.first_request),
                        **{name: sum(p.named.get(name, 0) for p in probes) for name in PROBE_COUNTERS},
                        # the counts line, or the fault lines when the log ends before one: the larger
                        injected_load_faults=max(sum(c[0] for c in fault_counts.values()), len(self.fault_lines["load"])),
                        injected_store_faults=max(sum(c[1] for c in fault_counts.values()),
                                                  len(self.fault_lines["store"])),
                        injected_failed_requests=max(sum(c[2] for c in fault_counts.values()),
                                                     len(self.failed_on_purpose)),
                        invariant_checks=sum(c for c, _ in self.invariants.values()),
                        invariants_broken=_added_up(b for _, b in self.invariants.values()) or (
                            {first_broken.split(":", 1)[0]: 1} if first_broken else {}),
                        first_broken=first_broken, stall_where=stall[0] if stall else None,
                        stall_state=stall[1][:600] if stall else None)


def _added_up(counts) -> dict[str, int]:
    """Several processes' {key: count}, added up per key."""
    out: dict[str, int] = {}
    for one in counts:
        for key, n in one.items():
            out[key] = out.get(key, 0) + n
    return out


def _groups(text: str | None) -> dict[str, int]:
    """``full_attention:3,mamba+offload/null-block/hit:1`` (or ``-``) -> {kind or class: count}."""
    out: dict[str, int] = {}
    for item in (text or "").split(","):
        kind, _, n = item.partition(":")
        if kind and kind != "-" and n.isdigit():
            out[kind] = out.get(kind, 0) + int(n)
    return out


def _read_metrics(text: str) -> tuple[int, int]:
    """Sum every series of the two counters (labels, if any, split one counter into several)."""
    samples = {k: v for k, v in parse_prometheus(text).items() if math.isfinite(v)}  # NaN is no count
    return (int(total(samples, "kvrepro_probe_external_hit_calls_total")),
            int(total(samples, "kvrepro_probe_trigger_calls_total")))
