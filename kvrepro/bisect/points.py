"""What a bisection point is, and the one-build matrix that probes it.

Every point becomes an ordinary matrix (``loaded.matrix.model_copy(update=...)``) with a single
build, run by :func:`kvrepro.matrix.runner.run_matrix`; the bisection never starts an engine itself, so
whatever the runner and targets can run (any release, any target) it can bisect.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass, field

import yaml

from .. import versions
from ..builds import gitcommit
from ..errors import SpecError
from ..spec.records import BuildPlan, GitCommitSource
from ..spec.matrix import LoadedMatrix

class Point:
    """A point of a bisection (mozregression's bisector: one class per kind of point).

    Each kind knows its ``key`` (unique in a bisection's record), its ``label`` (how a person
    reads it), its ``build_name`` (the probe build's folder name), its ``answer`` (what a
    bisection that stops at it reports), and how its one-build matrix is made
    (:meth:`base`, :meth:`stack`, :meth:`source`, used by :class:`PointMatrices`).
    ``to_json``/:func:`point_from_json` are the form ``bisect.json`` has always held
    (``{"kind": "release", "release": ...}``).
    """

    kind: str

    @property
    def key(self) -> str:
        raise NotImplementedError

    @property
    def label(self) -> str:
        raise NotImplementedError

    @property
    def build_name(self) -> str:
        """The probe build's name in its run folder (letters, digits, '_', '.', '-')."""
        return self.label

    @property
    def answer(self) -> str | list[str]:
        raise NotImplementedError

    def names(self, value: str) -> bool:
        """Whether the user's ``--bad``/``--good`` value names this point."""
        return False

    def base(self, matrices: "PointMatrices") -> str:
        raise NotImplementedError

    def stack(self, matrices: "PointMatrices") -> dict[str, object]:
        """The matrix fields that give the point's one build its patch stack."""
        return {"common": [], "builds": {self.build_name: matrices.stack()}}

    def source(self, matrices: "PointMatrices") -> GitCommitSource | None:
        return None

    def to_json(self) -> dict[str, str | list[str]]:
        raise NotImplementedError


@dataclass(frozen=True)
class ReleasePoint(Point):
    """A vLLM release as shipped (or with the chosen build's patch stack)."""

    kind: str = field(default="release", init=False)
    release: str

    @property
    def key(self) -> str:
        return f"release:{self.release}"

    @property
    def label(self) -> str:
        return self.release

    @property
    def answer(self) -> str:
        return self.release

    def names(self, value: str) -> bool:
        return self.release == value

    def base(self, matrices: "PointMatrices") -> str:
        return self.release

    def to_json(self) -> dict[str, str | list[str]]:
        return {"kind": self.kind, "release": self.release}


@dataclass(frozen=True)
class CommitPoint(Point):
    """A commit of a vLLM checkout: its Python tree on the nearest release's wheel."""

    kind: str = field(default="commit", init=False)
    commit: str

    @property
    def key(self) -> str:
        return f"commit:{self.commit}"

    @property
    def label(self) -> str:
        return self.commit[:12]

    @property
    def answer(self) -> str:
        return self.commit

    def names(self, value: str) -> bool:
        return self.commit == value

    def base(self, matrices: "PointMatrices") -> str:
        return matrices.wheel_for(self.commit)

    def source(self, matrices: "PointMatrices") -> GitCommitSource | None:
        return GitCommitSource(repo=str(matrices.repo), commit=self.commit)

    def to_json(self) -> dict[str, str | list[str]]:
        return {"kind": self.kind, "commit": self.commit}


@dataclass(frozen=True)
class PatchSetPoint(Point):
    """A set of candidate patches on the matrix's (first) base and ``common:``."""

    kind: str = field(default="patches", init=False)
    patches: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "patches", tuple(self.patches))

    @property
    def key(self) -> str:
        return "patches:" + ",".join(self.patches)

    @property
    def label(self) -> str:
        return " + ".join(self.patches) or "(none)"

    @property
    def build_name(self) -> str:
        name = "_".join(self.patches) or "base"
        if len(name) > 64:  # a folder name must stay short: the first patch, how many, and a digest of all
            digest = hashlib.sha256(",".join(self.patches).encode()).hexdigest()[:12]
            name = f"{self.patches[0][:32]}_and_{len(self.patches) - 1}_more_{digest}"
        return name

    @property
    def answer(self) -> list[str]:
        return list(self.patches)

    def base(self, matrices: "PointMatrices") -> str:
        return matrices.loaded.matrix.bases[0]  # patches are bisected on the matrix's (first) base

    def stack(self, matrices: "PointMatrices") -> dict[str, object]:
        return {"builds": {self.build_name: list(self.patches)}}  # common: stays

    def to_json(self) -> dict[str, str | list[str]]:
        return {"kind": self.kind, "patches": list(self.patches)}


