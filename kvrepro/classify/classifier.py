"""From an engine log to a Classification: which traceback killed the engine, and what it is.

Choosing the fatal traceback, in order of trust:

1. the one the engine announced with ``EngineCore encountered a fatal error.`` (vLLM's
   ``run_engine_core`` logs it with the exception right before the process dies; kvrepro's
   GPU-free engine logs the same line). The engine was running: a crash, never infra (unless the
   exception is an import error, which is always the environment's fault);
2. the one announced with ``EngineCore failed to start.``: infra;
3. the first traceback printed raw (not through the logger): an exception nobody caught, so it
   ended a process or a thread. Tracebacks that only report the engine's death elsewhere
   (``EngineDeadError``) are consequences, not causes, and are skipped; those of shutting down
   (``KeyboardInterrupt``, ``CancelledError``, ...) are ignored altogether;
4. a traceback logged at ERROR by some other code, but only when the log also shows that the
   engine died (a consequence was seen): the best guess at the cause;
5. only consequences: a crash whose cause is not in the log.

Tracebacks of 3-5 that start after the server began an orderly stop (vLLM's ``[shutdown]`` steps,
uvicorn's ``Shutting down``) are ignored: a healthy server stopped with SIGTERM logs an
``EngineDeadError``, and now and then a teardown race (psutil's ``ZombieProcess``); neither is a
crash of the code under test, which had stopped serving by then.

Any of 3-5 that happens before the server logged ``Application startup complete.`` (uvicorn's
line, which vLLM's API server and kvrepro's engine both print once serving) means the engine never
got going: infra. A log whose start was cut off (``docker logs --tail``, a rotated file) may lack
that line: a request answered with 200, or vLLM's throughput line, proves the engine was up just
as well, and an engine that served and then died with no cause in the log is a crash of unknown
cause, never "did not start". So do argparse errors (``vllm serve: error: ...``) before that point, and,
when the server never came up at all, an ERROR logged without a traceback.

Before any of this: a known infrastructure root cause (``kvrepro/classify/infra/``: an NCCL
collective timeout, an NCCL error, a GPU hardware error) logged before the traceback that ended
the run, or inside it, makes the run infra, titled with that line. One logged after the engine
had died of something else is a consequence, and the crash keeps its verdict.

Titles never carry environment values: they are built from code (the statement) and, where the
code says nothing (import errors, argument errors), from the exception message with anything
that looks like a credential masked.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable
from pathlib import Path

from .records import Classification
from ..records import Outcome, Signature
from ..spec.matrix import TargetSignature
from .infra import InfraCause, infra_keywords, match_infra
from .lines import split_line
from .patterns import Pattern, match_pattern
from .source import canonical, is_cut, shown_expression, statement_at
from .tracebacks import FAILED_START_MARKER, FATAL_MARKER, TRACEBACK_START, Frame, Traceback, TracebackScanner

STARTUP_COMPLETE = "Application startup complete."
# an orderly stop has begun (SIGTERM, Ctrl-C): vLLM >= 0.27 tags its shutdown steps, uvicorn says
# so; the EngineDeadError a stopping API server then logs reports the stop, not a crash
SHUTDOWN_MARKERS = ("[shutdown] ", "Shutting down")
# exceptions that report the engine's death (raised in the API server once EngineCore is gone)
DEATH_REPORTS = frozenset({"EngineDeadError"})
# what shutting down prints (SIGINT/SIGTERM, cancelled asyncio tasks): neither cause nor death
SHUTDOWN_NOISE = frozenset({"KeyboardInterrupt", "SystemExit", "CancelledError", "GeneratorExit"})
IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError"})
_SYNTAX_ERRORS = frozenset({"SyntaxError", "IndentationError", "TabError"})
_ARG_ERROR = re.compile(r"(?:vllm|[\w.-]+(?: serve)?): error: (?P<msg>.+)$")
# the engine was serving: an answered request (uvicorn's access log) or vLLM's periodic stats
_SERVED = re.compile(r'"(?:POST|GET) /v1/[^"]*" 200\b|Avg prompt throughput:')
# the engine died, said without a traceback
_DIED = re.compile(r"EngineDeadError|Engine ?core\b.*\bdied|died unexpectedly|EngineCore encountered an issue")
# a raw line must contain one of these to matter while no traceback is being read; checking
# substrings first keeps a 100 MB log of request lines cheap
_KEYWORDS = (TRACEBACK_START[:15], FATAL_MARKER[:21], FAILED_START_MARKER[:18], STARTUP_COMPLETE, ": error: ",
             "ERROR ", "CRITICAL ", *SHUTDOWN_MARKERS, '" 200', "throughput:", "died", "EngineDead",
             "EngineCore encountered")
_TITLE_MAX = 240
TRACEBACKS_KEPT = 256  # tracebacks a parsed log lists (ParsedLog.tracebacks); the last is always kept
_SECRET = re.compile(
    r"(?i)(hf_[A-Za-z0-9]{6,}|ghp_[A-Za-z0-9]{6,}|sk-[A-Za-z0-9_-]{6,}"
    r"|-----BEGIN [A-Z ]+-----.*"
    r"|(?:token|secret|password|passwd|api[_-]?key|authorization)\s*[=:]\s*\S+)"
)


class _Evidence:
    """The few tracebacks and facts the decision needs, collected in one pass."""

    def __init__(self) -> None:
        self.fatal: Traceback | None = None
        self.failed_start: Traceback | None = None
        self.followup: dict[int, Traceback] = {}  # id(marked incomplete tb) -> complete copy
        self.raw: Traceback | None = None
        self.logged_error: Traceback | None = None
        self.consequence: Traceback | None = None
        self.startup_line: int | None = None
        self.shutdown_line: int | None = None  # where an orderly stop began
        self.arg_error: tuple[int, str] | None = None
        self.last_error_line: str | None = None  # last ERROR/CRITICAL record before startup
        self.death_line: str | None = None  # first line saying the engine died (no traceback needed)
        self.infra: tuple[int, InfraCause, str] | None = None  # first infrastructure root-cause line

    def add(self, tb: Traceback) -> None:
        if tb.marker == FATAL_MARKER:
            self.fatal = self.fatal or tb
            return
        if tb.marker == FAILED_START_MARKER:
            self.failed_start = self.failed_start or tb
            return
        for marked in (self.fatal, self.failed_start):
            # the engine's process also prints the same exception raw when it dies; that copy
            # stands in when the logged one was cut off
            if (marked is not None and not marked.complete and tb.complete
                    and tb.stream == marked.stream and id(marked) not in self.followup):
                self.followup[id(marked)] = tb
                return
        if self.shutdown_line is not None and tb.first_line > self.shutdown_line:
            # the server was being stopped (by kvrepro, after the load): what it prints while
            # tearing down (an EngineDeadError, psutil's ZombieProcess ...) is not a crash
            return
        if _reports_death(tb):
            self.consequence = self.consequence or tb
        elif tb.final.short_exception in SHUTDOWN_NOISE:
            pass
        elif tb.header is None:
            if self.raw is None or (not self.raw.complete and tb.complete):
                self.raw = tb
        elif tb.level in ("ERROR", "CRITICAL") and self.logged_error is None:
            self.logged_error = tb

    def best(self, tb: Traceback) -> Traceback:
        return self.followup.get(id(tb), tb)


# The title of an engine whose `vllm serve` refused its arguments (argparse, exit code 2); the
# fact itself is Classification.refused_arguments (the suite reads a release that lacks an entry's
# engine option, NOT TESTABLE, from the run's field, never from its title).
ARGUMENT_ERROR_TITLE = "argument error: "


def _reports_death(tb: Traceback) -> bool:
    return any(seg.short_exception in DEATH_REPORTS for seg in tb.segments)


class Scan:
    """The classifier's pass over a log, one line at a time (:class:`kvrepro.classify.report.LogParser`
    feeds it beside the other readers, so that the log is read once); :meth:`close` gives the evidence."""

    def __init__(self) -> None:
        self.evidence = _Evidence()
        self.tracebacks: list[Traceback] = []  # every one, in order (the first TRACEBACKS_KEPT, and the last)
        self._scanner = TracebackScanner(self._found)
        self._keywords = _KEYWORDS + infra_keywords()

    def _found(self, tb: Traceback) -> None:
        self.evidence.add(tb)
        if len(self.tracebacks) > TRACEBACKS_KEPT:
            self.tracebacks[-1] = tb  # bounded: a paste that ends inside one is about its last
        else:
            self.tracebacks.append(tb)

    def feed(self, number: int, raw: str) -> None:
        scanner, evidence = self._scanner, self.evidence
        if not scanner.busy and not any(k in raw for k in self._keywords):
            return
        line = split_line(number, raw)
        scanner.feed(line)
        body = line.body
        if evidence.infra is None and evidence.shutdown_line is None and (cause := match_infra(body)) is not None:
            evidence.infra = (number, cause, body)
        if evidence.shutdown_line is None and evidence.startup_line is not None and any(
                m in body for m in SHUTDOWN_MARKERS):
            evidence.shutdown_line = number
        if evidence.death_line is None and evidence.shutdown_line is None and _DIED.search(body):
            evidence.death_line = body.strip()  # after an orderly stop began, "died" is the stop
        if evidence.startup_line is None and (STARTUP_COMPLETE in body or _SERVED.search(body)):
            evidence.startup_line = number
        elif evidence.startup_line is None:
            if line.level in ("ERROR", "CRITICAL") and body.strip() and not scanner.busy:
                evidence.last_error_line = body.strip()
            elif evidence.arg_error is None and line.header is None and (m := _ARG_ERROR.match(body)) is not None:
                evidence.arg_error = (number, m["msg"])

    def close(self) -> _Evidence:
        self._scanner.close()
        return self.evidence


def scan(lines: Iterable[str] | str) -> _Evidence:
    one = Scan()
    raw_iter = io.StringIO(lines, newline="\n") if isinstance(lines, str) else lines
    for number, raw in enumerate(raw_iter, start=1):
        one.feed(number, raw)
    return one.close()


def classify_lines(lines: Iterable[str] | str, source_root: Path | None = None,
                   target: TargetSignature | None = None) -> Classification:
    return classify_with_traceback(lines, source_root, target)[0]


def classify_with_traceback(lines: Iterable[str] | str, source_root: Path | None = None,
                            target: TargetSignature | None = None) -> tuple[Classification, Traceback | None]:
    """:func:`classify_lines` and the traceback it rests on (None when none), in one pass: a caller
    streaming a gigabyte log (``kvrepro triage``) needs both, and cannot read the log twice."""
    return classify_evidence(scan(lines), source_root, target)


def classify_evidence(ev: _Evidence, source_root: Path | None = None,
                      target: TargetSignature | None = None) -> tuple[Classification, Traceback | None]:
    """The classification (and its traceback) from one pass's evidence (:class:`Scan`)."""
    target = target or TargetSignature()
    cls, tb = _decide(ev, source_root, target)
    if ev.infra is not None and (cls.outcome is not Outcome.NONE or ev.death_line is not None):
        number, cause, text = ev.infra
        # an infrastructure line before (or inside) what ended the run is its root cause; one
        # logged after the engine had died of something else is that death's consequence
        if tb is None or number <= tb.last_line:
            return Classification(Outcome.INFRA, _clip(_scrub(cause.render_title(text))), cls.signature), tb
    return cls, tb


