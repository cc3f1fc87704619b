"""`kvrepro suite run`: every catalogue entry against each build, through the matrix runner.

Each entry becomes one matrix: the default matrix.yaml with the entry's fragment merged over it,
one build named after the entry (the suite's patch stack, no ``common:``) on each ``--base``.
Entries run side by side (one engine per slot); the runner records every repetition as usual,
in ``results/suite-<id>/runs/<run-id>/``; ``suite.json`` says which run belongs to which entry,
so :func:`load_suite` can judge a recorded suite again (with another catalogue, too).
"""

from __future__ import annotations

import copy
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import __version__
from ..errors import BadInputError, KvreproError, SpecError
from ..deploy import get_target
from ..deploy.base import Target
from ..matrix import parse_matrix
from ..matrix.runner import MatrixOptions, Progress, SilentProgress, run_matrix
from ..records import StopRule, cell_name
from ..results import store as results
from ..spec.matrix import DEFAULT_MATRIX, LoadedMatrix
from .catalogue import Catalogue, Entry, EntrySpec, FragmentError, build_key, load_catalogue, parse_build_key
from .judge import Row, judge, not_testable_row

SUITE_FILE = "suite.json"
RUNS_FOLDER = "runs"


@dataclass(frozen=True)
class SuiteBuild:
    release: str
    patches: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return build_key(self.release, self.patches)


@dataclass(frozen=True)
class SuiteResult:
    suite_id: str
    path: Path
    status: str  # running | complete | interrupted | failed
    catalogue: str
    builds: tuple[SuiteBuild, ...]
    rows: tuple[Row, ...]
    seconds: float | None = None
    command: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def mismatches(self) -> list[Row]:
        return [r for r in self.rows if r.failed]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _default_matrix() -> tuple[dict[str, Any], Path]:
    return yaml.safe_load(DEFAULT_MATRIX.read_text()), DEFAULT_MATRIX


_PROBLEM = re.compile(r"^\s*\S+?(?::\d+)?: (?P<field>[A-Za-z0-9_.]+): (?P<msg>.*)$")


def entry_matrix(entry: Entry | EntrySpec, builds: list[SuiteBuild]) -> LoadedMatrix:
    """The matrix that runs ``entry`` on ``builds`` (all on one patch stack)."""
    fragment = entry.fragment if isinstance(entry, Entry) else entry.matrix
    data, path = _default_matrix()
    fragment = dict(fragment)
    load = fragment.get("load")
    if isinstance(load, dict) and load.get("profile", data["load"].get("profile")) != data["load"].get("profile"):
        # another load profile: the default's profile settings mean nothing to it, so load: is replaced whole
        data["load"] = {}
    data = _merge(data, fragment)
    stacks = {b.patches for b in builds}
    if len(stacks) != 1:
        raise BadInputError("a suite run uses one patch stack on every base")
    stack = list(stacks.pop())
    unknown = [p for p in stack if p not in (data.get("patches") or {})]
    if unknown:
        raise BadInputError(f"--patch {', '.join(unknown)}: not declared under patches: in {path}; "
                            f"declared: {', '.join(data.get('patches') or {})}")
    bases = [b.release for b in builds]
    data.update(base=bases[0] if len(bases) == 1 else bases, common=[], builds={entry.name: stack}, expect={})
    text = (f"# kvrepro suite: defect {entry.name}, merged over {path}\n"
            + yaml.safe_dump(data, sort_keys=False))
    loaded = parse_matrix(text, path)
    loaded.own_text = False
    return loaded


def check_fragment(spec: EntrySpec) -> None:
    """For load_catalogue: the fragment must make a valid matrix (its errors name the field)."""
    try:
        entry_matrix(spec, [SuiteBuild("0.26.0")])
    except SpecError as exc:
        lines = [line for line in str(exc).splitlines() if line.strip() and not line.startswith("invalid matrix")]
        m = _PROBLEM.match(lines[0]) if lines else None
        if m:
            raise FragmentError(m["field"], m["msg"]) from None
        raise FragmentError("", str(exc).strip()) from None


