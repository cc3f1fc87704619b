"""Find Python tracebacks in a stream of log lines.

Works on :class:`~kvrepro.classify.lines.LogLine` so that a traceback is followed within one
process even when the lines of other processes are interleaved with it, and so that a logged
traceback (every line carries the same logger header) ends where that record ends.

The parser is a small state machine per process: it does not need the whole log in memory and
it survives a log cut off mid-traceback (the traceback is reported without its exception line).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .lines import LogLine

TRACEBACK_START = "Traceback (most recent call last):"
_CAUSE = "The above exception was the direct cause of the following exception:"
_CONTEXT = "During handling of the above exception, another exception occurred:"
_FRAME = re.compile(r'\s*File "(?P<path>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>.+))?\s*$')
_CARET = re.compile(r"\s*[\^~]+\s*$")
_EXCEPTION = re.compile(r"(?P<name>[A-Za-z_][\w.]*)(?::(?: (?P<msg>.*))?)?$")

# The engine's own "this is the end" messages, logged right before the traceback that killed it
# (vllm/v1/engine/core.py: logger.exception(...) in run_engine_core and EngineCoreActor.run).
FATAL_MARKER = "EngineCore encountered a fatal error."
FAILED_START_MARKER = "EngineCore failed to start."
_MARKER_REACH = 3  # lines of the same process allowed between a marker and its traceback
_MAX_MESSAGE_LINES = 20


@dataclass
class Frame:
    path: str
    line: int
    function: str
    source: list[str] = field(default_factory=list)  # the code lines the traceback shows


@dataclass
class Segment:
    """One exception of a chain: its frames, then its ``Name: message`` line.

    ``link`` says how it follows the previous segment: "cause" (``raise ... from``), "context"
    (raised while handling the previous one) or None for the first.
    """

    link: str | None
    frames: list[Frame] = field(default_factory=list)
    exception: str | None = None  # as printed, possibly dotted (vllm.v1.engine.exceptions.X)
    message_lines: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.exception is not None

    @property
    def short_exception(self) -> str | None:
        return self.exception.rsplit(".", 1)[-1] if self.exception else None

    @property
    def message(self) -> str:
        return "\n".join(self.message_lines)


@dataclass
class Traceback:
    """A whole printed traceback, possibly a chain of several exceptions."""

    stream: str
    header: str | None  # the logger header it was logged under; None when printed raw
    level: str | None
    first_line: int
    last_line: int
    segments: list[Segment]
    marker: str | None = None  # FATAL_MARKER / FAILED_START_MARKER when the engine announced it

    @property
    def complete(self) -> bool:
        return self.segments[-1].complete

    @property
    def final(self) -> Segment:
        return self.segments[-1]

    def root(self) -> Segment:
        """The exception that explains this traceback.

        The last segment is the exception that was actually raised to the top. If it was raised
        ``from`` another one, that other one is the deliberate cause and is reported instead,
        repeatedly. An implicit context ("During handling of ...") is not followed: that earlier
        exception was being handled, often as normal control flow, when the real failure came.
        """
        i = len(self.segments) - 1
        while i > 0 and self.segments[i].link == "cause":
            i -= 1
        return self.segments[i]


class _Builder:
    def __init__(self, line: LogLine, marker: str | None):
        self.tb = Traceback(line.stream, line.header, line.level, line.number, line.number,
                            [Segment(link=None)], marker)
        self.state = "frames"  # frames -> after_exc -> (await_tb -> frames)*
        self.pending_link: str | None = None
        self.blank_since_exc = False

    @property
    def seg(self) -> Segment:
        return self.tb.segments[-1]

    def feed(self, line: LogLine) -> bool:
        """Consume one line; False when the line does not belong to this traceback."""
        body = line.body
        if self.state == "frames":
            if (m := _FRAME.match(body)) is not None:
                self.seg.frames.append(Frame(m["path"], int(m["line"]), (m["func"] or "").strip()))
            elif body.startswith((" ", "\t")):
                text = body.strip()
                if text and self.seg.frames and not _CARET.match(body) and not text.startswith("[Previous line"):
                    self.seg.frames[-1].source.append(text)
            elif body == "":
                pass
            elif _looks_like_exception(body):
                m = _EXCEPTION.match(body)
                assert m is not None
                self.seg.exception = m["name"]
                if m["msg"]:
                    self.seg.message_lines.append(m["msg"])
                self.state = "after_exc"
                self.blank_since_exc = False
            else:
                return False
        else:
            text = body.strip()
            if text == _CAUSE or text == _CONTEXT:
                self.pending_link = "cause" if text == _CAUSE else "context"
                self.state = "await_tb"
            elif text == "":
                self.blank_since_exc = True
            elif (self.state == "after_exc" and not self.blank_since_exc
                  and len(self.seg.message_lines) < _MAX_MESSAGE_LINES):
                self.seg.message_lines.append(body)
            else:
                return False
        self.tb.last_line = line.number
        return True

    def chain(self, line: LogLine) -> None:
        self.tb.segments.append(Segment(link=self.pending_link))
        self.tb.last_line = line.number
        self.pending_link = None
        self.state = "frames"


def _looks_like_exception(body: str) -> bool:
    """``Name`` or ``Name: message`` where Name could be an exception class.

    Log levels and uvicorn's ``INFO:     ...`` lines have the same shape; they are ALL-CAPS,
    exception classes are not (``OSError`` and ``EOFError`` mix cases). A few C modules name
    theirs in lower case (``re.error``, ``struct.error``): accepted when qualified by a module.
    """
    m = _EXCEPTION.match(body)
    if m is None:
        return False
    name = m["name"]
    last = name.rsplit(".", 1)[-1]
    if last[:1].islower():
        return "." in name
    return last[:1].isupper() and not last.isupper()


class TracebackScanner:
    """Feed log lines in order; ``on_traceback`` is called with every finished traceback."""

    def __init__(self, on_traceback: Callable[[Traceback], None]):
        self._emit = on_traceback
        self._open: dict[str, _Builder] = {}
        self._markers: dict[str, tuple[str, int]] = {}  # stream -> (marker, lines of that stream since)

    @property
    def busy(self) -> bool:
        """True while a traceback is open or a marker waits for one: every line matters then."""
        return bool(self._open or self._markers)

    def feed(self, line: LogLine) -> None:
        stream = line.stream
        builder = self._open.get(stream)
        if builder is not None and builder.tb.header != line.header:
            self._finish(stream)
            builder = None
        body = line.body
        if body.startswith(TRACEBACK_START):
            if builder is not None and builder.state == "await_tb":
                builder.chain(line)
                return
            if builder is not None:
                self._finish(stream)
            marker = None
            if stream in self._markers:
                marker = self._markers.pop(stream)[0]
            self._open[stream] = _Builder(line, marker)
            return
        if builder is not None and builder.feed(line):
            return
        if builder is not None:
            self._finish(stream)
        if FATAL_MARKER in body:
            self._markers[stream] = (FATAL_MARKER, 0)
        elif FAILED_START_MARKER in body:
            self._markers[stream] = (FAILED_START_MARKER, 0)
        elif stream in self._markers:
            marker, seen = self._markers[stream]
            if seen + 1 > _MARKER_REACH:
                del self._markers[stream]
            else:
                self._markers[stream] = (marker, seen + 1)

    def close(self) -> None:
        """End of log: whatever is still open was cut off (or simply ended the file)."""
        for stream in list(self._open):
            self._finish(stream)

    def _finish(self, stream: str) -> None:
        builder = self._open.pop(stream)
        self._emit(builder.tb)
