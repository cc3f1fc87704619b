"""An engine log parsed once into one report every consumer reads (syzkaller's ``pkg/report``
shape: the runner, the suite through the runner's records, `kvrepro classify` and the stop rule
all take what a log says from a :class:`ParsedLog`, never from the text again).

One pass feeds every reader a line at a time: the classifier's (:class:`~.classifier.Scan`), the
probe's and shadow KV's (:class:`~.exposure.ExposureReader`), the GPU-free engine's totals
(:class:`~.engine_counters.CountersReader`) and what the log says about the KV capacity and the
geometry vLLM built (:class:`~kvrepro.loadgen.capacity.LoggedCapacity`, whose geometry parser is
:func:`kvrepro.spec.geometry.parse_geometry_line`). Each keeps bounded state, so a log of any
length is parsed in flat memory.

:class:`LogTail` reads a growing log file from where it stopped, so a run reads each byte of its
engine log once: at start (the capacity the load is sized for), while the load runs (the stop
rule's exposure) and after the engine stopped (the verdict). It decodes as ``Path.read_text``
did (UTF-8, bad bytes replaced, ``\\r\\n`` and ``\\r`` read as line ends).
"""

from __future__ import annotations

import codecs
import io
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..loadgen.capacity import LoggedCapacity
from .records import Classification, EngineCounters, Exposure
from ..spec.geometry import BuiltGeometry
from ..spec.matrix import TargetSignature
from .classifier import Scan, classify_evidence
from .engine_counters import CountersReader
from .exposure import ExposureReader
from .lines import split_line
from .tracebacks import Traceback

# lines whose words are kvrepro's own bookkeeping, never "the last thing the engine said"
_OWN_TAGS = ("kvrepro-probe:", "kvrepro-sim:")
_LAST_KEPT = 64  # raw lines kept to find the last meaningful one (a prefix-only line has no body)


@dataclass(frozen=True)
class ParsedLog:
    """What one engine log says, parsed once."""

    classification: Classification
    traceback: Traceback | None  # the one the classification rests on
    exposure: Exposure  # the log's alone (the /metrics scrape is merged by judge())
    counters: EngineCounters
    capacity: LoggedCapacity
    geometries: tuple[BuiltGeometry, ...] = ()  # every geometry line, in order
    last_line: str | None = None  # the last line's words that are not kvrepro's own bookkeeping
    # the injected load failures (`kvrepro-fault:` lines), in order: (request index in the load, policy)
    failed_loads: tuple[tuple[int | None, str | None], ...] = ()
    # every traceback in the log, in order (bounded: classifier.TRACEBACKS_KEPT and the last), for a
    # reader that picks one itself where the engine's markers are missing (triage of a pasted report)
    tracebacks: tuple[Traceback, ...] = field(default=(), repr=False)
    lines: int = 0
    exposure_reader: ExposureReader | None = field(default=None, repr=False, compare=False)

    def exposure_with(self, metrics_text: str | None) -> Exposure:
        """The exposure with a ``/metrics`` scrape's counts merged (the larger of log and scrape)."""
        if not metrics_text or self.exposure_reader is None:
            return self.exposure
        return self.exposure_reader.exposure(metrics_text)


class LogParser:
    """Every reader of an engine log, fed one line at a time (:meth:`feed`); :meth:`parsed` is the report."""

    def __init__(self, source_root: Path | None = None, target: TargetSignature | None = None):
        self.source_root = source_root
        self.target = target
        self.number = 0
        self.scan = Scan()
        self.exposure_reader = ExposureReader()
        self.counters_reader = CountersReader()
        self.capacity = LoggedCapacity()
        self._recent: deque[tuple[int, str]] = deque(maxlen=_LAST_KEPT)

    def feed(self, raw: str) -> None:
        self.number += 1
        number = self.number
        self.scan.feed(number, raw)
        self.exposure_reader.feed(number, raw)
        self.counters_reader.feed(number, raw)
        self.capacity.feed(raw)
        if raw.strip() and not any(tag in raw for tag in _OWN_TAGS):
            self._recent.append((number, raw))

    def exposure(self) -> Exposure:
        """The exposure of the lines fed so far (the stop rule asks while the log grows)."""
        return self.exposure_reader.exposure()

    def parsed(self) -> ParsedLog:
        classification, tb = classify_evidence(self.scan.close(), self.source_root, self.target)
        tracebacks = tuple(sorted(self.scan.tracebacks, key=lambda t: t.first_line))
        last = None
        for number, raw in reversed(self._recent):
            body = split_line(number, raw.rstrip("\n")).body.strip()
            if body:
                last = body
                break
        return ParsedLog(classification=classification, traceback=tb, exposure=self.exposure_reader.exposure(),
                         counters=self.counters_reader.counters(), capacity=self.capacity,
                         geometries=tuple(self.capacity.geometries), last_line=last, lines=self.number,
                         failed_loads=tuple(self.exposure_reader.failed_loads), tracebacks=tracebacks,
                         exposure_reader=self.exposure_reader)


def parse_log(lines: Iterable[str] | str, source_root: Path | None = None,
              target: TargetSignature | None = None) -> ParsedLog:
    """A log's text, or its lines as a stream (an open file, :func:`~.logfile.open_log`), parsed once."""
    parser = LogParser(source_root, target)
    for raw in io.StringIO(lines, newline="\n") if isinstance(lines, str) else lines:
        parser.feed(raw)
    return parser.parsed()


class LogTail:
    """A growing log file read from where the last read stopped, each complete line fed to a
    :class:`LogParser` once; :meth:`finish` feeds the unfinished last line and gives the report."""

    def __init__(self, path: Path, parser: LogParser):
        self.path = Path(path)
        self.parser = parser
        self.offset = 0
        self.reads = 0  # how many times the file was opened and read (a run's count: docs/, issue 49)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""

    def read(self) -> LogParser:
        """Feed what was written since the last read; the parser (its state so far) is returned."""
        self._take(final=False)
        return self.parser

    def finish(self) -> ParsedLog:
        self._take(final=True)
        if self._partial:
            self.parser.feed(self._partial)
            self._partial = ""
        return self.parser.parsed()

    def _take(self, final: bool) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            data = b""
        self.reads += 1
        self.offset += len(data)
        text = self._partial + self._decoder.decode(data, final=final)
        hold = ""
        if text.endswith("\r") and not final:  # "\r\n" may be split between two reads
            text, hold = text[:-1], "\r"
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._partial = lines.pop() + hold  # an unfinished last line waits for its end
        for line in lines:
            self.parser.feed(line + "\n")
