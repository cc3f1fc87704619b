"""When each repetition first failed, and how: its first wrong KV read or its crash, whichever came first.

A run that read wrong KV is a failure from that read on, even if it served every request after it
(the shadow KV names the first request each violation class was seen in, RunResult
``kv_first_request_by_class``); a run that crashed failed at the request that died with the engine
(``load.first_failed_index``). The report's pictures and tables take both from here, so a build
that serves wrong KV from request 2 (B, D on 0.26.0) is drawn failing at request 2, not as a run
that survived its load, and a build that reads wrong KV and then crashes (A) shows both.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..classify.corruption import match_class
from ..records import RunResult, Verdict

CRASH = "crash"
WRONG_KV = "wrong KV read"
# runs that say nothing about how long the engine lives under load (left out of the pictures)
NOT_TIMED = (Verdict.INFRA, Verdict.INTERRUPTED, Verdict.INCOMPLETE, Verdict.DAMAGED)


@dataclass(frozen=True)
class FirstFailure:
    """One timed repetition: ``kind`` None when it neither crashed nor read wrong KV (censored at ``ended``)."""

    kind: str | None
    request: int | None  # 1-based request of the first failure (None: no failure)
    ended: int  # requests the run sent
    exact: bool = True  # False: the shadow KV named no request for the wrong read; ``request`` is the run's end
    crash_request: int | None = None  # the request that died with the engine, when the run crashed
    defect: str | None = None  # the corruption defect of the first wrong read

    @property
    def failed(self) -> bool:
        return self.kind is not None

    @property
    def at(self) -> float:
        """Where the run leaves the curve: its first failure, else where it ended (censored)."""
        return float(self.request if self.request is not None else self.ended)

    def text(self) -> str:
        """`wrong KV read at request 2 (fa-hole-below-mamba-hit); crash at 8`, `crash at request 8`, `none in 187`."""
        if self.kind is None:
            return f"none in {self.ended} requests"
        at = f"request {self.request}" if self.exact else f"request <= {self.request}"
        out = f"{self.kind} at {at}" + (f" ({self.defect})" if self.defect else "")
        if self.kind == WRONG_KV and self.crash_request is not None:
            out += f"; crash at {self.crash_request}"
        return out


def _crash_request(run: RunResult) -> int:
    index = run.load.first_failed_index if run.load is not None else None
    return index + 1 if index is not None else max(run.requests, 1)


def _first_wrong_read(run: RunResult) -> tuple[int | None, str | None]:
    """(request, defect) of the earliest described wrong read; (None, None) when none named a request."""
    if not run.kv_first_request_by_class:
        return None, None
    cls, request = min(run.kv_first_request_by_class.items(), key=lambda kv: (kv[1], kv[0]))
    signature = match_class(cls, run.kv_groups)
    return request, signature.name if signature is not None else "unknown"


def first_failure(run: RunResult) -> FirstFailure | None:
    """The run's first failure; None for a run that says nothing about it (INFRA, interrupted, ...)."""
    if run.verdict in NOT_TIMED:
        return None
    ended = max(run.requests, 0)
    crashed = run.verdict is Verdict.CRASH
    crash_at = _crash_request(run) if crashed else None
    if run.kv_violations > 0 or run.verdict is Verdict.CORRUPT:
        request, defect = _first_wrong_read(run)
        exact = request is not None
        request = request if request is not None else (crash_at or max(ended, 1))
        # the shadow KV checks a request's context before its forward; a crash in scheduling comes before
        # that forward, so a wrong read counted at the crashing request itself cannot have come first
        if crash_at is None or request < crash_at:
            return FirstFailure(WRONG_KV, request, ended, exact, crash_at, defect)
    if crashed:
        return FirstFailure(CRASH, crash_at, ended, True, crash_at)
    return FirstFailure(None, None, ended)


def first_failures(runs: list[RunResult] | tuple[RunResult, ...]) -> list[FirstFailure]:
    return [f for f in (first_failure(r) for r in runs) if f is not None]


def summary(failures: list[FirstFailure]) -> str:
    """`3/3 failed: 3 wrong KV read (then 3 crashed)`, `0/3 failed`: a build's legend and table cell."""
    failed = [f for f in failures if f.failed]
    if not failures:
        return "no timed run"
    text = f"{len(failed)}/{len(failures)} failed"
    kinds = [(k, sum(f.kind == k for f in failed)) for k in (WRONG_KV, CRASH)]
    parts = [f"{n} {k}" for k, n in kinds if n]
    if parts:
        text += ": " + ", ".join(parts) + " first"
    later = sum(f.kind == WRONG_KV and f.crash_request is not None for f in failed)
    if later:
        text += f" (then {later} crashed)"
    return text


def build_text(failures: list[FirstFailure]) -> str:
    """A build's first failures by kind, in requests, with the first wrong read's defect:
    `wrong KV read at 2, 2, 2 (fa-hole-below-mamba-hit; crash later at 8, 8, 13)`,
    `crash at 8, 8`, `none (runs ended at 170, 192, 171)`: the report's tables."""
    if not failures:
        return "-"
    parts = []
    for kind in (WRONG_KV, CRASH):
        mine = [f for f in failures if f.kind == kind]
        if mine:
            text = f"{kind} at " + ", ".join(str(f.request) if f.exact else f"<= {f.request}" for f in mine)
            notes = [", ".join(dict.fromkeys(f.defect for f in mine if f.defect))]
            later = [f.crash_request for f in mine if kind == WRONG_KV and f.crash_request is not None]
            if later:
                notes.append("crash later at " + ", ".join(map(str, later)))
            notes = [n for n in notes if n]
            parts.append(text + (f" ({'; '.join(notes)})" if notes else ""))
    clean = [f for f in failures if not f.failed]
    if clean:
        parts.append("none (runs ended at " + ", ".join(str(f.ended) for f in clean) + ")")
    return "; ".join(parts)