def _decide(ev: _Evidence, source_root: Path | None,
            target: TargetSignature) -> tuple[Classification, Traceback | None]:
    """The classification from the tracebacks and facts alone, and the traceback it rests on."""

    def before_startup(tb: Traceback) -> bool:
        return ev.startup_line is None or tb.first_line < ev.startup_line

    if ev.fatal is not None:
        fatal = ev.best(ev.fatal)
        return _crash(fatal, source_root, target, infra=False), fatal
    if ev.failed_start is not None:
        failed = ev.best(ev.failed_start)
        if ev.raw is not None and ev.raw.stream == failed.stream and ev.raw.first_line < failed.first_line:
            # the process printed an uncaught exception (a thread's) before it gave up: the cause
            return _crash(ev.raw, source_root, target, infra=True), ev.raw
        return _crash(failed, source_root, target, infra=True), failed
    if ev.raw is not None:
        return _crash(ev.raw, source_root, target, infra=before_startup(ev.raw)), ev.raw
    if ev.logged_error is not None and ev.consequence is not None:
        return _crash(ev.logged_error, source_root, target, infra=before_startup(ev.logged_error)), ev.logged_error
    if ev.consequence is not None:
        cls = _crash(ev.consequence, source_root, target, infra=before_startup(ev.consequence))
        title = f"{cls.signature.exception if cls.signature else 'crash'}: engine died, root cause not in the log"
        return Classification(cls.outcome, title, cls.signature), ev.consequence
    if ev.arg_error is not None:
        refused = _clip(_scrub(ev.arg_error[1]))
        return Classification(Outcome.INFRA, _clip(f"{ARGUMENT_ERROR_TITLE}{refused}"), None,
                              refused_arguments=refused), None
    if ev.startup_line is not None and ev.death_line is not None:
        return Classification(Outcome.OTHER_CRASH, _clip(
            f"crash of unknown cause: the engine served, then died with no root cause in the log "
            f"({_scrub(ev.death_line)})"), None), None
    if ev.startup_line is None and ev.last_error_line is not None:
        # an error logged without a traceback (the GPU-free engine reports a bad setup this way
        # and exits) and the server never came up
        return Classification(Outcome.INFRA, _clip(f"engine did not start: {_scrub(ev.last_error_line)}"),
                               None), None
    return Classification(Outcome.NONE, "no crash", None), None


