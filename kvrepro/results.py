"""results/: every run kept, every file written atomically as soon as it is known.

Layout::

    results/<run-id>/run.json               what was run (matrix sha, target, builds), status
    results/<run-id>/matrix.yaml            the matrix as it was
    results/<run-id>/<build>/build.json     the build's manifest, or why it failed
    results/<run-id>/<build>/<rep>/         engine.log, load.jsonl, metrics.txt, manifest.json, verdict.json

A run interrupted by Ctrl-C or a crash keeps every finished repetition; ``run.json`` says
``interrupted`` and ``kvrepro results show`` reports what exists.
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

from .errors import KvreproError
from .records import to_jsonable

DEFAULT_ROOT = Path("results")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write via a temporary sibling + rename: readers see the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
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
    return json.loads(path.read_text())


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
    write_atomic(folder.path / "matrix.yaml", matrix_text)
    folder.update(run_id=folder.run_id, status="running", started=time.time(), **info)
    return folder


def list_runs(root: Path = DEFAULT_ROOT) -> list[dict[str, Any]]:
    runs = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if (d / "run.json").is_file():
                runs.append(load_run(root, d.name))
    return runs


def resolve_run_id(root: Path, run_id: str) -> str:
    if run_id != "latest":
        return run_id
    ids = [d.name for d in sorted(root.iterdir()) if (d / "run.json").is_file()] if root.is_dir() else []
    if not ids:
        raise KvreproError(f"no runs under {root}/; start one with `kvrepro matrix run`")
    return ids[-1]


def load_run(root: Path, run_id: str) -> dict[str, Any]:
    """run.json plus every build's manifest and verdicts found on disk (the truth after a crash)."""
    run_id = resolve_run_id(root, run_id)
    path = root / run_id
    if not (path / "run.json").is_file():
        known = ", ".join(d.name for d in sorted(root.iterdir())[-5:]) if root.is_dir() else ""
        raise KvreproError(f"no run {run_id!r} under {root}/ (latest: {known or 'none'})")
    info = read_json(path / "run.json")
    builds: dict[str, Any] = {}
    for name in info.get("build_order", []):
        build_dir = path / name
        build_info = read_json(build_dir / "build.json") if (build_dir / "build.json").is_file() else {}
        runs = []
        if build_dir.is_dir():
            reps = sorted((d for d in build_dir.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
            for rep in reps:
                if (rep / "verdict.json").is_file():
                    runs.append(read_json(rep / "verdict.json"))
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
