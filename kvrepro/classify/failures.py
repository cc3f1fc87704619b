"""A run's failures, one per kind and name: what deduplicates across runs and builds.

Read once from a judged run (syzkaller's pkg/report idea: one report every consumer reads): a crash
by its signature (the signature pattern's name when kvrepro knows it, else exception, function and
file), a corruption by its defect (kvrepro/classify/corruptions/; ``unknown`` classes by the
violation class itself), a stall by where the engine waits (the probe's stall-state: the request a
scheduling pass could not allocate for, what it was refused against, what the others hold), an
engine invariant by which one broke (kvrepro/classify/invariants.py), the load's request invariant
by what went wrong. The key is the title without counts: the same failure seen in two runs, or on
two builds, is one key. ``kvrepro explore`` judges keys against the catalogue and a patch's base
(kvrepro/explore/), a matrix report and a suite run tell a stack's failures from its base's by them
(kvrepro/report/stack.py).

Invariant checked here, cheap and GPU-free: every request the load sent ends in a completion or an
error with a reason, and none is answered twice (load.jsonl against trace.jsonl). A run the load
ended early (engine dead, stall) abandons its requests in flight: only the answered ones are held to
the rule then.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..records import RunResult, Verdict
from .patterns import match_pattern

CRASH, CORRUPTION, STALL, INVARIANT = "crash", "corruption", "stall", "invariant"


@dataclass(frozen=True)
class Failure:
    kind: str  # crash | corruption | stall | invariant
    key: str  # what deduplication compares: kind and name, no counts
    title: str  # key plus what tells one instance from another (counts, the first request)
    signature: str | None = None  # the catalogue's name for it: pattern, corruption defect, "stall"; None: none


_DIGITS = re.compile(r"\d+")


def crash_failure(run: RunResult) -> Failure:
    sig = run.signature
    if sig is not None:
        pattern = match_pattern(sig)
        if pattern is not None:
            return Failure(CRASH, f"crash:{pattern.name}",
                           f"CRASH {pattern.name}: {sig.exception} in {sig.function}", pattern.name)
        where = Path(sig.file).name if sig.file else "?"
        return Failure(CRASH, f"crash:{sig.exception}:{sig.function}:{where}",
                       f"CRASH {sig.exception} in {sig.function} ({where}): {sig.expression}"[:200])
    # no traceback (killed, exited): the verdict's title without its numbers names it
    head = _DIGITS.sub("N", (run.title or "no traceback").splitlines()[0])[:120]
    return Failure(CRASH, f"crash:{head}", f"CRASH {run.title}"[:200])


def _unknown_classes(by_class: dict[str, int]) -> list[Failure]:
    """Violations no corruption signature knows, one failure per ``group[+offload]/read``: the region
    ``inherited`` is a later request served the same hole by the prefix cache (docs/defects.md), so
    it folds into its ``hit``; ``computed`` (the request's own computation read wrong) stays apart.
    Classes a known signature claims are left out (that defect is reported under its own name)."""
    from ..classify.corruption import ViolationClass, known_corruptions

    def claimed(cls: str) -> bool:
        try:
            parsed = ViolationClass.parse(cls)
        except ValueError:
            return False
        return any(p.matches(parsed) for c in known_corruptions() for p in c.classes)

    folded: dict[str, dict[str, int]] = {}
    for cls, n in sorted(by_class.items()):
        if n <= 0 or claimed(cls):
            continue
        head, _, region = cls.rpartition("/")
        key = head if head and region in ("hit", "inherited") else cls
        folded.setdefault(key, {})[region or cls] = n
    return [Failure(CORRUPTION, f"corruption:unknown:{key}",
                    f"CORRUPT unknown {key} ({', '.join(f'{r} x{n}' for r, n in parts.items())})")
            for key, parts in folded.items()]


def run_failures(run: RunResult) -> list[Failure]:
    """What the crash classifier, the shadow KV and the stall detector say of one run."""
    found: list[Failure] = []
    for defect, count in sorted(run.kv_defects.items()):
        if count <= 0:
            continue
        if defect == "unknown":  # no signature knows it: the violation classes are its name
            found.extend(_unknown_classes(run.kv_violations_by))
        else:
            found.append(Failure(CORRUPTION, f"corruption:{defect}", f"CORRUPT {defect} x{count}", defect))
    if run.verdict is Verdict.CRASH:
        found.append(crash_failure(run))
    found.extend(engine_invariant_failures(run))
    stalled = run.verdict is Verdict.STALL or (run.load is not None and run.load.stopped_because == "stall")
    if stalled:
        found.append(stall_failure(run))
    return found


def stall_failure(run: RunResult) -> Failure:
    """A stall, keyed by where the engine waits (the probe's stall-state: the request a scheduling
    pass could not allocate for, what it was refused against, what the others hold while they wait),
    so two different stalls of one release are two failures; ``stall`` alone when the probe never saw
    the engine idle with work (a stall elsewhere: the API server, a transfer thread)."""
    where = run.stall_where
    key = f"stall:{where}" if where else "stall"
    counts = (f"deferred_lookups {run.deferred_lookups}, loads_behind_deferred {run.loads_behind_deferred}, "
              f"offload loads {run.offload_load_jobs}, requests {run.load.requests_ok if run.load else '?'} ok")
    title = f"STALL at {where} ({counts})" if where else f"STALL ({counts})"
    return Failure(STALL, key, title[:400], "stall")


PREFIX_CONTENT = "prefix-cache-content"


def engine_invariant_failures(run: RunResult) -> list[Failure]:
    """The engine's invariants broken at its quiescent points (the probe's; kvrepro/classify/invariants.py),
    one failure each, named by the invariant: its catalogue signature."""
    from ..classify.invariants import invariant

    out = []
    for name, n in sorted(run.invariants_broken.items()):
        if n <= 0:
            continue
        if name == PREFIX_CONTENT and run.kv_violations:
            # the at-rest face of what the shadow KV caught being read: that corruption's failure names
            # the defect; this one stands alone only for a wrong block no request has read yet
            continue
        first = run.first_broken if run.first_broken and run.first_broken.startswith(name + ":") else None
        words = first.split(":", 1)[1].strip() if first else invariant(name).title
        out.append(Failure(INVARIANT, f"invariant:{name}",
                           f"INVARIANT {name} at {n} of {run.invariant_checks} quiescent point(s): {words}"[:300], name))
    return out


def invariant_failures(run_dir: Path, stopped_because: str | None) -> list[Failure]:
    """load.jsonl against trace.jsonl: each request ends once, in a completion or an error with a reason."""
    answered: dict[int, int] = {}
    silent: list[int] = []
    empty: list[int] = []
    load = run_dir / "load.jsonl"
    for line in (load.read_text(errors="replace").splitlines() if load.is_file() else []):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a killed writer is the recorder's matter, not the engine's
        if not isinstance(record, dict) or "index" not in record:
            continue
        index = int(record["index"])
        answered[index] = answered.get(index, 0) + 1
        if record.get("status") == "aborted":
            continue  # the client gave up as load.events said: an end, whatever it had seen by then
        if record.get("ok"):
            if not record.get("completion_tokens"):
                empty.append(index)
        elif not str(record.get("error") or "").strip():
            silent.append(index)
    found: list[Failure] = []
    twice = sorted(i for i, n in answered.items() if n > 1)
    if twice:
        found.append(Failure(INVARIANT, "invariant:answered-twice",
                             f"INVARIANT request answered twice: {len(twice)} (first: request {twice[0] + 1})"))
    if silent:
        found.append(Failure(INVARIANT, "invariant:error-without-reason",
                             f"INVARIANT request failed without a reason: {len(silent)} (first: request "
                             f"{min(silent) + 1})"))
    if empty:
        found.append(Failure(INVARIANT, "invariant:ok-without-completion",
                             f"INVARIANT request ok without completion tokens: {len(empty)} (first: request "
                             f"{min(empty) + 1})"))
    if stopped_because == "budget":
        trace = run_dir / "trace.jsonl"
        sent: set[int] = set()
        for line in (trace.read_text(errors="replace").splitlines() if trace.is_file() else []):
            if line.startswith('{"index":'):
                try:
                    sent.add(int(json.loads(line)["index"]))
                except (ValueError, KeyError):
                    continue
        unended = sorted(sent - set(answered))
        if unended:
            found.append(Failure(INVARIANT, "invariant:never-ended",
                                 f"INVARIANT request never ended: {len(unended)} (first: request {unended[0] + 1})"))
    return found


def all_failures(run: RunResult) -> list[Failure]:
    """Every failure of one run: the oracles' (run_failures) and the load's request invariant."""
    return run_failures(run) + invariant_failures(Path(run.run_dir) if run.run_dir else Path("/nonexistent"),
                                                  run.load.stopped_because if run.load else None)


def ending(run: RunResult) -> str | None:
    """The key of the failure that ended ``run`` before its load was spent (its crash, its stall), or
    None: it ran its course. A run cut short could not show what came later: compared with another
    build's run, it says nothing of a failure the other showed unless both ended the same way."""
    if run.verdict is Verdict.CRASH:
        return crash_failure(run).key
    if run.verdict is Verdict.STALL or (run.load is not None and run.load.stopped_because == "stall"):
        return stall_failure(run).key
    return None
