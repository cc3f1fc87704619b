"""`kvrepro init`: a starter project from what kvrepro ships.

An installed kvrepro has no clone around it, so the default experiment (matrix.yaml and the
patches it names under builds/) comes from the package (kvrepro.paths.shipped_project). The
known-defect catalogue is read from the package as it is; a copy in the project (defects/)
is written only when asked for, because a copy found there replaces the shipped one.

FOLDER is whatever the user named, and may hold links left by anyone: every file is written
through kvrepro/untrusted.py's WriteFolder (never through a link: FOLDER itself a link is refused,
a link in a file's place is "already there", replaced by the file itself with --force, never
followed; a linked sub-folder is refused).
"""

from __future__ import annotations

from pathlib import Path

from .. import paths
from ..errors import BadInputError
from ..untrusted import WriteFolder, quote, writing
from .records import StarterProject


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
    if folder.exists() and not folder.is_dir() and not folder.is_symlink():
        raise BadInputError(f"{quote(folder, 200)}: is a file; give a folder to write the starter project into")
    relative = [rel for source in sources for rel in _files_of(source)]
    with writing(quote(folder, 200), "pass --force to overwrite with the shipped files, or init another folder"), \
            WriteFolder(folder) as out:
        if not force:
            taken = [rel for rel in relative if out.exists(rel)]  # a dangling link is taken too
            if taken:
                more = f" (and {len(taken) - 1} more)" if len(taken) > 1 else ""
                raise BadInputError(f"{quote(folder / taken[0], 200)}: already exists{more}; pass --force to "
                                    "overwrite with the shipped files, or init another folder")
        for rel in relative:
            out.write(rel, (shipped / rel).read_bytes(), replace=force)
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
