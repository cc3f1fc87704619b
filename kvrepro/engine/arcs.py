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
REPORT_INTERVAL_S = 1.0
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
    """Records arcs of the traced files from the thread that installs it; reports new ones."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self._names: dict[str, str | None] = {}
        self._seen: set[tuple[str, int, int]] = set()
        self._new: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def _global(self, frame, event, arg):
        code = frame.f_code
        filename = code.co_filename
        try:
            name = self._names[filename]
        except KeyError:
            name = self._names[filename] = traced_name(filename)
        if name is None:
            return None
        entry = -code.co_firstlineno
        last = entry
        seen, add = self._seen, self._add

        def local(frame, event, arg):
            nonlocal last
            if event == "line":
                line = frame.f_lineno
                if (name, last, line) not in seen:
                    add((name, last, line))
                last = line
            elif event == "return":
                if (name, last, entry) not in seen:
                    add((name, last, entry))
            return local

        return local

    def _add(self, arc: tuple[str, int, int]) -> None:
        with self._lock:
            if arc not in self._seen:
                self._seen.add(arc)
                self._new.append(arc)

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
            return set(self._seen)


def enabled(environ=None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENV, "").strip() in ("1", "true", "yes", "on")


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
