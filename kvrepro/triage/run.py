"""`kvrepro triage --run`: run the emitted matrix and say what it proved."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from ..matrix import load_matrix
from ..matrix.runner import MatrixOptions, Progress, run_matrix
from ..results.store import MatrixRun


@dataclass(frozen=True)
class Proof:
    """Per build: the verdicts it got and what the triage expected of it."""

    build: str
    verdicts: tuple[str, ...]
    expected: str
    as_expected: bool


def run_emitted(matrix_path: Path, results_root: Path, progress: Progress | None,
                stop: threading.Event, jobs: int | None = None) -> MatrixRun:
    loaded = load_matrix(matrix_path)
    return run_matrix(loaded, MatrixOptions(results_root=results_root, jobs=jobs), progress, stop)


def proofs(run: MatrixRun) -> list[Proof]:
    out = []
    for build in run.builds:
        labels = tuple(r.label for r in build.runs)
        accepted = tuple(a.strip() for a in (build.expect or "").split("|") if a.strip())
        ok = bool(labels) and all(label in accepted for label in labels)
        out.append(Proof(build.matrix_build or build.name, labels, build.expect or "", ok))
    return out


def what_it_proved(items: list[Proof]) -> list[str]:
    """One line per build, in plain words."""
    lines = []
    for p in items:
        got = ", ".join(p.verdicts) or "no finished run"
        if p.build == "as-deployed":
            say = "reproduces the log's crash" if "CRASH(target)" in p.verdicts else \
                "reproduces the stall" if "STALL" in p.verdicts else "did not reproduce the failure"
        elif p.build == "minimal-clean-set":
            say = "is clean (no crash, no wrong KV)" if p.verdicts and all(
                v in ("SURVIVED", "UNREACHED") for v in p.verdicts) else "is NOT clean"
        else:
            say = "as the catalogue expects" if p.as_expected else "differs from what the catalogue expects"
        lines.append(f"{p.build}: {got} (expected {p.expected}): {say}")
    return lines
