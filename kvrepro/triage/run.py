"""`kvrepro triage --run`: run the emitted matrix and say what it proved."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from ..matrix import load_matrix
from ..matrix.runner import MatrixOptions, Progress, run_matrix
from ..results.store import MatrixRun
from ..suite.catalogue import Entry
from ..suite.judge import ABSENT, judge


_CLEAN = ("SURVIVED", "UNREACHED")
_NO_FAILURE = ("SURVIVED", "UNREACHED", "VACUOUS")


@dataclass(frozen=True)
class Proof:
    """Per build: the verdicts it got, what the triage expected of it, and the reproduced entry's
    row on it as the suite judges one (kvrepro/suite/judge.py: PRESENT, ABSENT when its own path
    counter ran, UNREACHED when it did not, OTHER, INFRA), with that row's detail."""

    build: str
    verdicts: tuple[str, ...]
    expected: str
    as_expected: bool
    entry_state: str = ""
    entry_detail: str = ""


def run_emitted(matrix_path: Path, results_root: Path, progress: Progress | None,
                stop: threading.Event, jobs: int | None = None) -> MatrixRun:
    loaded = load_matrix(matrix_path)
    return run_matrix(loaded, MatrixOptions(results_root=results_root, jobs=jobs), progress, stop)


def proofs(run: MatrixRun, entry: Entry | None = None) -> list[Proof]:
    """What each build proved. A build expected free of the failure whose runs neither crashed nor
    read wrong KV is judged by the entry's own path counter, as the suite judges ABSENT: the
    matrix verdict of a run that is not the default target's is VACUOUS whenever the default
    probe's trigger did not run (a queued-abort crash has nothing to do with it), which proves
    nothing either way; the entry's counter (e.g. finished_unscheduled) says whether its path ran."""
    out = []
    for build in run.builds:
        labels = tuple(r.label for r in build.runs)
        accepted = tuple(a.strip() for a in (build.expect or "").split("|") if a.strip())
        ok = bool(labels) and all(label in accepted for label in labels)
        state = detail = ""
        if entry is not None and build.runs:
            row = judge(entry, build.name, build.base, build.patches, list(build.runs))
            state, detail = row.state, row.detail
            if (not ok and accepted and all(a in _CLEAN for a in accepted) and state == ABSENT
                    and all(label in _NO_FAILURE for label in labels)):
                ok = True
        out.append(Proof(build.matrix_build or build.name, labels, build.expect or "", ok, state, detail))
    return out


def what_it_proved(items: list[Proof]) -> list[str]:
    """One line per build, in plain words. A run that proves nothing (the failure's path never ran:
    VACUOUS, or the entry UNREACHED) says so: it is neither clean nor "NOT clean"."""
    lines = []
    for p in items:
        got = ", ".join(p.verdicts) or "no finished run"
        failed = [v for v in p.verdicts if v not in _NO_FAILURE]
        why = f" ({p.entry_detail})" if p.entry_detail else ""
        if p.build == "as-deployed":
            say = "reproduces the log's crash" if "CRASH(target)" in p.verdicts else \
                "reproduces the stall" if "STALL" in p.verdicts else f"did not reproduce the failure{why}"
        elif all(a.strip() in _CLEAN for a in p.expected.split("|") if a.strip()):
            if failed:
                say = f"is NOT clean: {', '.join(dict.fromkeys(failed))}"
            elif p.as_expected:
                path = f"; the failure's path ran{why}" if p.entry_state == ABSENT else ""
                say = f"is clean (no crash, no wrong KV){path}"
            else:
                say = f"proves nothing: the failure's path never ran{why or ' (VACUOUS: the trigger path never ran)'}"
        elif p.as_expected:
            say = "as the catalogue expects"
        elif p.verdicts and all(v == "VACUOUS" for v in p.verdicts):
            say = "proves nothing: the trigger path never ran (VACUOUS)"
        else:
            say = "differs from what the catalogue expects"
        lines.append(f"{p.build}: {got} (expected {p.expected}): {say}")
    return lines
