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
* INFRA: no repetition could be judged (build, engine start or load failed; or interrupted);
* MASKED: on a build the entry names in ``masked_in``, the row OTHER with its failure another
  catalogued defect's (``ended_by``), or PRESENT when another catalogued entry has the same
  signature (the suite cannot tell the two apart): that defect ends the load first, as the
  catalogue says.

``expected`` is what the catalogue says of the build ("present", "fixed", "masked", "unreached" or
None); a row matches when PRESENT is expected present, ABSENT expected fixed, MASKED expected
masked, UNREACHED expected unreached (the entry's ``unreached_in``: its load goes blind there).
INFRA and rows without an expectation are never a mismatch. :func:`reconcile` is the one rule
that turns a measured row into MASKED: the suite applies it to its runs, the docs' check to
the rows recorded in docs/records/ (scripts/measured.py), so a changed catalogue is judged
against what was measured without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..classify.corruption import UNKNOWN, first_request
from ..classify.patterns import known_patterns
from ..records import RunResult, Verdict
from ..secrets import redact
from .catalogue import Entry, counter_value, expected_state

PRESENT, ABSENT, UNREACHED, OTHER, NOT_TESTABLE, INFRA, MASKED = (
    "PRESENT", "ABSENT", "UNREACHED", "OTHER", "NOT TESTABLE", "INFRA", "MASKED")
MASKED_NOTE = "(another entry's, as masked_in says): "  # between a MASKED row's masking defect and its evidence
_UNJUDGED = (Verdict.INFRA, Verdict.INTERRUPTED, Verdict.INCOMPLETE, Verdict.DAMAGED)


@dataclass(frozen=True)
class Row:
    entry: str
    kind: str
    build: str  # build key: 0.26.0 or 0.26.0+pr-52807
    state: str
    detail: str  # the signature shown, the path counter per repetition, the other failure, the reason
    expected: str | None  # "present" | "fixed" | "masked" | None
    matches: bool | None  # None: nothing to compare (no expectation, INFRA, NOT TESTABLE)
    reps: int = 0
    seconds: float = 0.0
    run_dirs: tuple[str, ...] = ()
    # the known signature that ended an OTHER row's load (a crash signature, a corruption defect, "stall");
    # None when it is none kvrepro knows
    ended_by: str | None = None
    measured: str = ""  # the row before reconcile() (PRESENT, ABSENT, UNREACHED, OTHER, ...)

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


def agrees(state: str, expected: str | None) -> bool | None:
    """Whether a row agrees with what the catalogue expects; None: nothing to compare."""
    if expected is None or state in (INFRA, NOT_TESTABLE):
        return None
    return state == {"present": PRESENT, "fixed": ABSENT, "masked": MASKED, "unreached": UNREACHED}[expected]


def reconcile(state: str, ended_by: str | None, signature: str, expected: str | None,
              others: frozenset[str]) -> str:
    """The row shown for a measured ``state``: MASKED where the catalogue expects masking and the
    runs show it (OTHER ended by a defect in ``others``, the signatures of the catalogue's other
    entries; or PRESENT when ``signature`` is one of them, indistinguishable); else ``state``."""
    if expected != "masked":
        return state
    if state == OTHER and ended_by is not None and ended_by in others:
        return MASKED
    if state == PRESENT and signature in others:
        return MASKED
    return state


def others_of(catalogue: object, entry: Entry) -> frozenset[str]:
    """The signatures of every other entry of ``catalogue`` (crash signatures, corruption defects, stall)."""
    return frozenset(e.signature for e in getattr(catalogue, "entries", ()) if e.name != entry.name)


def not_testable_row(entry: Entry, build: str, release: str, patches: tuple[str, ...], why: str = "") -> Row:
    """``why``: this release refuses the entry's matrix (suite.run.refused_builds); else the entry's reason."""
    return Row(entry=entry.name, kind=entry.kind, build=build, state=NOT_TESTABLE,
               detail=redact(why)[:300] if why else entry.not_testable or "",
               expected=expected_state(entry, release, patches), matches=None)


def judge(entry: Entry, build: str, release: str, patches: tuple[str, ...], runs: list[RunResult],
          build_error: str | None = None, others: frozenset[str] = frozenset()) -> Row:
    """The row of ``entry`` on one build from its recorded repetitions; ``others``: the signatures of
    the catalogue's other entries (:func:`others_of`), which may mask this one (:func:`reconcile`)."""
    expected = expected_state(entry, release, patches)
    seconds = round(sum(r.seconds for r in runs), 1)
    dirs = tuple(r.run_dir for r in runs if r.run_dir)

    def row(state: str, detail: str, ended_by: str | None = None) -> Row:
        # the detail quotes recorded errors and titles (an engine's command line with --hf-token ...):
        # redacted here, once, for the table, the "differs" lines, --json and JUnit alike
        shown = reconcile(state, ended_by, entry.signature, expected, others)
        if shown == MASKED:
            detail = f"masked by {ended_by or entry.signature} {MASKED_NOTE}{detail}"
        return Row(entry=entry.name, kind=entry.kind, build=build, state=shown, detail=redact(detail),
                   expected=expected, matches=agrees(shown, expected), reps=len(runs), seconds=seconds,
                   run_dirs=dirs, ended_by=ended_by, measured=state)

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
    refused = [r for r in runs if r.verdict is Verdict.INFRA and r.refused_arguments]
    if runs and len(refused) == len(runs):
        # the entry's engine does not exist on this release (e.g. --mamba-cache-mode all, gone in
        # 0.32.0): nothing to test here, which is not an infrastructure failure
        why = (refused[0].refused_arguments or "").strip()
        return row(NOT_TESTABLE, f"this release's vllm serve refuses the entry's engine: {why}"[:160])
    if build_error or not judged or len(judged) < len(runs):
        bad = next((r for r in runs if r.verdict in _UNJUDGED), None)
        why = build_error or (bad.title if bad else "no repetition finished")
        return row(INFRA, why.strip().splitlines()[0][:160] if why.strip() else "no repetition finished")
    early = [r for r in judged if r.verdict in (Verdict.CRASH, Verdict.STALL)]
    if early:
        r = early[0]
        known = next((p.name for p in known_patterns() if r.signature is not None and p.match(r.signature)), None)
        if r.verdict is Verdict.STALL:
            known = "stall"
        return row(OTHER, f"{r.label} in rep {r.rep}: {known or r.title}"[:160], known)
    corrupt = [r for r in judged if r.verdict is Verdict.CORRUPT or r.kv_violations > 0]
    if corrupt:
        # wrong KV that is not this entry's: the path counter may have run, but a row that says
        # ABSENT (or UNREACHED) must not make a corrupt build look clean
        r = corrupt[0]
        ranked = sorted(r.kv_defects.items(), key=lambda kv: (-kv[1], kv[0]))
        named = ", ".join(f"{name} x{n}" for name, n in ranked)
        # the defect most of the wrong reads are; none when some read is of no known defect (an
        # uncatalogued wrong read is a finding, never masked)
        top = ranked[0][0] if ranked and UNKNOWN not in r.kv_defects else None
        return row(OTHER, f"CORRUPT in {len(corrupt)}/{len(runs)} reps (rep {r.rep}: {r.kv_violations} KV "
                          f"violations, {named or 'no defect named'})"[:160], top)
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
