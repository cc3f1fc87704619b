"""A new finding, minimized: its run's trace shrunk by `kvrepro minimize`, and an emitted pytest.

A finding folder (campaign.py writes it) holds the run's trace and a matrix.yaml that reruns it; its
``target_signature`` is the finding's own crash, so "still fails" for the minimizer means this crash
(kvrepro/minimize/shrink.py). A corruption is minimized by its violation: a known defect by name, an
unknown class by its group kind and offload flag (``mamba+offload``). The minimizer replays the
trace one request at a time on the offline engine, so a failure that needed requests in flight
together (concurrency > 1) may not shrink: the folder then says why, and the run's own trace is
still there. Stalls and broken invariants are not minimized (the minimizer knows crashes and
corruptions); the folder says so.

What is left in the folder: ``minimized.trace.jsonl`` (replay it with `kvrepro load replay`),
``minimized.json`` (the minimizer's summary: requests before and after, deterministic, what the
emitted test did) and ``test_finding.py`` (scheduler-level, runs with the build's vLLM; it must fail).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import KvreproError
from ..results import store as results
from .judge import CORRUPTION, CRASH
from .state import FindingRecord
from ..matrix import load_matrix

BUILD = "explore"
PYTEST_FILE = "test_finding.py"


@dataclass(frozen=True)
class MinimizedFinding:
    """What minimizing one finding gave (``finding.json`` ``minimized``)."""

    ok: bool  # minimized, deterministic, and the emitted test fails on the build as it should
    note: str  # one line: what happened, or why it was not minimized
    requests_before: int | None = None
    requests: int | None = None
    deterministic: bool | None = None
    pytest_fails: bool | None = None  # the emitted test fails on the finding's build (None: not run)


def violation_of(key: str) -> str | None:
    """The minimizer's ``violation`` for a corruption key: ``corruption:<defect>`` -> the defect;
    ``corruption:unknown:mamba+offload/missing`` -> ``mamba+offload`` (its group kind and flag)."""
    rest = key.removeprefix("corruption:")
    if rest.startswith("unknown:"):
        return rest.removeprefix("unknown:").split("/", 1)[0]
    return rest


def minimize_finding(campaign: Path, finding: FindingRecord, run_id: str,
                     on_line: Callable[[str], None] = lambda _: None) -> MinimizedFinding:
    """Minimize ``finding`` (its folder under ``campaign``) from matrix run ``run_id`` of the campaign;
    record the outcome in its ``finding.json``. Never raises for a failure that cannot be minimized."""
    from ..minimize.shrink import minimize

    folder = results.inside(campaign, campaign / str(finding.folder))
    if finding.kind not in (CRASH, CORRUPTION):
        got = MinimizedFinding(ok=False, note=f"not minimized: kvrepro minimize shrinks crashes and corruptions, "
                                             f"this is {'an' if finding.kind[0] in 'aeiou' else 'a'} {finding.kind}")
    else:
        violation = violation_of(finding.key) if finding.kind == CORRUPTION else None
        try:
            loaded = load_matrix(folder / "matrix.yaml")
            summary = minimize(loaded, campaign / "runs", run_id, BUILD, emit_pytest=folder / PYTEST_FILE,
                               confirm=False, violation=violation, on_line=on_line)
        except (KvreproError, OSError) as exc:  # the campaign goes on; the run's own trace is in the folder
            got = MinimizedFinding(ok=False, note="not minimized: " + (str(exc).strip() or repr(exc)).splitlines()[0][:300])
        except Exception as exc:  # noqa: BLE001 - a bug of the minimizer's must not end the campaign either
            got = MinimizedFinding(ok=False, note=f"not minimized: the minimizer failed ({type(exc).__name__}: "
                                                  + (str(exc).strip() or repr(exc)).splitlines()[0][:250] + ")")
        else:
            for name in ("minimized.trace.jsonl", "minimized.json"):
                source = Path(summary.trace).with_name(name)
                if source.is_file():
                    shutil.copyfile(source, folder / name)
            check = summary.pytest_check.get(BUILD)
            fails = check.ok if check is not None else None
            got = MinimizedFinding(
                ok=summary.deterministic and fails is True, requests_before=summary.requests_before,
                requests=summary.requests, deterministic=summary.deterministic, pytest_fails=fails,
                note=(f"minimized {summary.requests_before} -> {summary.requests} requests, "
                      f"{'deterministic (3 of 3 offline)' if summary.deterministic else 'NOT deterministic'}; "
                      f"{PYTEST_FILE}: {check.result if check is not None else 'not run'}"))
    record = folder / "finding.json"
    if record.is_file():
        data = results.read_json(record)
        data["minimized"] = asdict(got)
        results.write_json(record, data)
    return got
