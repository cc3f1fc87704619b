"""results/: every run kept, every file written atomically as soon as it is known.

Layout::

    results/<run-id>/run.json               what was run (matrix sha, target, builds), status
    results/<run-id>/matrix.yaml            the matrix as it was
    results/<run-id>/<build>/build.json     the build's manifest, or why it failed
    results/<run-id>/<build>/<rep>/         engine.log, load.jsonl, metrics.txt, manifest.json, verdict.json

A run interrupted by Ctrl-C or SIGTERM keeps every finished repetition; ``run.json`` says
``interrupted``. A run whose kvrepro process vanished (SIGKILL, a power cut) still says
``running``; ``run.json`` carries its owner (pid, host, start time, see kvrepro/lifetime.py), so
``load_run`` reports it as ``aborted`` once that process is gone. Repetitions that left files but
no verdict are shown as ``INCOMPLETE`` with what they left.

Every text written here goes through ``secrets.redact``; files are created with the usual
permissions (0644 under the common umask 022), like the logs next to them.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import secrets as _random
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import __version__, lifetime, untrusted
from ..errors import BadInputError, KvreproError
from ..deploy.records import BuildRecord, RunManifest
from ..deploy import lift_target_keys
from ..records import RESULTS_SCHEMA, RecordError, RunResult, Outcome, Verdict, from_jsonable, to_jsonable
from .records import RunBuildEntry, RunInfo
from ..secrets import redact

DEFAULT_ROOT = Path("results")


def checked_root(root: Path) -> Path:
    """``--results ROOT``: a folder, or not there yet; a file there is bad input (exit 2)."""
    if root.exists() and not root.is_dir():
        raise BadInputError(f"--results {root}: is a file, not a folder; give a folder where runs are recorded")
    return root


def _file_mode() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _file_mode()  # what open() would give; mkstemp's 0600 would differ from the logs


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write via a temporary sibling + rename: readers see the old file or the new, never half."""
    if isinstance(data, str):
        data = redact(data).encode()  # one redaction for every results file (issue 8)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
        # named by the file meant, never by the temporary sibling the user has never heard of
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None
    except BaseException:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(to_jsonable(value), indent=2, sort_keys=False) + "\n")


def _finite(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:20]} out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# a record kvrepro writes is a few KB; a results folder is copied, shared and edited by hand, so a
# record may be a FIFO, a link to /dev/zero or a 1 GB file: refused by kvrepro/untrusted.py
MAX_RECORD_BYTES = 16 * 1024 * 1024


def read_json(path: Path) -> Any:
    """A JSON file kvrepro wrote; numbers that no writer produces (1e999999, NaN) mean damage.
    Read bounded, never blocking, never through a link (kvrepro/untrusted.py): OSError if not a
    regular file of at most MAX_RECORD_BYTES, ValueError if not JSON (or nested too deeply).
    Secrets are masked (secrets.redact) before parsing: the one place every recorded record is read."""
    # redacted as it is read, as everything is as it is written: a record copied from elsewhere or
    # edited by hand may carry a token (an engine's command line in an error), and whatever prints
    # a recorded title or error (`results show`, `suite report`'s table) then prints it masked
    text = redact(untrusted.read_bytes(path, MAX_RECORD_BYTES).decode("utf-8"))
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply; a record is a few levels deep") from None


def inside(folder: Path, path: Path,
           hint: str = "a build or patch name must be a plain name (letters, digits, '_', '.', '-')") -> Path:
    """``path`` if it lies inside ``folder`` once both are resolved; every folder kvrepro makes under
    a run is checked, so no name (a build, a patch, a point of a bisection) can lead elsewhere."""
    resolved, root = path.resolve(), folder.resolve()
    if resolved != root and not resolved.is_relative_to(root):
        raise BadInputError(f"{path}: would be outside {folder}; {hint}")
    return path


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
        return inside(self.path, self.path / build)

    def rep_dir(self, build: str, rep: int) -> Path:
        d = inside(self.path, self.path / build / str(rep))
        d.mkdir(parents=True, exist_ok=True)
        return d

    def update(self, **fields: Any) -> None:
        info_path = self.path / "run.json"
        info = read_json(info_path) if info_path.exists() else {}
        info.update(to_jsonable(fields))
        write_json(info_path, info)


