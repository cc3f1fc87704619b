"""`kvrepro suite run`: every catalogue entry against each build, through the matrix runner.

Each entry becomes one matrix: the default matrix.yaml with the entry's fragment merged over it,
one build named after the entry (the suite's patch stack, no ``common:``) on each ``--base``.
Entries run side by side (one engine per slot); the runner records every repetition as usual,
in ``results/suite-<id>/runs/<run-id>/``; ``suite.json`` says which run belongs to which entry,
so :func:`load_suite` can judge a recorded suite again (with another catalogue, too).
"""

from __future__ import annotations

import copy
import functools
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from .. import __version__, lifetime, stopping
from ..errors import BadInputError, KvreproError, SpecError
from ..deploy import check_environment, get_target, shares_one_instance
from ..deploy.base import Target
from ..matrix import parse_matrix
from ..matrix.runner import MatrixOptions, Progress, SilentProgress, run_matrix
from ..classify.records import StopRule
from ..records import RecordError, from_jsonable
from ..spec.records import cell_name
from .records import SuiteBuildRecord, SuiteEntryRecord, SuiteRecord
from ..results import store as results
from ..secrets import redact
from ..spec.matrix import DEFAULT_MATRIX, LoadedMatrix
from ..classify.failures import all_failures
from ..report.stack import StackFailure, compare
from ..versions import DEFAULT_BASE, SUPPORTED_RELEASES, unported_note, unsupported
from .catalogue import Catalogue, Entry, EntrySpec, FragmentError, build_key, load_catalogue, parse_build_key
from .judge import Row, judge, not_testable_row, others_of

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
    # `--patch`: each failing entry's failures against its run on the release without the stack
    # (kvrepro/report/stack.py): introduced by the stack, in the base, undecided
    introduced: tuple[StackFailure, ...] = field(default_factory=tuple)

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


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> dict[str, Any]:
    return yaml.safe_load(text)


def _default_matrix() -> tuple[dict[str, Any], Path]:
    """The default matrix's data (a copy: callers merge into it). Parsed once per text: loading the
    catalogue builds every entry's matrix (36 for 19 entries), and pure-Python YAML costs ~20 ms a parse."""
    return copy.deepcopy(_parsed(DEFAULT_MATRIX.read_text())), DEFAULT_MATRIX


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
    loaded = parse_matrix(text, path, data=data)  # text is data's dump: no second parse
    loaded.own_text = False
    return loaded


def _first_taking(spec: EntrySpec, named: list[str]) -> SuiteBuild:
    """The build an entry's fragment is checked on: the first release it names, else the default base,
    else the oldest release that takes it (the capable connector needs 0.28.0+); when none takes it,
    the first candidate, so its error names the field."""
    candidates = [SuiteBuild(r) for r in dict.fromkeys((*named, DEFAULT_BASE, *SUPPORTED_RELEASES))]
    for build in candidates:
        try:
            entry_matrix(spec, [build])
            return build
        except SpecError:
            continue
    return candidates[0]


def check_fragment(spec: EntrySpec) -> None:
    """For load_catalogue: the fragment must make a valid matrix (its errors name the field), checked on
    the first release the entry names (a fragment may need a newer release than the default matrix's,
    e.g. offload load faults need 0.30.0+)."""
    named = [parse_build_key(k)[0] for k in (*spec.present_in, *spec.fixed_in)]
    try:
        entry_matrix(spec, [_first_taking(spec, named)])
    except SpecError as exc:
        lines = [line for line in str(exc).splitlines() if line.strip() and not line.startswith("invalid matrix")]
        m = _PROBLEM.match(lines[0]) if lines else None
        if m:
            raise FragmentError(m["field"], m["msg"]) from None
        raise FragmentError("", str(exc).strip()) from None


def load(folder: Path | None = None) -> Catalogue:
    from .. import paths

    return load_catalogue(folder or paths.default_catalogue(), check_fragment)


