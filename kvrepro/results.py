"""results/: every run kept, every file written atomically as soon as it is known.

Layout::

    results/<run-id>/run.json               what was run (matrix sha, target, builds), status
    results/<run-id>/matrix.yaml            the matrix as it was
    results/<run-id>/<build>/build.json     the build's manifest, or why it failed
    results/<run-id>/<build>/<rep>/         engine.log, load.jsonl, metrics.txt, manifest.json, verdict.json

A run interrupted by Ctrl-C or SIGTERM keeps every finished repetition; ``run.json`` says
``interrupted``. A run whose kvrepro process vanished (SIGKILL, a power cut) still says
``running``; ``run.json`` carries its owner (pid, host, start time, see kvrepro/lifetime.py), so
``load_run`` reports it as ``aborted`` once that process is gone. Repetitions that left files
but no verdict are shown as ``INCOMPLETE``, damaged files as ``DAMAGED``: a damaged file never
hides the rest of the run, nor other runs.

Every text written here goes through ``secrets.redact``; files are created with the usual
permissions (0644 under the common umask 022), like the logs next to them.
"""

from __future__ import annotations

import json
import os
import secrets as _random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import lifetime
from .errors import BadInputError, KvreproError
from .records import to_jsonable
from .secrets import redact

DEFAULT_ROOT = Path("results")


def _file_mode() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _file_mode()  # what open() would give; mkstemp's 0600 would differ from the logs


class DamagedRecordError(BadInputError):
    """A results file that cannot be read (truncated, empty, not JSON)."""


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write via a temporary sibling + rename: readers see the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = redact(data).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(to_jsonable(value), indent=2, sort_keys=False) + "\n")


def read_json(path: Path) -> Any:
    """A results JSON file; DamagedRecordError (one line, naming it) if it is truncated or empty."""
    try:
        return json.loads(path.read_text(errors="replace"))
    except ValueError as exc:
        size = path.stat().st_size if path.exists() else 0
        what = "empty" if size == 0 else f"not valid JSON ({exc.msg} at line {exc.lineno})" \
            if isinstance(exc, json.JSONDecodeError) else f"not valid JSON ({exc})"
        raise DamagedRecordError(f"{path}: {what}; the file is damaged (a full disk or a crash while "
                                 "writing?): fix or remove it") from None


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + _random.token_hex(2)


@dataclass
class RunFolder:
    root: Path
    run_id: str

    @property
    def path(self) -> Path:
        return self.root / self.run_id

    def build_dir(self, build: str) -> Path:
        return self.path / build

    def rep_dir(self, build: str, rep: int) -> Path:
        d = self.path / build / str(rep)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def update(self, **fields: Any) -> None:
        info_path = self.path / "run.json"
        info = read_json(info_path) if info_path.exists() else {}
        info.update(to_jsonable(fields))
        write_json(info_path, info)


def create_run(root: Path, matrix_text: str, info: dict[str, Any]) -> RunFolder:
    folder = RunFolder(root=root, run_id=new_run_id())
    folder.path.mkdir(parents=True, exist_ok=False)
    try:
        write_atomic(folder.path / "matrix.yaml", matrix_text)
        # who runs it: once that process is gone while this still says "running", it was aborted
        folder.update(run_id=folder.run_id, status="running", started=time.time(), owner=lifetime.owner(), **info)
    except OSError:  # a full disk: leave no half-made run folder behind
        import shutil

        shutil.rmtree(folder.path, ignore_errors=True)
        raise
    return folder


def list_runs(root: Path = DEFAULT_ROOT) -> list[dict[str, Any]]:
    """Every run, oldest first; a run whose run.json is damaged is listed as such, not fatal."""
    runs = []
    for run_id in run_ids(root):
        try:
            runs.append(load_run(root, run_id))
        except DamagedRecordError as exc:
            runs.append({"run_id": run_id, "status": "damaged", "error": str(exc), "builds_results": {},
                         "path": str(root / run_id)})
    return runs


def run_ids(root: Path) -> list[str]:
    """The run folders under ``root`` (those with a run.json), oldest first."""
    if not root.is_dir():
        return []
    return [d.name for d in sorted(root.iterdir()) if (d / "run.json").is_file()]


def resolve_run_id(root: Path, run_id: str) -> str:
    if root.exists() and not root.is_dir():
        raise BadInputError(f"--results {root}: is a file, not a folder of runs; give the folder runs are recorded in")
    if run_id != "latest":
        return run_id
    ids = run_ids(root)
    if not ids:
        raise KvreproError(f"no runs under {root}/; start one with `kvrepro matrix run`")
    return ids[-1]


def load_run(root: Path, run_id: str) -> dict[str, Any]:
    """run.json plus every build's manifest and verdicts found on disk (the truth after a crash)."""
    run_id = resolve_run_id(root, run_id)
    path = root / run_id
    if not (path / "run.json").is_file():
        known = ", ".join(run_ids(root)[-5:])
        raise BadInputError(f"no run {run_id!r} under {root}/ (latest: {known or 'none'}); "
                            "`kvrepro results list` shows them all")
    info = read_json(path / "run.json")
    if not isinstance(info, dict):
        raise DamagedRecordError(f"{path / 'run.json'}: not a JSON object; the file is damaged: fix or remove it")
    if info.get("status") == "running" and lifetime.owner_alive(info.get("owner")) is False:
        info["status"] = "aborted"  # its kvrepro process vanished (SIGKILL, a crash) mid-run
    builds: dict[str, Any] = {}
    for name in info.get("build_order", []):
        build_dir = path / name
        try:
            build_info = read_json(build_dir / "build.json") if (build_dir / "build.json").is_file() else {}
        except DamagedRecordError as exc:
            build_info = {"ok": False, "error": str(exc)}
        runs = []
        if build_dir.is_dir():
            reps = sorted((d for d in build_dir.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
            for rep in reps:
                entry = _load_rep(rep, info.get("status"))
                if entry is not None:
                    runs.append(entry)
        declared = info.get("builds", {}).get(name, {})
        builds[name] = {
            "patches": declared.get("patches", []),
            "base": declared.get("base") or info.get("base"),
            "matrix_build": declared.get("build") or name,
            "build": build_info,
            "runs": runs,
        }
    info["builds_results"] = builds
    info["path"] = str(path)
    return info


def _load_rep(rep: Path, run_status: str | None) -> dict[str, Any] | None:
    """A repetition's verdict.json, or what is known about one that has none (or a damaged one);
    None for a repetition that left nothing (its folder made, nothing run)."""
    verdict_path = rep / "verdict.json"
    base = {"rep": int(rep.name), "run_dir": str(rep), "trigger_count": 0, "requests": 0, "seconds": 0.0}
    if verdict_path.is_file():
        try:
            verdict = read_json(verdict_path)
            if isinstance(verdict, dict):
                return verdict
            raise DamagedRecordError(f"{verdict_path}: not a JSON object; the file is damaged: fix or remove it")
        except DamagedRecordError as exc:
            return {**base, "verdict": "DAMAGED", "outcome": "none", "title": str(exc)}
    kept = sorted(p.name for p in rep.iterdir() if p.is_file() and not p.name.startswith("."))
    if not kept:
        return None
    state = "still running" if run_status == "running" else f"run {run_status or 'stopped'} before its verdict"
    return {**base, "verdict": "INCOMPLETE", "outcome": "none", "files": kept,
            "title": f"no verdict: {state}" + (f"; kept {', '.join(kept)}" if kept else "")}
