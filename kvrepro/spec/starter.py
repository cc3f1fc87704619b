"""`kvrepro init`: a starter project from what kvrepro ships.

An installed kvrepro has no clone around it, so the default experiment (matrix.yaml and the
patches it names under builds/) comes from the package (kvrepro.paths.shipped_project). The
known-defect catalogue is read from the package as it is; a copy in the project (defects/)
is written only when asked for, because a copy found there replaces the shipped one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .. import paths
from ..errors import BadInputError
from ..records import StarterProject


def _files_of(source: Path) -> list[Path]:
    """Files under ``source`` (a file or a folder), relative to its parent, hidden ones left out."""
    if source.is_file():
        return [Path(source.name)]
    return sorted(p.relative_to(source.parent) for p in source.rglob("*")
                  if p.is_file() and not any(part.startswith(".") or part == "__pycache__"
                                             for part in p.relative_to(source.parent).parts))


def write_starter(folder: Path, with_catalogue: bool = False, force: bool = False) -> StarterProject:
    """Write the shipped matrix.yaml and builds/ (and defects/ when asked) into ``folder``.

    Nothing is overwritten unless ``force``: an existing file is bad input, named in one line,
    and then nothing at all is written."""
    shipped = paths.shipped_project()
    sources = [shipped / "matrix.yaml", shipped / "builds"] + ([shipped / "defects"] if with_catalogue else [])
    for source in sources:
        if not source.exists():
            raise BadInputError(f"{source}: missing from this kvrepro installation; reinstall kvrepro")
    if folder.exists() and not folder.is_dir():
        raise BadInputError(f"{folder}: is a file; give a folder to write the starter project into")
    relative = [rel for source in sources for rel in _files_of(source)]
    if not force:
        taken = [rel for rel in relative if (folder / rel).exists()]
        if taken:
            more = f" (and {len(taken) - 1} more)" if len(taken) > 1 else ""
            raise BadInputError(f"{folder / taken[0]}: already exists{more}; pass --force to overwrite "
                                "with the shipped files, or init another folder")
    try:
        for rel in relative:
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shipped / rel, folder / rel)
    except OSError as exc:
        raise BadInputError(f"{folder}: cannot write the starter project: {exc.strerror or exc}") from None
    at = "" if folder.resolve() == Path.cwd().resolve() else f"cd {folder} && "
    steps = (f"{at}kvrepro matrix validate",
             f"{at}kvrepro matrix run --build A --reps 1",
             f"{at}kvrepro suite list")
    return StarterProject(folder=folder, written=tuple(relative),
                          catalogue=folder / "defects" if with_catalogue else None, next_steps=steps)


def summary_lines(project: StarterProject) -> list[str]:
    """What `kvrepro init` says: the files it wrote and the commands to run next."""
    return [f"wrote {len(project.written)} files into {project.folder.resolve()}: matrix.yaml, builds/"
            + (", defects/" if project.catalogue else ""),
            "next:\n" + "\n".join(f"  {step}" for step in project.next_steps)]
