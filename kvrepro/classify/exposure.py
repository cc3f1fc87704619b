"""Read the probe's evidence that the code path under test actually ran.

A SURVIVED verdict is only worth something if the crash's precondition happened during the run
(a request with both a local prefix hit and an offload hit reaching update_state_after_alloc).
The probe installed in the engine says so on stderr::

    kvrepro-probe: installed function=OffloadingConnectorScheduler.update_state_after_alloc file=<path> source_sha256=<64 hex>
    kvrepro-probe: counts external_hit_calls=<N> trigger_calls=<M>

The counts line is repeated with running totals, so the last one of each process counts; when
several processes print (their lines carry different ``(Name pid=N)`` prefixes, or, from vLLM
0.33 on where children's raw stderr is not prefixed, different ``pid=`` fields) their last lines
are added up. The GPU-free engine also exports the totals on ``/metrics``; the larger of the two
sources wins, since either can miss the last few calls (a log cut short, a scrape taken early).
"""

from __future__ import annotations

import io
import re

from ..records import Exposure
from .lines import split_line

_TAG = "kvrepro-probe:"
_INSTALLED = re.compile(
    r"kvrepro-probe: installed function=(?P<function>\S+) file=(?P<file>.*?) source_sha256=(?P<sha>[0-9a-f]{64})\b"
)
_COUNTS = re.compile(r"kvrepro-probe: counts external_hit_calls=(?P<ext>\d+) trigger_calls=(?P<trig>\d+)\b"
                     r"(?: pid=(?P<pid>\d+))?")
_METRIC = re.compile(
    r"^(?P<name>kvrepro_probe_external_hit_calls_total|kvrepro_probe_trigger_calls_total)(?:\{[^}]*\})?\s+(?P<value>\S+)",
    re.MULTILINE,
)


def read_exposure(log_text: str, metrics_text: str | None = None) -> Exposure:
    """Exposure evidence from an engine log and, optionally, a ``/metrics`` scrape."""
    sha: str | None = None
    seen = False
    last: dict[tuple[str, str], tuple[int, int]] = {}  # (stream, pid) -> (external_hit_calls, trigger_calls)
    for number, raw in enumerate(io.StringIO(log_text, newline="\n"), start=1):
        if _TAG not in raw:
            continue
        line = split_line(number, raw)
        if (m := _INSTALLED.search(line.body)) is not None:
            seen = True
            sha = m["sha"]
        elif (m := _COUNTS.search(line.body)) is not None:
            last[(line.stream, m["pid"] or "")] = (int(m["ext"]), int(m["trig"]))
    external = sum(e for e, _ in last.values())
    trigger = sum(t for _, t in last.values())
    if metrics_text:
        m_ext, m_trig = _read_metrics(metrics_text)
        external, trigger = max(external, m_ext), max(trigger, m_trig)
    return Exposure(trigger_calls=trigger, external_hit_calls=external, probe_source_sha256=sha, probe_seen=seen)


def _read_metrics(text: str) -> tuple[int, int]:
    """Sum every series of the two counters (labels, if any, split one counter into several)."""
    totals = {"kvrepro_probe_external_hit_calls_total": 0.0, "kvrepro_probe_trigger_calls_total": 0.0}
    for m in _METRIC.finditer(text):
        try:
            totals[m["name"]] += float(m["value"])
        except ValueError:
            continue
    return int(totals["kvrepro_probe_external_hit_calls_total"]), int(totals["kvrepro_probe_trigger_calls_total"])
