"""Arc coverage of the code under test, in the engine process: which line-to-line transitions of
vLLM's scheduler, KV-cache manager and offloading connector a run executed.

Why: `kvrepro explore` steers its generator toward what a run reached for the first time. The path
counters of the probe and the shadow KV see a handful of chosen places; a bug nobody planted sits
anywhere in these modules, and a condition that was never true leaves no counter behind. An arc
(``from_line>to_line`` inside one function, as coverage.py's branch mode records them) tells which
way every branch of these files went, so "the campaign never reached this branch" and "reached it,
and nothing went wrong" become different observations.

How: ``sys.settrace`` in the engine core's scheduling thread (the runtime's Python is 3.11: no
``sys.monitoring``). The global tracer answers ``None`` for every frame outside the traced files
(one dictionary look-up per call), so only those files pay for line events. New arcs are written
to the engine log, in batches, every :data:`REPORT_INTERVAL_S` and at exit::

    kvrepro-arcs: v1/core/sched/scheduler.py 812>813 813>830 -811>812 830>-811 ...

(a negative number is a function's entry or exit, named by its first line). kvrepro's explore stage
reads these lines from the run's engine.log (kvrepro/explore/coverage.py). Turned on by
``KVREPRO_SIM_ARCS=1`` in the engine's environment (explore sets it); off otherwise.

Runs in the engine process; stdlib only, no vLLM import.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

TAG = "kvrepro-arcs:"
ENV = "KVREPRO_SIM_ARCS"
ALWAYS_ENV = "KVREPRO_SIM_ARCS_ALWAYS"
INSTRUMENT = "instrument"
REPORT_INTERVAL_S = 1.0
QUIET_CALLS = 32  # a function's calls in a row that added no arc before it is only sampled
SAMPLE_EVERY = 16  # then every this many calls is traced
_SHIFT = 1 << 20  # an arc (a, b) is stored as a * _SHIFT + b (line numbers stay far below)
# the code under test, as paths below the `vllm/` package folder (a folder ends with "/")
TRACED = (
    "v1/core/sched/scheduler.py",
    "v1/core/kv_cache_manager.py",
    "v1/core/kv_cache_coordinator.py",
    "v1/core/single_type_kv_cache_manager.py",
    "distributed/kv_transfer/kv_connector/v1/offloading/",
)
_PACKAGE = "/vllm/"


def traced_name(filename: str) -> str | None:
    """The short name of ``filename`` when it is code under test (``v1/core/kv_cache_manager.py``)."""
    at = filename.rfind(_PACKAGE)
    if at < 0:
        return None
    rest = filename[at + len(_PACKAGE):]
    for prefix in TRACED:
        if rest == prefix or (prefix.endswith("/") and rest.startswith(prefix) and rest.endswith(".py")):
            return rest
    return None


class ArcRecorder:
    """Records arcs of the traced files from the thread that installs it; reports new ones.

    Cost control (measured: benchmarks/arcs_overhead.py): a function whose last
    :data:`QUIET_CALLS` traced calls added no arc is traced on every :data:`SAMPLE_EVERY`-th call
    only; a function that holds one of ``always`` (the lines a campaign's patches change) is
    traced on every call. So a rare arc of a hot function can be missed in a run; one of the
    patched functions cannot."""

    def __init__(self, stream=None, always: dict[str, list[tuple[int, int]]] | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.always = always or {}
        self._names: dict[str, str | None] = {}
        self._codes: dict[int, list] = {}  # id(code) -> [name, arcs as ints, quiet calls, calls, always, code]
        self._new: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def _state(self, code, name: str) -> list:
        lines = [line for _, _, line in code.co_lines() if line is not None] or [code.co_firstlineno]
        lo, hi = min(lines + [code.co_firstlineno]), max(lines)
        always = any(a <= hi and lo <= b for a, b in self.always.get(name, ()))
        # keyed by id: hashing a code object hashes its bytecode; the state keeps the code alive,
        # so its id is not reused
        state = self._codes[id(code)] = [name, set(), 0, 0, always, code]
        return state

    def _global(self, frame, event, arg):
        code = frame.f_code
        filename = code.co_filename  # a str: its hash is cached, unlike a code object's
        try:
            name = self._names[filename]
        except KeyError:
            name = self._names[filename] = traced_name(filename)
        if name is None:
            return None
        state = self._codes.get(id(code))
        if state is None:
            state = self._state(code, name)
        if state[2] >= QUIET_CALLS and not state[4]:
            state[3] += 1
            if state[3] % SAMPLE_EVERY:
                return None
        name, seen, add = state[0], state[1], self._add
        entry = -code.co_firstlineno
        last = entry
        grew = False

        def local(frame, event, arg):
            nonlocal last, grew
            if event == "line":
                line = frame.f_lineno
                key = last * _SHIFT + line
                if key not in seen:
                    add(seen, key, name, last, line)
                    grew = True
                last = line
            elif event == "return":
                key = last * _SHIFT + entry
                if key not in seen:
                    add(seen, key, name, last, entry)
                    grew = True
                state[2] = 0 if grew else state[2] + 1
            return local

        return local

    def _add(self, seen: set, key: int, name: str, a: int, b: int) -> None:
        with self._lock:
            if key not in seen:
                seen.add(key)
                self._new.append((name, a, b))

    def flush(self) -> None:
        with self._lock:
            batch, self._new = self._new, []
        if not batch:
            return
        by_file: dict[str, list[str]] = {}
        for name, a, b in batch:
            by_file.setdefault(name, []).append(f"{a}>{b}")
        try:
            for name, arcs in by_file.items():
                self.stream.write(f"{TAG} {name} {' '.join(arcs)}\n")
            self.stream.flush()
        except (OSError, ValueError):  # the log is gone (engine shutting down): nothing to keep
            pass

    def _reporter(self) -> None:
        while not self._stop.wait(REPORT_INTERVAL_S):
            self.flush()

    def install(self) -> None:
        """Trace the calling thread from now on (the engine core's scheduling loop runs in it)."""
        sys.settrace(self._global)
        threading.Thread(target=self._reporter, name="kvrepro-arcs-reporter", daemon=True).start()
        atexit.register(self.flush)

    def arcs(self) -> set[tuple[str, int, int]]:
        with self._lock:
            return {(state[0], *divmod_arc(key)) for state in self._codes.values() for key in state[1]}


def divmod_arc(key: int) -> tuple[int, int]:
    """An arc stored as ``a * _SHIFT + b`` back as (a, b); either may be negative (entry, exit)."""
    a, b = divmod(key, _SHIFT)
    if b > _SHIFT // 2:  # b was negative: divmod borrowed one from a
        a, b = a + 1, b - _SHIFT
    return a, b


def always_from_env(text: str) -> dict[str, list[tuple[int, int]]]:
    """``KVREPRO_SIM_ARCS_ALWAYS``: ``file:lo-hi,lo-hi;file:lo-hi`` (the lines a campaign's patches change)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for part in text.split(";"):
        name, _, ranges = part.strip().rpartition(":")
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if name and lo.strip().isdigit() and hi.strip().isdigit():
                out.setdefault(name, []).append((int(lo), int(hi)))
    return out


def always_to_env(ranges: dict[str, list[tuple[int, int]]]) -> str:
    return ";".join(f"{name}:" + ",".join(f"{lo}-{hi}" for lo, hi in spans) for name, spans in sorted(ranges.items()))


def enabled(environ=None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENV, "").strip() in ("1", "true", "yes", "on", INSTRUMENT)


def instrumented(environ=None) -> bool:
    """``KVREPRO_SIM_ARCS=instrument``: branch probes compiled into the code (kvrepro/engine/branches.py)."""
    env = os.environ if environ is None else environ
    return env.get(ENV, "").strip() == INSTRUMENT


def parse_line(line: str) -> list[tuple[str, int, int]]:
    """The arcs of one ``kvrepro-arcs:`` log line (anything else: none)."""
    at = line.find(TAG)
    if at < 0:
        return []
    parts = line[at + len(TAG):].split()
    if len(parts) < 2:
        return []
    out = []
    for arc in parts[1:]:
        a, sep, b = arc.partition(">")
        try:
            out.append((parts[0], int(a), int(b)))
        except ValueError:
            continue  # a line cut short by the engine's death
    return out