def create_run(root: Path, matrix_text: str, info: RunInfo) -> RunFolder:
    """A new run folder with its matrix.yaml and run.json: ``info`` as planned (its ``run_id``,
    ``status``, ``started`` and ``owner`` are this run's, set here)."""
    folder = RunFolder(root=root, run_id=new_run_id())
    for name in info.build_order:
        folder.build_dir(name)  # every build's folder lies inside the run's (checked before anything is made)
    folder.path.mkdir(parents=True, exist_ok=False)
    try:
        write_atomic(folder.path / "matrix.yaml", matrix_text)
        # who runs it: once that process is gone while this still says "running", it was aborted
        planned = {k: v for k, v in to_jsonable(info).items()
                   if v is not None and k not in ("schema", "run_id", "status", "started", "owner")}
        folder.update(schema=RESULTS_SCHEMA, run_id=folder.run_id, status="running", started=time.time(),
                      owner=lifetime.owner(), **planned)
    except OSError:  # a full disk: leave no half-made run folder behind
        import shutil

        shutil.rmtree(folder.path, ignore_errors=True)
        raise
    return folder


class ResultsSchemaError(KvreproError):
    """A results folder this kvrepro cannot read as its records (another version wrote it)."""

    exit_code = 2


@dataclass(frozen=True)
class BuildResults:
    """One (base, build) of a run: its stack, its build record and every finished repetition."""

    name: str
    base: str
    patches: tuple[str, ...]
    build: BuildRecord | None  # None while it was being built (or the folder lost build.json)
    runs: tuple[RunResult, ...]
    manifest: RunManifest | None  # the first repetition's: engine args, seeds, load
    expect: str | None = None
    matrix_build: str = ""  # the build's name in matrix.yaml (``name`` is the cell: ``A@0.30.0``)

    @property
    def key(self) -> tuple[str, str]:
        return (self.base, self.build_name)

    @property
    def build_name(self) -> str:
        return self.matrix_build or self.name

    @property
    def build_error(self) -> str | None:
        return self.build.error if self.build is not None else None


@dataclass(frozen=True)
class MatrixRun:
    """A recorded run read back from disk: the truth after a crash or Ctrl-C."""

    info: RunInfo
    path: Path
    builds: tuple[BuildResults, ...]

    @property
    def run_id(self) -> str:
        return self.info.run_id

    @property
    def status(self) -> str:
        return self.info.status

    def runs(self) -> list[RunResult]:
        return [r for b in self.builds for r in b.runs]

    def build(self, name: str, base: str | None = None) -> BuildResults | None:
        for b in self.builds:
            if b.name == name and (base is None or b.base == base):
                return b
        return None


def _read_record(cls: Any, path: Path) -> Any:
    """One JSON file as its record; a file of another schema or shape is one clear line."""
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        raise ResultsSchemaError(f"{path}: unreadable ({exc}); the file is damaged (a full disk or a crash "
                                 "while writing?): fix or remove it") from None
    if cls in (RunInfo, RunResult):  # the two files that carry the schema number
        _check_schema(path, data)
    if cls in (RunManifest, RunResult):  # a target's keys at the top level: written before target sections
        data = lift_target_keys(data, {f.name for f in dataclasses.fields(cls)})
    try:
        return from_jsonable(cls, data)
    except RecordError as exc:
        raise ResultsSchemaError(f"{path}: field {exc.field_path}: {exc.problem} "
                                 f"(written by another kvrepro? this one reads results schema {RESULTS_SCHEMA})") from None


def _check_schema(path: Path, data: Any) -> None:
    if not isinstance(data, dict):
        raise ResultsSchemaError(f"{path}: unreadable (not a JSON object); the file is damaged: fix or remove it")
    version = data.get("schema", 1)
    if version == RESULTS_SCHEMA and not isinstance(version, bool):
        return
    if not isinstance(version, int) or isinstance(version, bool) or version < 1 or version > 1000:
        raise ResultsSchemaError(f"{path}: unreadable (schema {str(version)[:20]!r} is not a schema number); the "
                                 "file is damaged: fix or remove it")
    writer = data.get("kvrepro_version", "unknown") if isinstance(data, dict) else "unknown"
    age = "an older" if isinstance(version, int) and version < RESULTS_SCHEMA else "a newer"
    raise ResultsSchemaError(
        f"{path.parent}: written by {age} kvrepro ({writer}, results schema {version}); this kvrepro "
        f"{__version__} reads schema {RESULTS_SCHEMA}: read it with the kvrepro that wrote it, or run the matrix again")


def _reps(build_dir: Path) -> list[Path]:
    if not build_dir.is_dir():
        return []
    return sorted((d for d in build_dir.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))


def list_runs(root: Path = DEFAULT_ROOT) -> list[MatrixRun | ResultsSchemaError]:
    """Every run under ``root``, oldest first; a folder that cannot be read is listed as its error."""
    runs: list[MatrixRun | ResultsSchemaError] = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if (d / "run.json").is_file():
                try:
                    runs.append(load_run(root, d.name))
                except ResultsSchemaError as exc:
                    runs.append(exc)
    return runs


