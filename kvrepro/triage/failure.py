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
from copy import deepcopy
from dataclasses import dataclass, replace

from ..classify.lines import split_line
from ..classify.patterns import Pattern, known_patterns
from ..classify.tracebacks import FAILED_START_MARKER, FATAL_MARKER, Segment, Traceback, TracebackScanner
from ..records import Signature
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
        """The log's last line: its timestamp ends every stall still going (a line without one
        leaves the last time as it was)."""
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


# -- a crash as a pasted text shows it -----------------------------------------------------------
# Whether a traceback is the engine running or starting is read from its own frames: a runtime
# failure is never "the engine did not start" because the text lacks the server's start-up line.
RUNTIME_FUNCTIONS = frozenset({
    "run_busy_loop", "_process_engine_step", "step", "step_with_batch_queue", "schedule", "update_from_output",
    "execute_model", "sample_tokens", "execute_model_with_error_logging", "worker_busy_loop", "output_handler",
    "process_outputs", "get_output_async", "_update_from_kv_xfer_finished", "build_connector_meta",
    "update_state_after_alloc", "_build_store_jobs", "allocate_slots", "engine_step", "step_async",
    "run_engine_loop", "_run_engine", "_schedule", "_schedule_default", "_schedule_running",
    "_create_grammar", "compile_grammar", "_check_grammar_completion", "add_request", "add_lora",
})
STARTUP_FUNCTIONS = frozenset({
    "_initialize_kv_caches", "determine_available_memory", "profile_run", "_dummy_sampler_run", "_dummy_run",
    "load_model", "init_device", "initialize_from_config", "capture_model", "compile_or_warm_up_model",
    "init_worker_distributed_environment", "init_distributed_environment", "initialize_model_parallel",
    "ensure_model_parallel_initialized", "init_model_parallel_group", "_init_executor", "_init_workers_ray",
    "determine_num_available_blocks", "get_kv_cache_groups", "unify_kv_cache_spec_page_size", "make_layers",
})
DEATH_REPORTS = frozenset({"EngineDeadError", "MQEngineDeadError", "AsyncEngineDeadError"})
_NOISE = frozenset({"KeyboardInterrupt", "SystemExit", "CancelledError", "GeneratorExit"})


def phase(tb: Traceback) -> str:
    """``runtime``, ``startup`` or ``unknown``, from the traceback's frames and the engine's marker."""
    functions = [f.function.rsplit(".", 1)[-1] for seg in tb.segments for f in seg.frames]
    if any(f in RUNTIME_FUNCTIONS for f in functions):
        return "runtime"
    if any(f in STARTUP_FUNCTIONS for f in functions) or tb.marker == FAILED_START_MARKER or any(
            f.function == "run_engine_core" and any("EngineCoreProc(" in s for s in f.source)
            for seg in tb.segments for f in seg.frames):
        return "startup"
    if tb.marker == FATAL_MARKER:
        return "runtime"
    return "unknown"


def pick_traceback(tracebacks: list[Traceback]) -> Traceback | None:
    """The traceback a pasted text is about when the engine's own markers are not in it: the first
    complete one that is neither a report of the engine's death elsewhere nor shutdown noise,
    those with a vLLM frame first; else the last one cut off (the paste ended inside it)."""
    def is_cause(tb: Traceback) -> bool:
        names = {seg.short_exception for seg in tb.segments if seg.short_exception}
        return not (names & DEATH_REPORTS) and tb.final.short_exception not in _NOISE

    complete = [tb for tb in tracebacks if tb.complete and is_cause(tb)]
    with_vllm = [tb for tb in complete if _has_vllm_frame(tb.root())]
    if with_vllm or complete:
        return (with_vllm or complete)[0]
    cut = [tb for tb in tracebacks if not tb.complete and tb.segments[-1].frames]
    return cut[-1] if cut else None