def refused_builds(entry: Entry, builds: list[SuiteBuild]) -> dict[str, str]:
    """The builds whose release refuses ``entry``'s matrix (build key -> the one-line reason): e.g.
    offload load faults before 0.30.0 (kvrepro/versions.py). The entry validates on the first release
    it names (the catalogue's check), so a refusal here is the release's: a NOT TESTABLE row, not bad
    input; one entry must not stop a whole-catalogue run on an older release."""
    out: dict[str, str] = {}
    for b in builds if entry.testable else ():
        try:
            entry_matrix(entry, [b])
        except SpecError as exc:
            lines = [line for line in str(exc).splitlines() if line.strip() and not line.startswith("invalid matrix")]
            m = _PROBLEM.match(lines[0]) if lines else None
            # the field, why this release refuses it and what to do (versions.py words both)
            out[b.key] = (f"{m['field']}: {m['msg'].strip()}" if m else (lines[0] if lines else str(exc)).strip())[:300]
    return out


def check_entries(entries: list[Entry], builds: list[SuiteBuild], target: str | None = None) -> dict[str, LoadedMatrix]:
    """Each testable entry's matrix on the builds that take it (:func:`refused_builds`), and what the
    target takes from the environment ($RAY_ADDRESS for ``--target ray``): SpecError (exit 2) before a
    suite folder or a progress bar exists."""
    matrices = {}
    for e in entries:
        if not e.testable:
            continue
        refused = refused_builds(e, builds)
        kept = [b for b in builds if b.key not in refused]
        if kept:
            matrices[e.name] = entry_matrix(e, kept)
    for loaded in matrices.values():
        check_environment(target or loaded.matrix.target, loaded.matrix)
    return matrices


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
    matrices = check_entries(entries, builds, target)  # bad input before anything runs
    folder = root / new_suite_id()
    (folder / RUNS_FOLDER).mkdir(parents=True, exist_ok=False)
    run = _SuiteRun(folder, matrices, reps, target, full_load, progress or SilentProgress(), stop or threading.Event(),
                    stack=bool(builds and builds[0].patches))
    run.save(record=SuiteRecord(
        suite_id=folder.name, status="running", started=time.time(), catalogue=str(catalogue.folder), command=command,
        kvrepro_version=__version__, builds=tuple(SuiteBuildRecord(b.release, b.patches) for b in builds),
        entries={e.name: SuiteEntryRecord(testable=e.testable, reps=max(reps, e.absent_after) if reps else None)
                 for e in entries},
        owner=lifetime.owner()))
    run.run_all([e for e in entries if e.name in matrices], jobs)  # an entry every build refuses: NOT TESTABLE rows only
    return load_suite(folder, catalogue)


