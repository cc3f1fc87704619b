"""How the log's engine failed: the crash (through kvrepro.classify), or a stall read from vLLM's
periodic stats line.

vLLM's API server logs, every ``VLLM_LOG_STATS_INTERVAL`` (10 s), per engine::

    Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s,
    Running: 0 reqs, Waiting: 4 reqs, Deferred: 3 reqs, GPU KV cache usage: 46.0%, ...

and stops logging it (DEBUG) once two intervals in a row had no throughput. So a stalled engine
shows one line with nothing running, requests waiting and no throughput, and then silence from
that engine while the log goes on (access lines, health checks, other engines). The stall lasts
from that line to the log's last timestamp; STALL_MIN_S of it is a stall, less may be a pause.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .records import Stall

STALL_MIN_S = 120.0
_STATS = re.compile(
    r"(?:Engine (?P<engine>\d+): )?Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, "
    r"Avg generation throughput: (?P<gen>[\d.]+) tokens/s, Running: (?P<running>\d+) reqs, "
    r"Waiting: (?P<waiting>\d+) reqs(?:, Deferred: (?P<deferred>\d+) reqs)?")
_DOCKER_TS = re.compile(r"(?:^|\s)(?P<y>\d{4})-(?P<mo>\d\d)-(?P<d>\d\d)T(?P<h>\d\d):(?P<mi>\d\d):(?P<s>\d\d(?:\.\d+)?)")
_HEADER_TS = re.compile(r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<mo>\d\d)-(?P<d>\d\d) (?P<h>\d\d):(?P<mi>\d\d):(?P<s>\d\d(?:\.\d+)?)")
_DAYS_BEFORE_MONTH = (0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334)


def timestamp(raw: str) -> float | None:
    """Seconds (of an arbitrary year: only differences are used) from a line's container
    timestamp, else from vLLM's logger header (MM-DD hh:mm:ss); None when it has neither."""
    m = _DOCKER_TS.search(raw[:64]) or _HEADER_TS.search(raw[:200])
    if m is None:
        return None
    day = _DAYS_BEFORE_MONTH[min(12, max(1, int(m["mo"]))) - 1] + int(m["d"])
    return ((day * 24 + int(m["h"])) * 60 + int(m["mi"])) * 60 + float(m["s"])


@dataclass
class _EngineState:
    since: float | None
    line: int
    waiting: int
    deferred: int
    text: str


class StallReader:
    """Feed the log's lines; :meth:`stall` is the longest stall still going at the end."""

    def __init__(self) -> None:
        self._stalled: dict[str, _EngineState] = {}
        self.last_time: float | None = None

    def feed(self, number: int, raw: str) -> None:
        """One raw stats line (the caller passes those with ``throughput:``); the regex finds the
        stats wherever the line's prefixes (container timestamp, process, logger header) end."""
        m = _STATS.search(raw)
        if m is None:
            return
        engine = m["engine"] or "000"
        if m["running"] == "0" and m["waiting"] != "0" and float(m["prompt"]) == 0 and float(m["gen"]) == 0:
            if engine not in self._stalled:
                self._stalled[engine] = _EngineState(timestamp(raw), number, int(m["waiting"]),
                                                     int(m["deferred"] or 0), raw[m.start():].strip())
        else:
            self._stalled.pop(engine, None)

    def end(self, last_raw: str) -> None:
        """The log's last line: its timestamp ends every stall still going."""
        if (t := timestamp(last_raw)) is not None:
            self.last_time = t

    def stall(self) -> Stall | None:
        best: Stall | None = None
        for engine, state in self._stalled.items():
            if state.since is None or self.last_time is None:
                continue
            seconds = self.last_time - state.since
            if seconds < 0:
                seconds += 366 * 86400  # the log ran over New Year (vLLM's header has no year)
            if seconds >= STALL_MIN_S and (best is None or seconds > best.seconds):
                best = Stall(engine, state.line, seconds, state.waiting, state.deferred, state.text)
        return best