POINT_KINDS: dict[str, type[Point]] = {"release": ReleasePoint, "commit": CommitPoint, "patches": PatchSetPoint}


def point_from_json(value: object) -> Point:
    """A point as ``bisect.json`` holds it (``{"kind": ..., <kind>: ...}``); SpecError if it is not one."""
    if isinstance(value, Point):
        return value
    if not isinstance(value, dict) or value.get("kind") not in POINT_KINDS:
        raise SpecError(f"not a bisection point: {value!r}")
    if value["kind"] == "release":
        return ReleasePoint(str(value["release"]))
    if value["kind"] == "commit":
        return CommitPoint(str(value["commit"]))
    return PatchSetPoint(tuple(str(p) for p in value["patches"]))


def releases_between(a: str, b: str) -> list[str]:
    """Supported releases from the older of a, b to the newer, oldest first."""
    known = versions.SUPPORTED_RELEASES
    for given in (a, b):
        if given not in known:
            raise SpecError(f"vLLM release {given!r} is not supported; supported: {', '.join(known)}")
    i, j = sorted((known.index(a), known.index(b)))
    if i == j:
        raise SpecError("--bad and --good name the same release; give two different ones")
    return list(known[i:j + 1])


class _CommitMatrix(LoadedMatrix):
    """A matrix whose builds take ``vllm/`` from a git commit (BuildPlan.source)."""

    def __init__(self, base: LoadedMatrix, matrix, text: str, source: GitCommitSource):
        super().__init__(matrix, base.path, text)
        self.builds_dir = base.builds_dir
        self.own_text = False
        self.source = source

    def plans(self, only: list[str] | None = None, bases: list[str] | None = None) -> list[BuildPlan]:
        return [dataclasses.replace(p, source=self.source) for p in super().plans(only, bases)]


class PointMatrices:
    """Turns points into one-build matrices derived from the user's matrix.

    ``build``: a build of the matrix whose patch stack (``common`` first) every point gets;
    None: no patches at all (a release or commit as shipped). ``requests``: overrides
    ``runs.requests`` (smaller budgets for quick bisections).
    """

    def __init__(self, loaded: LoadedMatrix, build: str | None = None, requests: int | None = None,
                 repo: str | None = None, wheel: str | None = None):
        if build is not None and build not in loaded.matrix.builds:
            raise SpecError(f"--build {build}: {loaded.path} defines {', '.join(loaded.matrix.builds)}")
        self.loaded = loaded
        self.build = build
        self.requests = requests
        self.repo = repo
        self.wheel = wheel

    def stack(self) -> list[str]:
        """The patch stack every release or commit point gets (``--build``'s, common first)."""
        if self.build is None:
            return []
        return list(self.loaded.matrix.common) + list(self.loaded.matrix.builds[self.build])

    @functools.lru_cache(maxsize=None)
    def wheel_for(self, commit: str) -> str:
        return self.wheel or gitcommit.nearest_release(self.repo, commit)

    def base_of(self, point: Point) -> str:
        return point.base(self)

    def matrix_for(self, point: Point) -> LoadedMatrix:
        m = self.loaded.matrix
        update: dict[str, object] = {"base": point.base(self), "expect": {}, **point.stack(self)}
        if self.requests is not None:
            update["runs"] = m.runs.model_copy(update={"requests": self.requests})
        matrix = m.model_copy(update=update)
        text = (f"# probe of {point.label}, derived from {self.loaded.path}\n"
                + yaml.safe_dump(matrix.model_dump(mode="json"), sort_keys=False))
        source = point.source(self)
        if source is not None:
            return _CommitMatrix(self.loaded, matrix, text, source)
        derived = LoadedMatrix(matrix, self.loaded.path, text)
        derived.builds_dir = self.loaded.builds_dir
        derived.own_text = False
        return derived
