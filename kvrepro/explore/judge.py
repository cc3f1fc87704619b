"""Every oracle on one run: what failed, under which title, and whether the catalogue knows it.

Titles are what deduplication compares (syzkaller's idea): a crash by its signature (the signature
pattern's name when kvrepro knows it, else exception, function and file), a corruption by its
defect (kvrepro/classify/corruptions/; ``unknown`` classes by the violation class itself), a stall
with the counters that tell stalls apart, an invariant by which one broke. The key is the title
without counts, so the same failure seen in two runs is one finding.

The engine's own invariants at its quiescent points (block-pool accounting, requests stranded in
queues and reservations, the offload tier's bookkeeping) are checked by the probe in the engine
process (kvrepro/classify/invariants.py): each broken one is a failure named by its invariant
(``invariant:block-leak``), which a catalogue entry of ``kind: invariant`` names as its signature.

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

from ..classify.patterns import match_pattern
from ..records import RunResult, Verdict
from ..suite.catalogue import Catalogue, counter_value, expected_state

CRASH, CORRUPTION, STALL, INVARIANT = "crash", "corruption", "stall", "invariant"
NEW, KNOWN, REGRESSION = "new", "known", "regression"


@dataclass(frozen=True)
class Failure:
    kind: str  # crash | corruption | stall | invariant
    key: str  # what deduplication compares: kind and name, no counts
    title: str  # key plus what tells one instance from another (counts, the first request)
    signature: str | None = None  # the catalogue's name for it: pattern, corruption defect, "stall"; None: none


@dataclass(frozen=True)
class Judged:
    """A failure against the catalogue on the run's build."""

    failure: Failure
    status: str  # new | known | regression (an entry says it is fixed on this build)
    entry: str | None = None  # the catalogue entry it counts against
    expected: str | None = None  # what that entry expects of the build: present | fixed | None


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
        found.append(Failure(STALL, "stall", f"STALL (deferred_lookups {run.deferred_lookups}, loads_behind_deferred "
                             f"{run.loads_behind_deferred}, offload loads {run.offload_load_jobs}, "
                             f"requests {run.load.requests_ok if run.load else '?'} ok)", "stall"))
    return found


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


def judge_failure(failure: Failure, catalogue: Catalogue, release: str, patches: tuple[str, ...],
                  run: RunResult | None = None, seeded_from: tuple[str, ...] = ()) -> Judged:
    """Count ``failure`` against the catalogue entry with its signature that expects it on this build;
    an entry that says the build is fixed makes it a regression; no entry with the signature: new.

    Several entries share a signature (every stall is ``stall``): those whose path counter ``run``
    reached come first, so a stall with loads behind a deferred lookup counts against the
    skipped-waiting deadlock rather than another stall of the same release. Within that, the
    entries a seed-corpus run replays or descends from (``seeded_from``: RunSpec.seed_entries)
    come first: a stall of recompute-failed-load-stall's own load is that entry's, not whichever
    stall entry the catalogue lists first."""
    if failure.signature is None:
        return Judged(failure, NEW)
    candidates = [e for e in catalogue.entries if e.signature == failure.signature and e.kind == failure.kind]
    candidates.sort(key=lambda e: e.name not in seeded_from)  # stable: catalogue order otherwise
    if not candidates:
        return Judged(failure, NEW)
    reached = [e for e in candidates if run is not None and e.path_counter and counter_value(run, e.path_counter) > 0]
    # the entries whose path ran decide first: a stall on 0.31.0 with loads behind a deferred lookup is
    # the fixed skipped-waiting deadlock back (a regression), even though another stall entry (no fault
    # injected here) is present on 0.31.0
    for group in ((reached, candidates) if reached else (candidates,)):
        states = [(e, expected_state(e, release, patches)) for e in group]
        for entry, state in states:
            if state == "present":
                return Judged(failure, KNOWN, entry.name, state)
        for entry, state in states:
            if state == "fixed":
                return Judged(failure, REGRESSION, entry.name, state)
    # the catalogue knows the signature but claims nothing of this release: known, not checked
    return Judged(failure, KNOWN, candidates[0].name, None)
