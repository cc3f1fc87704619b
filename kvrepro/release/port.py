"""``kvrepro release port X``: the porting checklist of kvrepro/versions.py, done.

1. ``X`` is a release of the table or an unported one (newer than the newest entry, same major
   version); anything else is bad input before anything is downloaded.
2. Its wheel (the package index, or ``KVREPRO_INDEX_URL``) and the wheel of the release it is
   compared with (the newest entry for an unported release, the previous entry for a known one).
3. The static reading (:func:`kvrepro.release.porting.read_release`).
4. One build with no patches on ``X``, the default engine and load, ``requests`` requests, with the
   settings ``X`` runs with (the newest entry's for an unported release).
5. A run that reached no verdict (INFRA, or a crash outside vLLM's code under test) is reduced to
   the one porting step it needs (:func:`kvrepro.release.porting.diagnose`).
6. The table entry to add (``Release("X", ...)``) and the release-table row of docs/engine.md.

The outcome is a :class:`PortResult`; ``ported`` is True when the run reached a verdict without a
code change.
"""

from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import paths, versions
from ..errors import BadInputError, KvreproError
from . import porting

DEFAULT_REQUESTS = 100


@dataclass
class PortResult:
    release: str
    unported: bool
    settings_from: str  # the table entry whose settings it ran with
    compared_with: str | None
    reading: porting.Reading | None = None
    run_id: str | None = None
    run_path: str | None = None
    verdict: str | None = None
    title: str = ""
    requests: int = 0
    seconds: float = 0.0
    needs: porting.Finding | None = None  # the porting step the run stopped on
    error: str | None = None  # the wheel could not be had, a build failed before any run
    notes: list[str] = field(default_factory=list)

    @property
    def ported(self) -> bool:
        """The run reached a verdict with the settings it was given: nothing to port."""
        return self.error is None and self.needs is None and self.verdict not in (None, "INFRA")

    def table_entry(self) -> str:
        """The line to add to RELEASES in kvrepro/versions.py (an unported release), or None needed."""
        base = versions.settings_for(self.settings_from)
        answers = "{**_WARM_UP, **_KV_LAYOUTS}" if base.rpc_answers else "{}"
        extra = ""
        if self.needs is not None and self.needs.step == porting.WORKER_RPC:
            name = self.needs.what.split("'")[1] if "'" in self.needs.what else "?"
            extra = f"  # + {name!r}: what one GPU worker answers ({self.needs.where})"
        return f'Release("{self.release}", rpc_answers={answers}),{extra}'

    def engine_row(self) -> str:
        """The row of docs/engine.md's release table (release, verdict, requests; the counts are the
        run's folder's)."""
        return f"| {self.release} | {self.verdict or 'INFRA'} | {self.requests} requests, run {self.run_id} |"

    def as_json(self) -> dict[str, Any]:
        reading = self.reading
        return {
            "release": self.release, "unported": self.unported, "settings_from": self.settings_from,
            "compared_with": self.compared_with, "ported": self.ported, "run_id": self.run_id,
            "run_path": self.run_path, "verdict": self.verdict, "title": self.title, "requests": self.requests,
            "seconds": round(self.seconds, 1), "error": self.error, "notes": self.notes,
            "needs": vars(self.needs) if self.needs else None,
            "read": [vars(f) for f in reading.findings] if reading else [],
            "signatures": dict(reading.signatures) if reading else {},
            "table_entry": self.table_entry() if self.unported else None,
        }

    def lines(self) -> list[str]:
        out = []
        mark = f" (unported: tried with {self.settings_from}'s settings)" if self.unported else ""
        out.append(f"vLLM {self.release}{mark}")
        if self.error:
            out.append(f"  could not run it: {self.error}")
        if self.verdict:
            out.append(f"  run {self.run_id}: {self.verdict} after {self.requests} requests, {self.seconds:.0f} s"
                       + (f": {self.title}" if self.title else ""))
        if self.needs is not None:
            out.append(f"  NEEDS {self.needs.line()}")
        elif self.ported:
            out.append("  runs without a code change" + (f"; make it a table entry: {self.table_entry()}"
                                                          if self.unported else ""))
        if self.verdict:
            out.append(f"  docs/engine.md release table row: {self.engine_row()}")
        if self.reading is not None:
            shown = [f for f in self.reading.findings if self.needs is None or f.where != self.needs.where]
            if shown:
                out.append(f"  read in its code (compared with {self.compared_with}; not reached by the run "
                           "unless it stopped on it):")
                out += [f"    - {f.line()}" for f in shown]
            signatures = ", ".join(f"{k} {v}" for k, v in self.reading.signatures.items())
            out.append(f"  crash statements: {signatures}")
        out += [f"  note: {n}" for n in self.notes]
        return out