def load(folder: Path | None = None) -> Catalogue:
    from .catalogue import DEFAULT_CATALOGUE

    return load_catalogue(folder or DEFAULT_CATALOGUE, check_fragment)


def new_suite_id() -> str:
    return "suite-" + results.new_run_id()


def stop_rule_of(entry: Entry) -> StopRule:
    """A crash or corruption entry's runs are settled per event of its own path counter (the
    defect's rate per path call bounded, docs/statistics.md); a stall entry runs its whole load."""
    if entry.path_counter in (None, "trigger_count"):
        return StopRule()  # the bug's state per trigger call first: the finer question
    return StopRule(counter=entry.path_counter, path_counter=None)


def run_suite(catalogue: Catalogue, entries: list[Entry], builds: list[SuiteBuild], root: Path,
              reps: int | None = None, jobs: int | None = None, progress: Progress | None = None,
              stop: threading.Event | None = None, command: str = "", target: str | None = None,
              full_load: bool = False) -> SuiteResult:
    """Run ``entries`` on ``builds``; record as it goes; return the judged rows. ``target``: run every
    case there (e.g. ``ray``: each case's runs are Ray tasks) instead of the matrix's target.
    Each run ends once its entry's question is settled (:func:`stop_rule_of`); ``full_load``: at its
    budget, as a stall entry's always do."""
    progress = progress or SilentProgress()
    stop = stop or threading.Event()
    matrices = {e.name: entry_matrix(e, builds) for e in entries if e.testable}  # bad input before anything runs
    suite_id = new_suite_id()
    folder = root / suite_id
    (folder / RUNS_FOLDER).mkdir(parents=True, exist_ok=False)
    started = time.time()
    record: dict[str, Any] = {
        "suite_id": suite_id, "status": "running", "started": started, "catalogue": str(catalogue.folder),
        "command": command, "kvrepro_version": __version__,
        "builds": [{"release": b.release, "patches": list(b.patches)} for b in builds],
        "entries": {e.name: {"testable": e.testable, "run": None,
                             "reps": max(reps, e.absent_after) if reps else None} for e in entries},
    }
    lock = threading.Lock()

    def save() -> None:
        with lock:
            results.write_json(folder / SUITE_FILE, record)

    save()
    slots = max(1, jobs or min(4, os.cpu_count() or 1))
    testable = [e for e in entries if e.testable]
    # fewer entries than slots: the spare slots run an entry's repetitions and bases side by side
    per_entry = max(1, slots // max(1, min(slots, len(testable))))
    shared: dict[str, Target] = {}

    def target_for(loaded: LoadedMatrix) -> Target | None:
        """sim: one target for every entry, so that its engine zygote (one per release: torch & co.
        imported once) serves them all; each entry gets a shallow copy that differs only in the
        matrix it serves (engine arguments, timeouts). Other targets: one per entry (None)."""
        name = target or loaded.matrix.target
        if name != "sim":
            return None
        with lock:
            if name not in shared:
                shared[name] = get_target(name)(loaded)
            sibling = copy.copy(shared[name])
        sibling.loaded = loaded
        return sibling

    def one(entry: Entry) -> None:
        if stop.is_set():
            return
        progress.stage(f"entry {entry.name} ({entry.kind}) on {', '.join(b.key for b in builds)}")
        try:
            loaded = matrices[entry.name]
            # never fewer repetitions than the entry needs before it may call a build clean
            entry_reps = max(reps, entry.absent_after) if reps else None
            run = run_matrix(loaded, MatrixOptions(target=target, repetitions=entry_reps,
                                                   results_root=folder / RUNS_FOLDER,
                                                   jobs=per_entry, full_load=full_load or entry.kind == "stall",
                                                   stop_rule=stop_rule_of(entry)),
                             progress, stop, target=target_for(loaded))
        except KvreproError as exc:
            with lock:
                record["entries"][entry.name]["error"] = str(exc).strip().splitlines()[0][:300]
            save()
            return
        with lock:
            record["entries"][entry.name]["run"] = run.run_id
        save()

    status = "complete"
    try:
        with ThreadPoolExecutor(max_workers=min(slots, max(1, len(testable))), thread_name_prefix="kvrepro-suite") as pool:
            for future in [pool.submit(one, e) for e in testable]:
                future.result()
        if stop.is_set():
            status = "interrupted"
    except BaseException:
        stop.set()
        status = "interrupted"
        raise
    finally:
        for target in shared.values():
            target.close()
        record["status"] = status
        record["finished"] = time.time()
        save()
    return load_suite(folder, catalogue)


def _suite_folder(path: Path, root: Path) -> Path:
    if (path / SUITE_FILE).is_file():
        return path
    if path.name == "latest" or str(path) == "latest":
        found = sorted(d for d in root.glob("suite-*") if (d / SUITE_FILE).is_file()) if root.is_dir() else []
        if not found:
            raise BadInputError(f"no suite run under {root}/; start one with `kvrepro suite run`")
        return found[-1]
    if (root / path / SUITE_FILE).is_file():
        return root / path
    raise BadInputError(f"{path}: not a suite run folder (no {SUITE_FILE}); give results/suite-... or `latest`")


def load_suite(path: Path, catalogue: Catalogue, root: Path = results.DEFAULT_ROOT) -> SuiteResult:
    """A recorded suite run judged against ``catalogue`` (the recorded runs are not changed)."""
    folder = _suite_folder(path, root)
    try:
        record = results.read_json(folder / SUITE_FILE)
        builds = tuple(SuiteBuild(b["release"], tuple(b.get("patches") or ())) for b in record["builds"])
        recorded: dict[str, Any] = record["entries"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInputError(f"{folder / SUITE_FILE}: cannot read it ({exc})") from None
    several = len(builds) > 1
    known = {e.name: e for e in catalogue.entries}
    rows: list[Row] = []
    notes: list[str] = []
    for name, info in recorded.items():
        entry = known.get(name)
        if entry is None:
            notes.append(f"{name}: recorded, but not in {catalogue.folder}; not judged")
            continue
        run = None
        if entry.testable and info.get("run"):
            try:
                run = results.load_run(folder / RUNS_FOLDER, info["run"])
            except KvreproError as exc:
                notes.append(f"{name}: {exc}")
        for b in builds:
            if not entry.testable:
                rows.append(not_testable_row(entry, b.key, b.release, b.patches))
                continue
            cell = run.build(cell_name(entry.name, b.release, several)) if run is not None else None
            runs = list(cell.runs) if cell is not None else []
            error = (cell.build_error if cell is not None else None) or info.get("error")
            if not runs and not error:
                error = "not run" if record.get("status") != "running" else "still running"
            rows.append(judge(entry, b.key, b.release, b.patches, runs, error))
    seconds = (record["finished"] - record["started"]) if record.get("finished") and record.get("started") else None
    return SuiteResult(suite_id=record.get("suite_id", folder.name), path=folder, status=record.get("status", ""),
                       catalogue=str(catalogue.folder), builds=builds, rows=tuple(rows), seconds=seconds,
                       command=record.get("command", ""), notes=tuple(notes))


def parse_builds(bases: list[str], patches: list[str]) -> list[SuiteBuild]:
    out = []
    for base in bases:
        try:
            release, extra = parse_build_key(base)
        except ValueError as exc:
            raise BadInputError(f"--base {exc}") from None
        if extra:
            raise BadInputError(f"--base {base}: give the release alone and the stack with --patch "
                                f"({' '.join('--patch ' + p for p in extra)}); one stack goes on every base")
        out.append(SuiteBuild(release, tuple(patches)))
    if len({b.key for b in out}) != len(out):
        raise BadInputError("--base: a build is listed twice")
    return out
