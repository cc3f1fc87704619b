"""Read the probe's evidence that the code path under test actually ran.

A SURVIVED verdict is only worth something if the crash's precondition happened during the run
(a request with both a local prefix hit and an offload hit reaching update_state_after_alloc).
The probe installed in the engine says so on stderr::

    kvrepro-probe: installed function=OffloadingConnectorScheduler.update_state_after_alloc file=<path> source_sha256=<64 hex>
    kvrepro-probe: counts external_hit_calls=<N> trigger_calls=<M> state_calls=<K> state_groups=<kind>:<n>,... deferred_lookups=<D> loads_behind_deferred=<L> pid=<P>

(older probes end the counts line after ``trigger_calls``, or after ``state_groups``: what they do
not print is read as zero). The
GPU-free engine's shadow KV (kvrepro/engine/shadow.py) reports what it checked the same way::

    kvrepro-shadow: installed groups=...
    kvrepro-shadow: violation step=<S> class=<class> <words>
    kvrepro-shadow: counts checks=<N> violations=<M> by=<class>:<n>,... hits=<kind>:<n>,... stored=<kind>:<n>,...

(a class is ``<group kind>[+offload]/<read>/<region>``; older engines print ``<kind>[+offload]``
alone and no ``class=``).

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

from ..records import REQUEST_ID_PREFIX, Exposure
from .lines import split_line
from .metrics import parse_prometheus, total

_TAG = "kvrepro-probe:"
_INSTALLED = re.compile(
    r"kvrepro-probe: installed function=(?P<function>\S+) file=(?P<file>.*?) source_sha256=(?P<sha>[0-9a-f]{64})\b"
)
_COUNTS = re.compile(r"kvrepro-probe: counts external_hit_calls=(?P<ext>\d+) trigger_calls=(?P<trig>\d+)\b"
                     r"(?: state_calls=(?P<state>\d+) state_groups=(?P<groups>\S+))?"
                     r"(?: deferred_lookups=(?P<deferred>\d+) loads_behind_deferred=(?P<behind>\d+))?"
                     r"(?: pid=(?P<pid>\d+))?")
_SHADOW_TAG = "kvrepro-shadow:"
_SHADOW_COUNTS = re.compile(r"kvrepro-shadow: counts checks=(?P<checks>\d+) violations=(?P<violations>\d+)\b"
                            r"(?: by=(?P<by>\S+))?(?: hits=(?P<hits>\S+))?(?: stored=(?P<stored>\S+))?")
_SHADOW_INSTALLED = re.compile(r"kvrepro-shadow: installed groups=(?P<groups>\S*)")
# the request a described violation is about, when the load named it (kvrepro.loadgen.request_id)
_VIOLATION_REQUEST = re.compile(r"\brequest (?:chat)?cmpl-" + re.escape(REQUEST_ID_PREFIX) + r"(?P<index>\d+)-")
_SHADOW_VIOLATION = re.compile(r"kvrepro-shadow: violation (?P<step>step=\S+ )?(?:class=(?P<cls>\S+) )?(?P<text>.*\S)")


def read_exposure(log_text: str, metrics_text: str | None = None) -> Exposure:
    """Exposure evidence from an engine log and, optionally, a ``/metrics`` scrape."""
    sha: str | None = None
    seen = shadow_seen = False
    # (stream, pid) -> last probe counts (external_hit_calls, trigger_calls, state_calls, state_groups,
    # deferred_lookups, loads_behind_deferred)
    last: dict[tuple[str, str], tuple[int, int, int, dict[str, int], int, int]] = {}
    # stream -> (checks, violations, by class, hit reads by kind, stored blocks by kind)
    shadow: dict[str, tuple[int, int, dict[str, int], dict[str, int], dict[str, int]]] = {}
    first_violation: str | None = None
    first_class: str | None = None
    first_request: dict[str, int] = {}  # violation class -> the first request (1-based) it was described for
    kv_groups: tuple[str, ...] = ()
    for number, raw in enumerate(io.StringIO(log_text, newline="\n"), start=1):
        if _TAG not in raw and _SHADOW_TAG not in raw:
            continue
        line = split_line(number, raw)
        if (m := _INSTALLED.search(line.body)) is not None:
            seen = True
            sha = m["sha"]
        elif (m := _COUNTS.search(line.body)) is not None:
            last[(line.stream, m["pid"] or "")] = (int(m["ext"]), int(m["trig"]), int(m["state"] or 0),
                                                 _groups(m["groups"]), int(m["deferred"] or 0),
                                                 int(m["behind"] or 0))
        elif (m := _SHADOW_COUNTS.search(line.body)) is not None:
            shadow_seen = True
            shadow[line.stream] = (int(m["checks"]), int(m["violations"]), _groups(m["by"]), _groups(m["hits"]),
                                   _groups(m["stored"]))
        elif (m := _SHADOW_VIOLATION.search(line.body)) is not None:
            shadow_seen = True
            if first_violation is None:
                first_violation = (m["step"] or "") + m["text"]
                first_class = m["cls"]
            named = _VIOLATION_REQUEST.search(m["text"])
            if named is not None and m["cls"]:  # request numbers count from 1, as `request N` elsewhere
                number = int(named["index"]) + 1
                first_request[m["cls"]] = min(first_request.get(m["cls"], number), number)
        elif (m := _SHADOW_INSTALLED.search(line.body)) is not None:
            shadow_seen = True
            kv_groups = tuple(item.split(":", 1)[-1].split("/", 1)[0] for item in m["groups"].split(",") if item)
    external = sum(v[0] for v in last.values())
    trigger = sum(v[1] for v in last.values())
    state = sum(v[2] for v in last.values())
    state_groups: dict[str, int] = {}
    for v in last.values():
        for kind, n in v[3].items():
            state_groups[kind] = state_groups.get(kind, 0) + n
    if metrics_text:
        m_ext, m_trig = _read_metrics(metrics_text)
        external, trigger = max(external, m_ext), max(trigger, m_trig)
    violations = sum(v[1] for v in shadow.values())
    violations_by, hit_reads, stored = (_added_up(v[i] for v in shadow.values()) for i in (2, 3, 4))
    if first_violation is not None:
        violations = max(violations, 1)  # the counts line may be cut off after the violation line
    return Exposure(trigger_calls=trigger, external_hit_calls=external, probe_source_sha256=sha, probe_seen=seen,
                    state_calls=state, state_groups=state_groups, kv_checks=sum(v[0] for v in shadow.values()),
                    kv_violations=violations, kv_violations_by=violations_by, kv_first_violation=first_violation, kv_first_violation_class=first_class,
                    kv_groups=kv_groups, shadow_seen=shadow_seen, kv_hit_reads=hit_reads, kv_stored=stored,
                    kv_first_request_by_class=first_request,
                    deferred_lookups=sum(v[4] for v in last.values()),
                    loads_behind_deferred=sum(v[5] for v in last.values()))


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
