"""`results list` from an index, not by reading every run: ``results/.index.json``.

The index holds, per run folder, the row `results list` shows (id, status, target, base, every
repetition's verdict label) and a *stamp* of what that row was read from: the modification
time and size of ``run.json``, of the run folder, of each build folder, of each repetition
folder and of each ``verdict.json``. Listing stats those (no JSON is parsed) and reads again
only the runs whose stamp changed, so the index stays right however the folder changes:

* a run is added, a repetition finishes (``verdict.json`` is renamed into its folder: the
  folder's mtime changes), a run finishes or is interrupted (``run.json`` is replaced);
* a run folder is deleted or renamed by hand (it is no longer listed, its entry is dropped), a
  file is edited or truncated in place (its own mtime and size change);
* a run that says ``running`` is shown ``aborted`` once its owner process is gone, checked on
  every listing (the owner is kept in the index, see kvrepro/lifetime.py).

The index is a cache: a damaged, missing or foreign one is rebuilt, one that cannot be written
(a read-only results folder) is simply not kept. ``KVREPRO_RESULTS_INDEX=0`` lists by reading
every run, as before (``benchmarks/results_list.py`` compares both).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import lifetime

INDEX_FILE = ".index.json"
VERSION = 2  # 2: rows keyed by folder name (recorded_run_id for copies)


def enabled() -> bool:
    return os.environ.get("KVREPRO_RESULTS_INDEX", "1") not in ("0", "false", "no", "off")


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size]


def _dirs(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return sorted((e for e in it if e.is_dir()), key=lambda e: e.name)
    except OSError:
        return []


def stamp(run_dir: str) -> list[Any]:
    """What a run's row depends on, as cheap stats (no file is read)."""
    parts: list[Any] = [_stat(run_dir), _stat(os.path.join(run_dir, "run.json"))]
    for build in _dirs(run_dir):
        parts.append([build.name, _stat(build.path)])
        for rep in _dirs(build.path):
            if rep.name.isdigit():
                parts.append([rep.name, _stat(rep.path), _stat(os.path.join(rep.path, "verdict.json"))])
    return parts


@dataclass(frozen=True)
class RunRow:
    """One line of `results list`: a readable run (``run_id`` to ``builds``: each cell's verdict
    labels) or an unreadable folder (``status`` "unreadable", ``error`` says why).

    :meth:`to_json` is `results list --json`'s object; :meth:`to_cache` / :meth:`from_cache` the
    index's copy, which also keeps the run's ``owner`` (to tell ``running`` from ``aborted``)."""

    run_id: str | None
    status: str
    target: str = ""
    base: str = ""
    builds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    error: str | None = None
    owner: dict[str, str] | None = None
    # run.json's run id when it is not the folder's name (a copied run folder): ``run_id`` is the
    # folder, the name `results show` takes, so two copies are two rows that say which is which
    recorded_id: str | None = None

    @property
    def unreadable(self) -> bool:
        return self.status == "unreadable"

    def to_json(self) -> dict[str, Any]:
        if self.unreadable:
            return {"run_id": self.run_id, "status": self.status, "error": self.error}
        return {"run_id": self.run_id, "status": self.status, "target": self.target, "base": self.base,
                "builds": {k: list(v) for k, v in self.builds.items()},
                **({"recorded_run_id": self.recorded_id} if self.recorded_id else {})}

    __json__ = to_json

    def to_cache(self) -> dict[str, Any]:
        return {**self.to_json(), "_owner": self.owner}

    @classmethod
    def from_cache(cls, row: dict[str, Any]) -> "RunRow | None":
        """The index's row, or None if it is not one (a foreign or damaged index: read again)."""
        try:
            builds = row.get("builds") or {}
            return cls(run_id=row.get("run_id"), status=str(row["status"]), target=row.get("target") or "",
                       base=row.get("base") or "", error=row.get("error"), owner=row.get("_owner"),
                       recorded_id=row.get("recorded_run_id"),
                       builds={str(k): tuple(str(x) for x in v) for k, v in builds.items()})
        except (KeyError, TypeError, AttributeError, ValueError):
            return None


