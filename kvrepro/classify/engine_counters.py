"""The GPU-free engine's own counters, read from its log.

The fake executor runs in vLLM's EngineCore process, where vLLM's ``/metrics`` (served by the
API server process) cannot see it; it logs its running totals instead, every two seconds while
they change and once more at shutdown::

    (EngineCore pid=N) INFO ... kvrepro-sim: counts steps=<N> offload_load_jobs=<N> offload_store_jobs=<N> pid=<P>

The last line of each process (log stream and ``pid``) counts; several EngineCore processes (data parallel) add up.
A log without such a line (an engine that is not the sim, or one killed before its first
report) gives ``None`` for every counter: unknown, not zero.
"""

from __future__ import annotations

import io
import re

from .records import EngineCounters
from .lines import split_line

_TAG = "kvrepro-sim: counts"
_COUNTS = re.compile(r"kvrepro-sim: counts steps=(?P<steps>\d+) offload_load_jobs=(?P<load>\d+) "
                     r"offload_store_jobs=(?P<store>\d+)\b(?: pid=(?P<pid>\d+))?")


def read_engine_counters(log_text: str) -> EngineCounters:
    reader = CountersReader()
    for number, raw in enumerate(io.StringIO(log_text, newline="\n"), start=1):
        reader.feed(number, raw)
    return reader.counters()


class CountersReader:
    """:func:`read_engine_counters` one line at a time (kvrepro/classify/report.py feeds it)."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], tuple[int, int, int]] = {}

    def feed(self, number: int, raw: str) -> None:
        if _TAG not in raw:
            return
        line = split_line(number, raw)
        if (m := _COUNTS.search(line.body)) is not None:
            self.last[(line.stream, m["pid"] or "")] = (int(m["steps"]), int(m["load"]), int(m["store"]))

    def counters(self) -> EngineCounters:
        last = self.last
        if not last:
            return EngineCounters()
        return EngineCounters(steps=sum(v[0] for v in last.values()),
                              offload_load_jobs=sum(v[1] for v in last.values()),
                              offload_store_jobs=sum(v[2] for v in last.values()))
