"""One row per catalogue entry and build: what its repetitions show, against what it expects.

Rows (docs/suite.md):

* PRESENT: a repetition showed the entry's signature (crash signature, corruption defect, STALL);
* ABSENT: none did, and the entry's path counter reached ``at_least`` in every repetition;
* UNREACHED: none did, and the path counter stayed below it in some repetition, or fewer
  repetitions ran than the entry's ``absent_after`` (proves nothing);
* OTHER: none did, and some repetition ended early on another failure (it may hide this one), or
  read wrong KV (CORRUPT: a corruption that is not this entry's is named, never hidden under ABSENT);
* NOT TESTABLE: the entry says why the suite cannot test it here (no runs), or this release's
  ``vllm serve`` refused the entry's engine arguments (its configuration does not exist there);
* INFRA: no repetition could be judged (build, engine start or load failed; or interrupted).

``expected`` is what the catalogue says of the build ("present", "fixed" or None); a row
matches when PRESENT is expected present or ABSENT expected fixed. INFRA and rows without an
expectation are never a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..classify.classifier import ARGUMENT_ERROR_TITLE
from ..classify.corruption import first_request
from ..classify.patterns import known_patterns
from ..records import RunResult, Verdict
from ..secrets import redact
from .catalogue import Entry, counter_value, expected_state

PRESENT, ABSENT, UNREACHED, OTHER, NOT_TESTABLE, INFRA = (
    "PRESENT", "ABSENT", "UNREACHED", "OTHER", "NOT TESTABLE", "INFRA")
_UNJUDGED = (Verdict.INFRA, Verdict.INTERRUPTED, Verdict.INCOMPLETE, Verdict.DAMAGED)


@dataclass(frozen=True)
class Row:
    entry: str
    kind: str
    build: str  # build key: 0.26.0 or 0.26.0+pr-52807
    state: str
    detail: str  # the signature shown, the path counter per repetition, the other failure, the reason
    expected: str | None  # "present" | "fixed" | None
    matches: bool | None  # None: nothing to compare (no expectation, INFRA, NOT TESTABLE)
    reps: int = 0
    seconds: float = 0.0
    run_dirs: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        return self.matches is False


def shows(entry: Entry, run: RunResult) -> bool:
    """Whether one repetition shows the entry's own signature."""
    if entry.kind == "corruption":
        return run.kv_defects.get(entry.signature, 0) > 0
    if entry.kind == "invariant":
        return run.invariants_broken.get(entry.signature, 0) > 0
    if entry.kind == "stall":
        # a run's verdict puts corruption before the stall that ended it: the load says it stalled
        return run.verdict is Verdict.STALL or (run.load is not None and run.load.stopped_because == "stall")
    if run.verdict is not Verdict.CRASH or run.signature is None:
        return False
    pattern = next((p for p in known_patterns() if p.name == entry.signature), None)
    return pattern is not None and pattern.match(run.signature) is not None


def counter(entry: Entry, run: RunResult) -> int:
    return counter_value(run, entry.path_counter or "")


def _compare(state: str, expected: str | None) -> bool | None:
    if expected is None or state in (INFRA, NOT_TESTABLE):
        return None
    return state == (PRESENT if expected == "present" else ABSENT)


def not_testable_row(entry: Entry, build: str, release: str, patches: tuple[str, ...], why: str = "") -> Row:
    """``why``: this release refuses the entry's matrix (suite.run.refused_builds); else the entry's reason."""
    return Row(entry=entry.name, kind=entry.kind, build=build, state=NOT_TESTABLE,
               detail=redact(why)[:300] if why else entry.not_testable or "",
               expected=expected_state(entry, release, patches), matches=None)