def other_folders(root: Path) -> tuple[list[str], list[str]]:
    """What ``list_runs`` leaves out: bisection folders (``bisect.json``; `kvrepro results show ID`)
    and folders that are not runs (no run.json: a run that failed before writing it, a copy)."""
    bisections: list[str] = []
    others: list[str] = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if not d.is_dir() or d.name.startswith(".") or (d / "run.json").is_file():
                continue
            (bisections if (d / "bisect.json").is_file() else others).append(d.name)
    return bisections, others


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
        raise BadInputError(f"no runs under {root}/; start one with `kvrepro matrix run` (or point --results "
                            "at the folder that holds them)")
    return ids[-1]


def run_path(root: Path, run_id: str) -> Path:
    """The folder of a run named by id, by ``latest`` or by its path."""
    as_path = Path(run_id)
    if (as_path / "run.json").is_file() and run_id != "latest":
        return as_path
    run_id = resolve_run_id(root, run_id)
    path = root / run_id
    if not (path / "run.json").is_file():
        known = ", ".join(run_ids(root)[-5:])
        raise BadInputError(f"no run {run_id!r} under {root}/ (latest: {known or 'none'}); "
                            "`kvrepro results list` shows them all")
    return path


def load_run(root: Path, run_id: str) -> MatrixRun:
    """run.json plus every build's record and verdicts found on disk, as the records written.

    ``run_id`` may be an id under ``root``, ``latest`` or a run folder's path.
    """
    path = run_path(root, run_id)
    info: RunInfo = _read_record(RunInfo, path / "run.json")
    if info.status == "running" and lifetime.owner_alive(info.owner) is False:
        info = replace(info, status="aborted")  # its kvrepro vanished (SIGKILL, a crash) mid-run
    builds: list[BuildResults] = []
    for name in info.build_order:
        build_dir = path / name
        build = _read_record(BuildRecord, build_dir / "build.json") if (build_dir / "build.json").is_file() else None
        entry = info.builds.get(name, RunBuildEntry())
        default_base = entry.base or info.default_base
        runs: list[RunResult] = []
        manifest: RunManifest | None = None
        for rep in _reps(build_dir):
            if manifest is None and (rep / "manifest.json").is_file():
                try:
                    manifest = _read_record(RunManifest, rep / "manifest.json")
                except ResultsSchemaError:  # damaged: the next repetition's says the same
                    pass
            if (rep / "verdict.json").is_file():
                try:
                    result: RunResult = _read_record(RunResult, rep / "verdict.json")
                except ResultsSchemaError as exc:  # one damaged file: that repetition, not the run
                    result = _damaged(rep, name, default_base, str(exc))
                from ..classify.judge import reattributed  # classify (pydantic) only when a run is read

                runs.append(reattributed(result if result.base else replace(result, base=default_base)))
            elif (unfinished := _unfinished(rep, name, info.status, default_base)) is not None:
                runs.append(unfinished)
        bases = list(dict.fromkeys(r.base or default_base for r in runs)) or [default_base]
        for base in bases:
            builds.append(BuildResults(
                name=name, base=base, patches=entry.patches, build=build,
                runs=tuple(r for r in runs if (r.base or default_base) == base),
                manifest=manifest, expect=info.expect.get(entry.build or name),
                matrix_build=entry.build or name))
    return MatrixRun(info=info, path=path, builds=tuple(builds))


def _unfinished(rep: Path, build: str, run_status: str, base: str) -> RunResult | None:
    """A repetition with files but no verdict.json, as what it left (None: it left nothing)."""
    kept = sorted(p.name for p in rep.iterdir() if p.is_file() and not p.name.startswith("."))
    if not kept:
        return None
    state = "still running" if run_status == "running" else f"run {run_status} before its verdict"
    return RunResult(build=build, rep=int(rep.name), verdict=Verdict.INCOMPLETE, outcome=Outcome.NONE,
                     title=f"no verdict: {state}; kept {', '.join(kept)}", trigger_count=0, external_hit_calls=0,
                     requests=0, seconds=0.0, run_dir=str(rep), base=base)


def _damaged(rep: Path, build: str, base: str, why: str) -> RunResult:
    """A repetition whose verdict.json cannot be read back (truncated, empty, not a verdict)."""
    return RunResult(build=build, rep=int(rep.name), verdict=Verdict.DAMAGED, outcome=Outcome.NONE,
                     title=f"DAMAGED: {why}", trigger_count=0, external_hit_calls=0, requests=0, seconds=0.0,
                     run_dir=str(rep), base=base)