def classify_traceback(tb: Traceback, target: TargetSignature | None = None) -> Classification:
    """The crash one traceback shows (signature, known pattern, title; TARGET or OTHER_CRASH), named
    as :func:`classify_lines` names it in a log. For a caller that chose the traceback itself
    (``kvrepro triage`` on pasted text, where the engine's markers may be missing)."""
    return _crash(tb, None, target or TargetSignature(), infra=False)


def _crash(tb: Traceback, source_root: Path | None, target: TargetSignature, infra: bool) -> Classification:
    segment = tb.root()
    frame = _innermost_vllm_frame(segment.frames)
    in_vllm = frame is not None
    if frame is None and segment.frames:
        frame = segment.frames[-1]
    exception = segment.short_exception or ""
    expression = ""
    if frame is not None:
        if in_vllm and source_root is not None:
            expression = statement_at(source_root, _vllm_path(frame.path), frame.line,
                                      frame.source[0] if frame.source else None) or ""
        if not expression and frame.source:
            shown = " ".join(line.strip() for line in frame.source if not _is_caret(line))
            if shown.startswith("assert") and is_cut(shown):
                # Python 3.10 printed only the first line of a wrapped statement (`assert (`) and
                # the build's source was not at hand: say so rather than title the crash `(`
                where = _vllm_path(frame.path) if in_vllm else _display_path(frame.path)
                expression = f"{shown} ... (statement cut; {where}:{frame.line})"
            else:
                expression = shown_expression(frame.source)
    sig = Signature(
        exception=exception,
        function=frame.function if frame else "",
        file=(_vllm_path(frame.path) if in_vllm else _display_path(frame.path)) if frame else "",
        line=frame.line if frame else None,
        expression=expression,
    )
    message = segment.message
    pattern = match_pattern(sig, message) if segment.complete else None
    title = pattern.render_title(sig) if pattern else _generic_title(sig, message, segment.complete)
    if infra or exception in IMPORT_ERRORS:
        outcome = Outcome.INFRA
    elif segment.complete and is_target_crash(sig, target, pattern):
        outcome = Outcome.TARGET
    else:
        outcome = Outcome.OTHER_CRASH
    return Classification(outcome, _clip(title), sig)