def judge(entry: Entry, build: str, release: str, patches: tuple[str, ...], runs: list[RunResult],
          build_error: str | None = None) -> Row:
    """The row of ``entry`` on one build from its recorded repetitions."""
    expected = expected_state(entry, release, patches)
    seconds = round(sum(r.seconds for r in runs), 1)
    dirs = tuple(r.run_dir for r in runs if r.run_dir)

    def row(state: str, detail: str) -> Row:
        # the detail quotes recorded errors and titles (an engine's command line with --hf-token ...):
        # redacted here, once, for the table, the "differs" lines, --json and JUnit alike
        return Row(entry=entry.name, kind=entry.kind, build=build, state=state, detail=redact(detail), expected=expected,
                   matches=_compare(state, expected), reps=len(runs), seconds=seconds, run_dirs=dirs)

    hits = [r for r in runs if shows(entry, r)]
    if hits:
        first = hits[0]
        if entry.kind == "corruption":
            what = f"{entry.signature} x{first.kv_defects.get(entry.signature, 0)}"
        elif entry.kind == "stall":
            what = "STALL"
        elif entry.kind == "invariant":
            what = f"{entry.signature} at {first.invariants_broken.get(entry.signature, 0)} quiescent point(s)"
        else:
            what = entry.signature
        index = first.load.first_failed_index if first.load else None
        # first_failed_index counts from 0; a corruption is seen before whatever ends the run: its
        # first request comes from the shadow KV's described violations
        number = (index + 1 if index is not None else None) if entry.kind == "crash" else \
            first_request(entry.signature, first.kv_first_request_by_class, first.kv_groups) \
            if entry.kind == "corruption" else None
        at = f", request {number}" if number is not None else ""
        return row(PRESENT, f"{what} in {len(hits)}/{len(runs)} reps (rep {first.rep}{at})")
    judged = [r for r in runs if r.verdict not in _UNJUDGED]
    refused = [r for r in runs if r.verdict is Verdict.INFRA and ARGUMENT_ERROR_TITLE in (r.title or "")]
    if runs and len(refused) == len(runs):
        # the entry's engine does not exist on this release (e.g. --mamba-cache-mode all, gone in
        # 0.32.0): nothing to test here, which is not an infrastructure failure
        why = (refused[0].title or "").split(ARGUMENT_ERROR_TITLE, 1)[1].strip()
        return row(NOT_TESTABLE, f"this release's vllm serve refuses the entry's engine: {why}"[:160])
    if build_error or not judged or len(judged) < len(runs):
        bad = next((r for r in runs if r.verdict in _UNJUDGED), None)
        why = build_error or (bad.title if bad else "no repetition finished")
        return row(INFRA, why.strip().splitlines()[0][:160] if why.strip() else "no repetition finished")
    early = [r for r in judged if r.verdict in (Verdict.CRASH, Verdict.STALL)]
    if early:
        r = early[0]
        known = next((p.name for p in known_patterns() if r.signature is not None and p.match(r.signature)), None)
        return row(OTHER, f"{r.label} in rep {r.rep}: {known or r.title}"[:160])
    corrupt = [r for r in judged if r.verdict is Verdict.CORRUPT or r.kv_violations > 0]
    if corrupt:
        # wrong KV that is not this entry's: the path counter may have run, but a row that says
        # ABSENT (or UNREACHED) must not make a corrupt build look clean
        r = corrupt[0]
        named = ", ".join(f"{name} x{n}" for name, n in sorted(r.kv_defects.items(), key=lambda kv: (-kv[1], kv[0])))
        return row(OTHER, f"CORRUPT in {len(corrupt)}/{len(runs)} reps (rep {r.rep}: {r.kv_violations} KV "
                          f"violations, {named or 'no defect named'})"[:160])
    counts = [counter(entry, r) for r in judged]
    shown = f"{entry.path_counter} {'/'.join(str(c) for c in counts)}"
    if len(judged) < entry.absent_after:  # a defect that shows in some runs only: one clean run says little
        return row(UNREACHED, f"{len(judged)} of the {entry.absent_after} repetitions absent needs; {shown}")
    if all(c >= entry.path_at_least for c in counts):
        return row(ABSENT, f"path ran: {shown}")
    # where the load went blind: what the offload tier received, per group kind (shadow KV)
    stored = judged[0].kv_stored
    tier = f"; stored {','.join(f'{k}:{n}' for k, n in sorted(stored.items())) or 'nothing'}" if judged[0].kv_checks else ""
    return row(UNREACHED, f"path below {entry.path_at_least}: {shown}{tier}"[:160])