def compared_release(release: str) -> str | None:
    """The release ``release`` is read against: the newest entry for an unported one, else the
    entry before it (None for the oldest)."""
    if versions.is_unported(release):
        return versions.newest()
    known = list(versions.SUPPORTED_RELEASES)
    i = known.index(release)
    return known[i - 1] if i > 0 else None


def check_release(release: str) -> None:
    """Bad input (exit 2) before anything is downloaded."""
    if (problem := versions.unsupported(release)) is not None:
        raise BadInputError(f"release {problem}")


def sweep_matrix(release: str, requests: int, start_timeout_s: float = 300.0) -> dict[str, Any]:
    """One build, no patches, on ``release``: the default matrix's engine and load (as
    scripts/release_sweep.py), ``requests`` requests, one repetition."""
    default = yaml.safe_load(paths.shipped_matrix().read_text()) or {}
    return {
        "base": release, "target": "sim", "builds": {"plain": []},
        "engine": default.get("engine", {}), "load": default.get("load", {}),
        "runs": {**default.get("runs", {}), "repetitions": 1, "requests": requests, "start_timeout_s": start_timeout_s},
    }


def run_port(release: str, requests: int = DEFAULT_REQUESTS, results_root: Path | None = None,
             progress: Any = None, stop: threading.Event | None = None, on_line=None) -> PortResult:
    """The checklist on ``release`` (see the module docstring)."""
    from ..builds import pristine_tree
    from ..matrix import parse_matrix
    from ..matrix.runner import MatrixOptions, run_matrix
    from ..results import store as results

    check_release(release)
    say = on_line or (lambda line: None)
    settings = versions.settings_for(release)
    before = compared_release(release)
    result = PortResult(release, versions.is_unported(release), settings.unported_from or release, before)
    try:
        _, tree, _ = pristine_tree(release, say)
        before_tree = pristine_tree(before, say)[1] if before else None
    except KvreproError as exc:
        result.error = str(exc)
        return result
    say(f"reading vLLM {release}'s code against {before}")
    result.reading = porting.read_release(release, tree, before, before_tree)
    say(f"one run on vLLM {release} ({requests} requests)")
    with tempfile.TemporaryDirectory(prefix="kvrepro-port-") as tmp:
        path = Path(tmp) / "matrix.yaml"
        path.write_text(yaml.safe_dump(sweep_matrix(release, requests), sort_keys=False))
        loaded = parse_matrix(path.read_text(), path)
        root = results.checked_root(results_root or results.DEFAULT_ROOT)
        run = run_matrix(loaded, MatrixOptions(results_root=root, jobs=1), progress, stop)
    result.run_id, result.run_path = run.run_id, str(run.path)
    build = run.builds[0] if run.builds else None
    if build is not None and build.build is not None and not build.build.ok:
        result.error = build.build.error
    first = build.runs[0] if build is not None and build.runs else None
    if first is None:
        result.error = result.error or "the run recorded no repetition"
        return result
    result.verdict, result.title = first.verdict.value, first.title
    result.requests, result.seconds = first.requests, first.seconds
    log = Path(first.run_dir) / "engine.log" if first.run_dir else None
    if log is not None and log.is_file() and (first.verdict.value == "INFRA" or first.outcome.value == "other_crash"):
        result.needs = porting.diagnose(log.read_text(errors="replace"), settings)
        if result.needs is None and first.verdict.value == "INFRA":
            result.needs = porting.Finding(porting.UNKNOWN, first.title[:200], str(log),
                                           "read the engine log; kvrepro/versions.py's checklist lists the known steps",
                                           reached=True)
    return result