def read_row(root: Path, run_id: str) -> RunRow:
    """One run's row, read from its files (what a full scan does for every run)."""
    from . import store as results

    try:
        run = results.load_run(root, run_id)
    except results.ResultsSchemaError as exc:
        return RunRow(run_id=None, status="unreadable", error=str(exc))

    def key(build: results.BuildResults) -> str:  # report.build_key, without importing scipy with report
        return f"{build.name}@{build.base}" if sum(b.name == build.name for b in run.builds) > 1 else build.name

    return RunRow(run_id=run.path.name, status=run.status, target=run.info.target, base=run.info.base_text,
                  builds={key(b): tuple(x.label for x in b.runs) for b in run.builds},
                  owner=run.info.owner if run.status in ("running", "aborted") else None,
                  recorded_id=run.run_id if run.run_id != run.path.name else None)


def _load_index(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("runs"), dict):
        return {}
    return data["runs"]


def _save_index(path: Path, runs: dict[str, Any]) -> None:
    from .store import write_atomic

    try:
        write_atomic(path, json.dumps({"version": VERSION, "runs": runs}, separators=(",", ":")))
    except OSError:  # read-only or full: the index is a cache, the listing is right without it
        pass


def _live(row: RunRow) -> RunRow:
    """The row as shown now: ``running`` or ``aborted`` by whether its owner still runs."""
    if row.owner and row.status in ("running", "aborted"):
        return replace(row, status="aborted" if lifetime.owner_alive(row.owner) is False else "running")
    return row


def rows(root: Path, use_index: bool | None = None) -> list[RunRow]:
    """Every run under ``root`` (folders holding a run.json), oldest first, as `results list` rows."""
    use_index = enabled() if use_index is None else use_index
    if not root.is_dir():
        return []
    index_path = root / INDEX_FILE
    cached = _load_index(index_path) if use_index else {}
    fresh: dict[str, Any] = {}
    out = []
    changed = False
    for entry in _dirs(str(root)):
        if not os.path.isfile(os.path.join(entry.path, "run.json")):
            continue
        if not use_index:
            out.append(_live(read_row(root, entry.name)))
            continue
        now = stamp(entry.path)
        hit = cached.get(entry.name)
        row = None
        if isinstance(hit, dict) and hit.get("stamp") == now and isinstance(hit.get("row"), dict):
            row = RunRow.from_cache(hit["row"])
        if row is None:
            row = read_row(root, entry.name)
            changed = True
            # read while it changed under us (a repetition finishing right now): not kept as is
            if stamp(entry.path) != now:
                now = None
        fresh[entry.name] = {"stamp": now, "row": row.to_cache()}
        out.append(_live(row))
    if use_index and (changed or set(fresh) != set(cached)):
        _save_index(index_path, fresh)
    return out


__all__ = ["INDEX_FILE", "RunRow", "enabled", "read_row", "rows", "stamp"]


def omitted_notes(root: Path, listed: list[RunRow]) -> list[str]:
    """What `results list` does not show as a run, one note each (said on stderr: --json stays a list)."""
    from .store import other_folders

    bisections, others = other_folders(root)
    unreadable = sum(1 for r in listed if r.unreadable)
    notes = []
    if unreadable:
        notes.append(f"{unreadable} run(s) listed as unreadable (`kvrepro results show RUN` says why)")
    if bisections:
        notes.append(f"{len(bisections)} bisection(s) not listed: {', '.join(bisections[-5:])} "
                     "(`kvrepro results show bisect-ID`)")
    if others:
        notes.append(f"{len(others)} folder(s) that are not runs (no run.json): {', '.join(others[-5:])}")
    return notes