def _has_vllm_frame(segment: Segment) -> bool:
    return any("/vllm/" in f.path or f.path.startswith("vllm/") for f in segment.frames)


def infer_assert(tb: Traceback) -> Traceback | None:
    """A traceback cut off right after its innermost frame, when that frame shows an ``assert``:
    the exception was an AssertionError raised there. A completed copy, else None."""
    seg = tb.segments[-1]
    if seg.complete or not seg.frames:
        return None
    shown = " ".join(s.strip() for s in seg.frames[-1].source)
    if not shown.startswith("assert ") and shown != "assert":
        return None
    copy = deepcopy(tb)
    copy.segments[-1].exception = "AssertionError"
    return copy


def assert_test(expression: str) -> str:
    """The test of ``assert test, message`` as a traceback shows it (maybe cut, maybe annotated
    with a comment or kvrepro's '... (statement cut; ...)'): ``test``."""
    text = expression.split(" ... (statement cut;", 1)[0].strip()
    text = _strip_comment(text)
    if text.startswith("assert"):
        text = text[len("assert"):].strip()
    depth, quote = 0, ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            return text[:i].strip()
    return text.rstrip("(").strip()


def _strip_comment(text: str) -> str:
    quote = ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return text[:i].rstrip()
    return text


def match_partial(sig: Signature, message: str | None,
                  need_statement: bool = False) -> tuple[Pattern | None, tuple[str, ...], str]:
    """The known crash signature partial evidence fits: (pattern or None, the patterns it fits
    equally when more than one, what agreed).

    Each piece the text gives (the function, the file, the failing statement, the message) must
    agree with the pattern, and together they must say enough: two of function, file and
    statement, or a message the pattern's own regex recognises. A piece that disagrees rules the
    pattern out: another assertion in the same function is not that pattern's crash."""
    scored: list[tuple[int, Pattern, str]] = []
    expression = assert_test(sig.expression) if sig.expression else ""
    for pattern in known_patterns():
        if sig.exception and sig.exception != pattern.exception:
            continue
        said: list[str] = []
        points = 0
        if sig.function:
            if sig.function.rsplit(".", 1)[-1] != pattern.function:
                continue
            said.append("function")
            points += 1
        if sig.file:
            tail = sig.file.lstrip("./")
            if not (pattern.file.endswith(tail) or tail.endswith(pattern.file)):
                continue
            said.append("file")
            points += 1
        probe_pattern = pattern
        if message is None and pattern.message is not None:
            probe_pattern = replace(pattern, message=None)  # the text holds no message to test
        probe = Signature(exception=pattern.exception, function=pattern.function, file=pattern.file,
                          line=sig.line, expression=expression or (pattern.expressions[0] if pattern.expressions else ""))
        how = probe_pattern.match(probe, message or "")
        if how is None:
            continue
        if expression and how in ("full", "fragment"):
            said.append("statement")
            points += 2 if how == "full" else 1
        if message is not None and pattern.message is not None:
            said.append("message")
            points += 2
        if points >= 2 and (not need_statement or "statement" in said):
            scored.append((points, pattern, " + ".join(said)))
    if not scored:
        return None, (), ""
    best = max(p for p, _, _ in scored)
    top = [(pat, said) for p, pat, said in scored if p == best]
    if len(top) > 1:
        return None, tuple(sorted(p.name for p, _ in top)), ""
    return top[0][0], (), top[0][1]


_PATH = re.compile(r"(?:[\w.-]+/)*[\w.-]+\.py\b")
_IN_FUNC = re.compile(r"\.py\"?,?(?: line \d+,)? in (?P<f>[A-Za-z_]\w*)")
_ASSERT = re.compile(r"(?:^|[\s:])(?P<a>assert\s+\S)")
_BARE_CALL = re.compile(r"^\s*(?P<f>[A-Za-z_]\w*)\((?:\.\.\.)?\)\s*$")
_EXC_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*(?P<name>[A-Z]\w*(?:Error|Exception|Exit|Failure))(?::\s*(?P<msg>.*))?$")
LOOSE_BEFORE, LOOSE_AFTER = 12, 8
LOOSE_LINE = 2000  # what of a line the pieces are looked for in (a path, a function, a statement)


