"""Text as people paste it, made readable as a log.

A report on a tracker is rarely a log file: it is the lines someone selected, inside markdown
code fences (indented when the fence sits in a list), behind ``> `` quote markers, out of a
journal (``Apr  3 17:38:57 host prog[pid]: ``, rsyslog's ``#033[1;36m`` for the colour escape)
or a CI viewer (``[2026-04-14T06:24:27Z] ``), with the logger header only on some lines, the
traceback starting mid-way (frames with no ``Traceback (most recent call last):`` above them),
source lines whose indentation the paste lost, frames abbreviated to ``File "...", in func``.
vLLM's own formats vary too: releases before the V1 engine printed ``ERROR 12-16 21:40:15
engine.py:135]`` (no opening bracket), a custom date format gives ``ERROR 2026-05-14
05:25:28.876 [core.py:1123]``, workers are ``(VllmWorker rank=5 pid=50999)``.

:func:`normalise` undoes what one line carries (used on every line of any log: a few anchored
regexes); :func:`repair` also mends what only the neighbouring lines tell (fences, a block's
indentation, a traceback's missing start, its lost indentation, a logger header present on some
of its lines only) and is used on pasted text, which is small. Nothing here decides what
failed: the result goes to kvrepro.classify like any log.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..classify.lines import split_line
from ..classify.logfile import LogInfo, LogStream
from ..classify.tracebacks import TRACEBACK_START
from .reader import ReadStats


def read_whole(stream: LogStream, info: LogInfo, stats: ReadStats, limit: int
               ) -> tuple[list[tuple[int, str]] | None, bytes]:
    """(every line of the text, numbered; the bytes read) when the log's text is at most ``limit``
    bytes (a report pasted from a tracker, from a file, a pipe or a compressed file alike), else
    (None, the first ``limit`` + 1 bytes: the caller reads on from there as a log, streamed).

    ``stream`` is the log as kvrepro/classify/logfile.py opened it: UTF-16/32 transcoded,
    ``\\r``-only line ends read as lines, every line cut to the bound, and what is not text (NUL
    bytes, not UTF-8) refused there in one line (exit 2); what it noticed goes to ``stats.notices``."""
    chunks: list[bytes] = []
    got = 0
    while got <= limit and (data := stream.read(limit + 1 - got)):
        chunks.append(data)
        got += len(data)
    head = b"".join(chunks)
    if got > limit:
        return None, head
    text = head.decode("utf-8", errors="replace").removeprefix("\ufeff")
    lines = text.split("\n")
    if lines and not lines[-1]:
        lines.pop()
    stats.bytes_read, stats.lines, stats.selected = got, len(lines), len(lines)
    stats.last_line = lines[-1] if lines else ""
    stats.notices.extend(info.notices())
    return list(enumerate(lines, start=1)), head


_FENCE = re.compile(r"^\s*(?:```|~~~)")
_QUOTE = re.compile(r"^(?:[ \t]*>(?!>>))+[ \t]?")
_ESCAPED_ANSI = re.compile(r"#033\[[0-9;]*[A-Za-z]")
# "Apr  3 17:38:57 host prog[123]: " (syslog), "6月 10 16:45:05 host bash[107468]: " (journalctl, any locale)
_SYSLOG = re.compile(r"^\S+\s+\d{1,2}\s+\d\d:\d\d:\d\d(?:\.\d+)?\s+\S+\s+[^\s\[\]:]+(?:\[\d+\])?:\s")
_BRACKET_TS = re.compile(r"^\[\d{4}-\d\d-\d\d[T ][\d:.]+(?:Z|[+-]\d\d:?\d\d)?\]\s?")
# a launcher's rank in front of each line: torch's "[rank0]: ", "[3] ", "0] "; kubectl logs --prefix's
# "[pod/vllm-0/vllm] "
_RANK = re.compile(r"^\[?(?:rank)?\d{1,3}\]:?\s|^\[pod/[^\]\s]+\]\s")
# a vLLM process prefix, also the forms lines.split_line does not take (a space or an ip inside)
_PROC_ANY = re.compile(r"\((?P<name>[A-Za-z][\w.-]*(?: rank=\d+)?) pid=(?P<pid>\d+)(?:, ip=[\d.]+)?\) ?")
_LEVELS = "DEBUG|INFO|WARNING|ERROR|CRITICAL"
_HEADER_START = re.compile(rf"(?:{_LEVELS}) (?:(?:\d{{4}}-)?\d\d-\d\d \d\d:\d\d:\d\d|\[[^\]\s]+:\d+\])")
# releases before V1 wrote "ERROR 12-16 21:40:15 engine.py:135] " (no opening bracket)
_BRACKETLESS = re.compile(rf"^((?:{_LEVELS}) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?) ([^\s\[\]]+:\d+\])")
# a logging date format with the year: "ERROR 2026-05-14 05:25:28.876 [core.py:1123] "
_YEAR_HEADER = re.compile(rf"^((?:{_LEVELS})) \d{{4}}-(\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?) (\[[^\]\s]+:\d+\])")
# a log format without the date: "ERROR [multiproc_executor.py:962] " (given a placeholder date, so the
# header is recognised as one; nothing reads the time of a normalised line)
_DATELESS = re.compile(rf"^((?:{_LEVELS})) (\[[^\]\s]+:\d+\])(?= |$)")
_FRAME_NO_LINE = re.compile(r'^(\s*)File "([^"]+)", in (\S.*)$')
# a Python traceback's frame; faulthandler's dump of a dying process ('File "x", line 5 in f', no comma,
# most recent call first) is not a traceback and opens none
_FRAME = re.compile(r'^\s*File "[^"]+", line \d+(?:,|\s*$)')
_CARET = re.compile(r"^\s*[\^~]+\s*$")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w]*\.)*(?P<name>[A-Za-z_]\w*)(?::(?: .*)?)?$")
_CHAIN = ("The above exception was the direct cause of the following exception:",
          "During handling of the above exception, another exception occurred:")


def normalise(raw: str) -> str:
    """One line without the decorations a paste adds, and with vLLM's older header forms made the
    current one (so kvrepro.classify.lines takes them apart). Line ending dropped."""
    line = raw.rstrip("\r\n")
    if line.lstrip().startswith(">"):
        line = _QUOTE.sub("", line, count=1)
    if "#033[" in line:
        line = _ESCAPED_ANSI.sub("", line)
    if (m := _BRACKET_TS.match(line)) is not None:
        line = line[m.end():]
    if (m := _SYSLOG.match(line)) is not None:
        line = line[m.end():]
    if line[:1] and line[:1] in "[0123456789" and (m := _RANK.match(line)) is not None:
        line = line[m.end():]
    stripped = line.lstrip()
    if stripped is not line and (stripped.startswith("(") or _HEADER_START.match(stripped)):
        line = stripped  # a log line indented by its markdown list: the prefix must come first
    if "pid=" in line:
        m = _PROC_ANY.search(line)
        if m is not None and m.start() > 0 and _HEADER_START.match(line, m.end()):
            line = line[m.start():]  # a progress bar printed the line's start: keep the log line
            m = _PROC_ANY.match(line)
        if m is not None and m.start() == 0:
            name = m["name"].replace(" rank=", "_rank")
            line = f"({name} pid={m['pid']}) " + _header(line[m.end():])
            return _frame(line)
    return _frame(_header(line))


def _header(rest: str) -> str:
    if rest[:1] in "DIWEC":
        if (m := _BRACKETLESS.match(rest)) is not None:
            return f"{m[1]} [{m[2]}{rest[m.end():]}"
        if (m := _YEAR_HEADER.match(rest)) is not None:
            return f"{m[1]} {m[2]} {m[3]}{rest[m.end():]}"
        if (m := _DATELESS.match(rest)) is not None:
            return f"{m[1]} 01-01 00:00:00 {m[2]}{rest[m.end():]}"
    return rest


def _frame(line: str) -> str:
    if ", in " in line and '", line ' not in line and 'File "' in line:
        head, _, body = _split_prefix(line)
        if (m := _FRAME_NO_LINE.match(body)) is not None:
            return f'{head}{m[1]}File "{m[2]}", line 0, in {m[3]}'  # "File ".../x.py", in f": a frame, line unknown
    return line


def _split_prefix(line: str) -> tuple[str, str, str]:
    """(prefix, header, body) as text, so the body can be rewritten and the line put back."""
    parts = split_line(0, line)
    prefix_len = len(line) - len(parts.body)
    return line[:prefix_len], parts.header or "", parts.body


def _looks_like_exception(body: str) -> bool:
    m = _EXCEPTION.match(body)
    if m is None:
        return False
    name = m["name"]
    return name[:1].isupper() and not name.isupper() and (
        name.endswith(("Error", "Exception", "Exit", "Interrupt", "Warning", "Failure", "Fault"))
        or ":" in body or "." in body.split(":", 1)[0])


def repair(numbered: Iterable[tuple[int, str]]) -> list[tuple[int, str | None]]:
    """(line number, repaired text) for each numbered line of a pasted text: None for a line that is
    not part of the log (a code fence); an inserted ``Traceback (most recent call last):`` carries
    the number of the frame it opens."""
    out: list[tuple[int, str | None]] = []
    block: list[tuple[int, str]] = []
    in_fence = False

    def flush() -> None:
        indent = min((len(t) - len(t.lstrip()) for _, t in block if t.strip()), default=0)
        for number, text in block:
            out.append((number, text[indent:] if text[:indent].isspace() or not text[:indent] else text))
        block.clear()

    for number, raw in numbered:
        line = normalise(raw)
        if _FENCE.match(line):
            flush()
            in_fence = not in_fence
            out.append((number, None))
            continue
        if in_fence:
            block.append((number, line))
        else:
            out.append((number, line))
    flush()
    return _mend_tracebacks(out)


def _mend_tracebacks(lines: list[tuple[int, str | None]]) -> list[tuple[int, str | None]]:
    """Per process (a line's stream): open a traceback where frames start without its first line;
    give a traceback's lines the logger header its first lines had; indent a source line the
    paste flattened (it follows a frame and is neither a frame nor an exception)."""
    out: list[tuple[int, str | None]] = []
    state: dict[str, str] = {}  # stream -> "frame" (last was a frame), "open", "exc", "chain"
    header_of: dict[str, str | None] = {}
    last_open: str | None = None  # the stream whose traceback the last traceback line extended
    for number, text in lines:
        if text is None:
            out.append((number, None))
            continue
        parts = split_line(number, text)
        stream, body = parts.stream, parts.body
        if (state.get(stream) not in _OPEN and last_open is not None and last_open != stream
                and "" in (stream, last_open) and state.get(last_open) in _OPEN and _continues(body, state[last_open])):
            stream = last_open  # a quoted traceback whose lines lost (or kept) the process prefix: one traceback
        current = state.get(stream)
        prefix = f"({stream}) " if stream else ""

        def emit(new_body: str, header: str | None = parts.header) -> None:
            out.append((number, prefix + (f"{header} " if header else "") + new_body))

        # a line logged with another header is another record of the process, never part of this traceback
        ours = current is None or parts.header is None or parts.header == header_of.get(stream)
        if body.startswith(TRACEBACK_START):
            state[stream], header_of[stream] = "open", parts.header
            out.append((number, text))
        elif not ours and current in ("open", "frame", "exc"):
            state.pop(stream, None)
            out.append((number, text))
            continue
        elif _FRAME.match(body):
            if current not in ("open", "frame"):
                if current != "chain":
                    header_of[stream] = parts.header
                emit(TRACEBACK_START, header_of.get(stream))
            state[stream] = "frame"
            emit(body, header_of.get(stream))
        elif current in ("open", "frame") and body.strip() and (body[:1].isspace() or _CARET.match(body)):
            state[stream] = "open"
            emit(body, header_of.get(stream))
        elif current == "frame" and body.strip() and not _looks_like_exception(body.strip()):
            state[stream] = "open"
            emit("    " + body.strip(), header_of.get(stream))  # a source line that lost its indentation
        elif current in ("open", "frame") and _looks_like_exception(body):
            state[stream] = "exc"
            emit(body, header_of.get(stream))
        elif current in ("exc", "chain") and body.strip() in _CHAIN:
            state[stream] = "chain"
            emit(body, header_of.get(stream))
        elif current in ("open", "frame", "exc") and not body.strip():
            out.append((number, text))
        else:
            if current is not None:
                state.pop(stream, None)
            out.append((number, text))
            continue
        last_open = stream
    return out


_OPEN = ("open", "frame")


def _continues(body: str, state: str) -> bool:
    """Whether a line can be the next line of a traceback in ``state`` (another process's prefix
    or none)."""
    if _FRAME.match(body):
        return True
    if not body.strip():
        return False
    return body[:1].isspace() or bool(_CARET.match(body)) or _looks_like_exception(body) or (
        state == "frame" and not body.startswith(TRACEBACK_START))