def is_target_crash(sig: Signature | None, target: TargetSignature | None = None, pattern: Pattern | None = None, *,
                    statement_known: bool = True) -> bool:
    """THE rule for "is this the target crash": every stage asks here (the classifier, the
    minimizer's offline replays, the emitted test's check, the choice of a repetition to minimize).

    The exception by its short name (``AssertionError`` for ``builtins.AssertionError``), the
    function (a method qualified by its class matches its bare name), the file by its ending
    (``./`` dropped) and, when the target names one, the statement compared in :func:`canonical`
    form (layout, parentheses and renamed identifiers do not matter); a known pattern's full
    statement stands for the one-line fragment a traceback shows. Without a wanted statement, a
    pattern marked ``never_target`` is never the target. ``statement_known`` False: the caller has
    no statement to compare (a pytest traceback's last line), so the statement is not asked.
    """
    if sig is None:
        return False
    target = target or TargetSignature()
    if sig.exception != target.exception.rsplit(".", 1)[-1]:
        return False
    if sig.function != target.function and not sig.function.endswith("." + target.function):
        return False
    if not sig.file or not sig.file.endswith(target.file.removeprefix("./")):
        return False
    wanted = target.expression
    if wanted:
        if not statement_known:
            return True
        # a one-line fragment stands for the whole statement its pattern knows
        full = pattern.expressions[0] if pattern and pattern.expressions else sig.expression
        return canonical(wanted) in canonical(full or "")
    return not (pattern is not None and pattern.never_target)


