"""Undo the decorations that sit in front of every line of an engine log.

A vLLM log line can carry up to four layers of prefix, outermost first:

* ``2025-11-29T10:00:00.123456789Z `` -- ``docker logs -t`` (RFC3339, one per line);
* ``engine  | `` -- ``docker compose logs``;
* ``(EngineCore_DP0 pid=1234) `` -- vLLM's ``decorate_logs``: every process of ``vllm serve``
  prefixes everything it writes to stdout/stderr with its name and pid;
* ``ERROR 11-29 10:00:00 [core.py:1332] `` -- vLLM's logger format. Its ``NewLineFormatter``
  repeats this header in front of every line of a multi-line record (a logged traceback),
  joined with ``\\r\\n``; ANSI colours appear when the engine thought it had a terminal.

Tracebacks can only be read once these are gone, and lines of different processes interleave,
so each line is reduced to the process it came from (``stream``), the logger header it carried
(lines of one logged record share it) and the bare text (``body``). Everything here is a handful
of anchored regex matches per line: linear in the size of the log.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_DOCKER_TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d) ?")
# compose pads the service name with spaces before the bar; requiring them keeps ordinary text
# that happens to contain " | " from being cut
_COMPOSE = re.compile(r"[\w.-]+ +\| ?")
_PROC = re.compile(r"\(([^()\s]+ pid=\d+)\) ?")
_HEADER = re.compile(
    r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]\s]+:\d+\](?: |$)"
)


@dataclass(frozen=True, slots=True)
class LogLine:
    """One line of a log with its decorations taken apart.

    ``number`` is 1-based. ``stream`` names the process (``"EngineCore_DP0 pid=1234"``) or is
    ``""`` for undecorated output. ``header`` is the vLLM logger header the line carried, or None
    for raw output (print, an uncaught exception's traceback). ``level`` is the header's level.
    """

    number: int
    stream: str
    header: str | None
    level: str | None
    body: str


def split_line(number: int, raw: str) -> LogLine:
    """Take one raw line (with or without its line ending) apart."""
    line = raw.rstrip("\r\n")
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    if (m := _DOCKER_TS.match(line)) is not None:
        line = line[m.end():]
    if (m := _COMPOSE.match(line)) is not None:
        line = line[m.end():]
        if (m := _DOCKER_TS.match(line)) is not None:
            line = line[m.end():]
    stream = ""
    # a line can carry two process prefixes, "(APIServer pid=1) (EngineCore pid=2) ERROR ...": a
    # forked EngineCore's first write of a logged record passing through the decorated stream it
    # inherited. The text is the innermost process's, so that one names the stream.
    while line.startswith("(") and (m := _PROC.match(line)) is not None:
        stream = m.group(1)
        line = line[m.end():]
    header = level = None
    if (m := _HEADER.match(line)) is not None:
        header = m.group(0).rstrip()
        level = m.group(1)
        line = line[m.end():]
    # the \r that NewLineFormatter puts before each inner newline ends up inside the line once
    # a prefix has been written after it
    return LogLine(number, stream, header, level, line.rstrip("\r"))