# a process that died below Python: faulthandler's "Fatal Python error: Segmentation fault", a C++
# exception nobody caught ("terminate called after throwing an instance of 'c10::Error'", then
# "  what():  CUDA error: ...")
_FATAL = re.compile(r"^Fatal Python error: (?P<msg>.+)$")
_TERMINATE = re.compile(r"^terminate called after throwing an instance of '(?P<name>[^']+)'")
_WHAT = re.compile(r"^what\(\):\s+(?P<msg>.+)$")


def _native_crash(bodies: list[tuple[int, str]]) -> tuple[int, str, str | None] | None:
    for idx, (_, body) in enumerate(bodies):
        text = body.strip()[:LOOSE_LINE]
        if (m := _FATAL.match(text)) is not None:
            return idx, "Fatal Python error", m["msg"]
        if (m := _TERMINATE.match(text)) is not None:
            what = next((w["msg"] for _, b in bodies[idx + 1: idx + 4]
                         if (w := _WHAT.match(b.strip()[:LOOSE_LINE])) is not None), None)
            return idx, m["name"], what
    return None


@dataclass(frozen=True)
class Loose:
    """A failure a text shows without a traceback: the pieces found around its exception line (or
    its ``assert``), and the line they centre on."""

    signature: Signature
    message: str | None
    line: int
    exception_line: str
    inferred: bool  # the exception was inferred from an assert statement


def loose_evidence(bodies: list[tuple[int, str]]) -> Loose | None:
    """The exception line a text shows outside any traceback (a report's quoted error, the
    exception line alone), or an ``assert`` statement with no exception line, and the vLLM file,
    function and statement quoted around it."""
    anchor = None
    for idx, (_, body) in enumerate(bodies):
        m = _EXC_LINE.match(body.strip()[:LOOSE_LINE])
        if m is not None and m["name"] not in DEATH_REPORTS:
            anchor = (idx, m["name"], m["msg"])
    inferred = False
    if anchor is None:
        for idx, (_, body) in enumerate(bodies):
            if body.strip().startswith("assert "):
                anchor, inferred = (idx, "AssertionError", None), True
                break
    if anchor is None:
        anchor = _native_crash(bodies)  # no Python exception: a process that died in native code
    if anchor is None:
        return None
    idx, exception, message = anchor
    window = bodies[max(0, idx - LOOSE_BEFORE): idx + LOOSE_AFTER + 1]
    file = function = expression = ""
    for _, body in window:
        text = body.strip()[:LOOSE_LINE]
        for path in (_PATH.findall(text) if ".py" in text else ()):
            if "vllm/" in path or not file:
                file = path[path.rfind("vllm/"):] if "vllm/" in path else path
        if (m := _IN_FUNC.search(text)) is not None or (m := _BARE_CALL.match(text)) is not None:
            function = m["f"]
        if not expression and (m := _ASSERT.search(text)) is not None:
            expression = _strip_comment(text[m.start("a"):])  # "FAILED:  assert x" quotes the statement too
    if not expression and not message:
        # "AssertionError:" followed by the statement's lines, indented (a hand-made signature)
        follow = []
        for _, body in bodies[idx + 1: idx + LOOSE_AFTER + 1]:
            if not body[:1].isspace() or not body.strip():
                break
            follow.append(body.strip())
        expression = " ".join(follow)
    if file and not file.endswith(".py"):
        file = ""
    sig = Signature(exception=exception, function=function, file=file, line=None, expression=expression)
    number, body = bodies[idx]
    return Loose(sig, message if message else None, number, body.strip(), inferred)