def _innermost_vllm_frame(frames: list[Frame]) -> Frame | None:
    for frame in reversed(frames):
        if "/vllm/" in frame.path or frame.path.startswith("vllm/"):
            return frame
    return None


def _vllm_path(path: str) -> str:
    """``.../site-packages/vllm/v1/core/x.py`` -> ``vllm/v1/core/x.py`` (last ``vllm/`` wins:
    a checkout at ``/src/vllm/vllm/...`` has the package in the inner one)."""
    path = path.replace("\\", "/")
    i = path.rfind("/vllm/")
    return path[i + 1:] if i >= 0 else path


def _display_path(path: str) -> str:
    """A path outside vLLM, without the machine-specific part (home folders, venvs)."""
    path = path.replace("\\", "/")
    for anchor in ("/kvrepro/", "-packages/"):
        i = path.rfind(anchor)
        if i >= 0:
            return path[i + 1:] if anchor == "/kvrepro/" else path[i + len(anchor):]
    return "/".join(path.split("/")[-2:])


def _generic_title(sig: Signature, message: str, complete: bool) -> str:
    first = _scrub(message.split("\n", 1)[0].strip())
    exc = sig.exception
    where = sig.function or (sig.file.rsplit("/", 1)[-1] if sig.file else "")
    if not complete:
        head = f"crash in {where} (traceback cut off)" if where else "crash (traceback cut off)"
        return f"{head}: {sig.expression}" if sig.expression else head
    if exc in IMPORT_ERRORS or exc in _SYNTAX_ERRORS:
        loc = f" in {sig.file}:{sig.line}" if exc in _SYNTAX_ERRORS and sig.file else ""
        return f"{exc}{loc}: {first}" if first else f"{exc}{loc}"
    head = f"{exc} in {where}" if where else exc
    # `raise ValueError(` says less than the message it raised
    if sig.expression and not (first and sig.expression.startswith("raise ")):
        return f"{head}: {sig.expression}"
    return f"{head}: {first}" if first else head


def _scrub(text: str) -> str:
    return _SECRET.sub("***", text)


def _clip(title: str) -> str:
    title = " ".join(title.split())
    return title if len(title) <= _TITLE_MAX else title[: _TITLE_MAX - 3] + "..."


def fatal_traceback(lines: Iterable[str] | str) -> Traceback | None:
    """The traceback :func:`classify_lines` would reduce to a title, in the same order of trust."""
    ev = scan(lines)
    for tb in (ev.fatal, ev.failed_start):
        if tb is not None:
            return ev.best(tb)
    return ev.raw or ev.logged_error or ev.consequence


def excerpt(tb: Traceback, max_frames: int = 3) -> list[str]:
    """The few lines of a traceback a person needs: the innermost frames of the exception that
    explains it (paths shortened to ``vllm/...``), the code they show, and the exception line."""
    segment = tb.root()
    lines = []
    # the probe's wrapper sits between vLLM's frames in every build: it explains nothing
    frames = [f for f in segment.frames if not f.path.endswith("kvrepro_probe.py")]
    for frame in frames[-max_frames:]:
        path = _vllm_path(frame.path) if "/vllm/" in frame.path or frame.path.startswith("vllm/") \
            else _display_path(frame.path)
        lines.append(f'  File "{path}", line {frame.line}, in {frame.function}')
        lines.extend("    " + src.strip() for src in frame.source if src.strip() and not _is_caret(src))
    if segment.exception:
        head = segment.exception + (f": {segment.message_lines[0]}" if segment.message_lines else "")
        lines.append(_scrub(head))
        lines.extend(_scrub(m) for m in segment.message_lines[1:5])
    return lines


def _is_caret(line: str) -> bool:
    return set(line.strip()) <= set("^~")