class _SuiteRun:
    """One suite run's parts: its record (suite.json, rewritten under a lock after each entry), the
    targets its entries share, one entry's runs (and the same load without the stack when the
    stack's runs failed), and the end (the status written before the teardown)."""

    def __init__(self, folder: Path, matrices: dict[str, LoadedMatrix], reps: int | None, target: str | None,
                 full_load: bool, progress: Progress, stop: threading.Event, stack: bool) -> None:
        self.folder, self.matrices, self.reps, self.target = folder, matrices, reps, target
        self.full_load, self.progress, self.stop, self.stack = full_load, progress, stop, stack
        self.lock = threading.Lock()
        self.record: SuiteRecord | None = None
        self.shared: dict[str, Target] = {}
        self.per_entry = 1

    def save(self, record: SuiteRecord | None = None, **fields: Any) -> None:
        with self.lock:
            self.record = replace(record or self.record, **fields)
            results.write_json(self.folder / SUITE_FILE, self.record)

    def save_entry(self, name: str, **fields: Any) -> None:
        with self.lock:
            record = self.record
            self.record = replace(record, entries={**record.entries, name: replace(record.entries[name], **fields)})
            results.write_json(self.folder / SUITE_FILE, self.record)

    def target_for(self, loaded: LoadedMatrix) -> Target | None:
        """One target for every entry when it can serve them all (kvrepro.deploy.shares_one_instance:
        sim's engine zygote, one per release, torch & co. imported once; ray's connection); each
        entry gets a shallow copy that differs only in the matrix it serves (engine arguments,
        timeouts). Other targets: one per entry (None)."""
        name = self.target or loaded.matrix.target
        if not shares_one_instance(name):
            return None
        with self.lock:
            if name not in self.shared:
                self.shared[name] = get_target(name)(loaded)
            sibling = copy.copy(self.shared[name])
        sibling.loaded = loaded
        return sibling

    def options(self, entry: Entry, full_load: bool) -> MatrixOptions:
        # never fewer repetitions than the entry needs before it may call a build clean
        entry_reps = max(self.reps, entry.absent_after) if self.reps else None
        return MatrixOptions(target=self.target, repetitions=entry_reps, results_root=self.folder / RUNS_FOLDER,
                             jobs=self.per_entry, full_load=full_load, stop_rule=stop_rule_of(entry))

    def one(self, entry: Entry) -> None:
        if self.stop.is_set():
            return
        loaded = self.matrices[entry.name]
        self.progress.stage(f"entry {entry.name} ({entry.kind}) on {', '.join(loaded.matrix.bases)}")
        try:
            run = run_matrix(loaded, self.options(entry, self.full_load or entry.kind == "stall"),
                             self.progress, self.stop, target=self.target_for(loaded))
        except KvreproError as exc:
            self.save_entry(entry.name, error=str(exc).strip().splitlines()[0][:300])
            return
        self.save_entry(entry.name, run=run.run_id)
        if self.stack and not self.stop.is_set() and any(all_failures(r) for r in run.runs()):
            self.without_stack(entry, loaded)

    def without_stack(self, entry: Entry, loaded: LoadedMatrix) -> None:
        """The stack's runs failed: the same entry, load and seeds on the releases without it, its
        whole load, so that what the base does not show reads as introduced by the stack."""
        self.progress.stage(f"entry {entry.name} on {', '.join(loaded.matrix.bases)} without the stack")
        bare = [SuiteBuild(b) for b in loaded.matrix.bases]
        try:
            base_run = run_matrix(entry_matrix(entry, bare), self.options(entry, True), self.progress, self.stop,
                                  target=self.target_for(loaded))
        except KvreproError as exc:
            self.save_entry(entry.name, base_run=None,
                            error=f"without the stack: {str(exc).strip().splitlines()[0]}"[:300])
            return
        self.save_entry(entry.name, base_run=base_run.run_id)

    def run_all(self, testable: list[Entry], jobs: int | None) -> None:
        slots = max(1, jobs or min(4, os.cpu_count() or 1))
        # fewer entries than slots: the spare slots run an entry's repetitions and bases side by side
        self.per_entry = max(1, slots // max(1, min(slots, len(testable))))
        status = "complete"
        try:
            with ThreadPoolExecutor(max_workers=min(slots, max(1, len(testable))),
                                    thread_name_prefix="kvrepro-suite") as pool:
                for future in [pool.submit(self.one, e) for e in testable]:
                    future.result()
            if self.stop.is_set():
                status = "interrupted"
        except BaseException:
            self.stop.set()
            status = "interrupted"
            raise
        finally:
            self.end(status)

    def end(self, status: str) -> None:
        """The status first, then the teardown (closing the zygote takes seconds): a second signal
        during the teardown must not leave suite.json "running" forever. Signals wait while it is
        written (stopping.deferred), so the file is never cut short either."""
        try:
            with stopping.deferred():
                self.save(status=status, finished=time.time())
        finally:
            for target in self.shared.values():
                target.close()


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


_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _read_record(path: Path) -> SuiteRecord:
    """suite.json typed; BadInputError (one line naming the field) for one this kvrepro did not write."""
    def bad(why: str) -> BadInputError:
        return BadInputError(f"{path}: {why}; not a suite record kvrepro wrote (hand-edited, or from another "
                             "kvrepro?): fix or remove it")

    try:
        record = from_jsonable(SuiteRecord, results.read_json(path))
    except RecordError as exc:
        raise bad(f"field {exc.field_path}: {exc.problem}"[:300]) from None
    except (OSError, ValueError) as exc:
        raise bad(f"unreadable ({exc})"[:300]) from None
    for i, b in enumerate(record.builds):
        try:
            parse_build_key(build_key(b.release, b.patches))
        except ValueError as exc:
            raise bad(f"field builds[{i}]: {exc}") from None
    for name, info in record.entries.items():
        if info.run is not None and (not _RUN_ID.match(info.run) or ".." in info.run):
            raise bad(f"field entries.{name[:60]}.run: {info.run[:60]!r} is not a run id (a folder under "
                      f"{RUNS_FOLDER}/)")
    return record



def _recorded_run(folder: Path, run_id: str | None, notes: list[str], label: str):
    """A suite run's recorded matrix run (None: none recorded, or damaged: said in ``notes``)."""
    if not run_id:
        return None
    try:
        return results.load_run(folder / RUNS_FOLDER, run_id)
    except KvreproError as exc:
        notes.append(f"{label}: {exc}")
        return None

def load_suite(path: Path, catalogue: Catalogue, root: Path = results.DEFAULT_ROOT) -> SuiteResult:
    """A recorded suite run judged against ``catalogue`` (the recorded runs are not changed)."""
    folder = _suite_folder(path, root)
    record = _read_record(folder / SUITE_FILE)
    status = record.status
    if status == "running" and lifetime.owner_alive(record.owner) is False:
        status = "aborted"  # its kvrepro vanished (SIGKILL, a crash) mid-suite
    builds = tuple(SuiteBuild(b.release, b.patches) for b in record.builds)
    known = {e.name: e for e in catalogue.entries}
    rows: list[Row] = []
    notes: list[str] = [n for n in dict.fromkeys(unported_note(b.release) for b in builds) if n]
    introduced: list[StackFailure] = []
    for name, info in record.entries.items():
        entry = known.get(name)
        if entry is None:
            notes.append(f"{name}: recorded, but not in {catalogue.folder}; not judged")
            continue
        run = _recorded_run(folder, info.run, notes, name) if entry.testable else None
        try:
            refused = refused_builds(entry, list(builds))
        except KvreproError:  # the matrix.yaml of today lost a patch the run used: judge what was recorded
            refused = {}
        several = len(builds) - len(refused) > 1  # the entry's matrix ran on the builds that take it
        bare = _recorded_run(folder, info.base_run, notes, f"{name} without the stack") if entry.testable else None
        for b in builds:
            if not entry.testable:
                rows.append(not_testable_row(entry, b.key, b.release, b.patches))
                continue
            if b.key in refused:
                rows.append(not_testable_row(entry, b.key, b.release, b.patches, refused[b.key]))
                continue
            cell = run.build(cell_name(entry.name, b.release, several)) if run is not None else None
            runs = list(cell.runs) if cell is not None else []
            error = (cell.build_error if cell is not None else None) or info.error
            if not runs and not error:
                error = "still running" if status == "running" else "not run"
            rows.append(judge(entry, b.key, b.release, b.patches, runs, error, others_of(catalogue, entry)))
            if bare is not None and runs:
                # the stack's failures against the same entry on the release alone (report/stack.py)
                base_cell = bare.build(cell_name(entry.name, b.release, several))
                introduced += [replace(f, build=f"{name} on {b.key}") for f in compare(
                    b.key, runs, b.release, list(base_cell.runs) if base_cell is not None else [])]
    seconds = (record.finished - record.started) if record.finished and record.started else None
    return SuiteResult(suite_id=record.suite_id or folder.name, path=folder, status=status,
                       catalogue=str(catalogue.folder), builds=builds, rows=tuple(rows), seconds=seconds,
                       command=record.command, notes=tuple(redact(n) for n in notes),
                       introduced=tuple(introduced))


def parse_builds(bases: list[str], patches: list[str]) -> list[SuiteBuild]:
    out = []
    for base in bases:
        try:
            release, extra = parse_build_key(base)
        except ValueError as exc:
            raise BadInputError(f"--base {exc}") from None
        if (problem := unsupported(release)) is not None:
            raise BadInputError(f"--base {problem}")
        if extra:
            raise BadInputError(f"--base {base}: give the release alone and the stack with --patch "
                                f"({' '.join('--patch ' + p for p in extra)}); one stack goes on every base")
        out.append(SuiteBuild(release, tuple(patches)))
    if len({b.key for b in out}) != len(out):
        raise BadInputError("--base: a build is listed twice")
    return out
