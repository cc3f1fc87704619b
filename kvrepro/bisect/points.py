"""What a bisection point is, and the one-build matrix that probes it.

Every point becomes an ordinary matrix (``loaded.matrix.model_copy(update=...)``) with a single
build, run by :func:`kvrepro.matrix.runner.run_matrix`; the bisection never starts an engine itself, so
whatever the runner and targets can run (any release, any target) it can bisect.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import yaml

from .. import versions
from ..builds import gitcommit
from ..errors import SpecError
from ..records import BuildPlan, GitCommitSource
from ..spec.matrix import LoadedMatrix

Point = dict[str, Any]


def point_key(point: Point) -> str:
    if point["kind"] == "release":
        return f"release:{point['release']}"
    if point["kind"] == "commit":
        return f"commit:{point['commit']}"
    return "patches:" + ",".join(point["patches"])


def point_label(point: Point) -> str:
    if point["kind"] == "release":
        return point["release"]
    if point["kind"] == "commit":
        return point["commit"][:12]
    return " + ".join(point["patches"]) or "(none)"


def build_name(point: Point) -> str:
    """The probe build's name in its run folder (letters, digits, '_', '.', '-')."""
    if point["kind"] == "release":
        return point["release"]
    if point["kind"] == "commit":
        return point["commit"][:12]
    name = "_".join(point["patches"]) or "base"
    if len(name) > 64:  # a folder name must stay short: the first patch, how many, and a digest of all
        import hashlib

        digest = hashlib.sha256(",".join(point["patches"]).encode()).hexdigest()[:12]
        name = f"{point['patches'][0][:32]}_and_{len(point['patches']) - 1}_more_{digest}"
    return name


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

    def _stack(self) -> list[str]:
        if self.build is None:
            return []
        return list(self.loaded.matrix.common) + list(self.loaded.matrix.builds[self.build])

    @functools.lru_cache(maxsize=None)
    def wheel_for(self, commit: str) -> str:
        return self.wheel or gitcommit.nearest_release(self.repo, commit)

    def base_of(self, point: Point) -> str:
        if point["kind"] == "release":
            return point["release"]
        if point["kind"] == "commit":
            return self.wheel_for(point["commit"])
        return self.loaded.matrix.bases[0]  # patches are bisected on the matrix's (first) base

    def matrix_for(self, point: Point) -> LoadedMatrix:
        m = self.loaded.matrix
        update: dict[str, Any] = {"base": self.base_of(point), "expect": {}}
        if point["kind"] == "patches":
            update["builds"] = {build_name(point): list(point["patches"])}
        else:
            update["common"] = []
            update["builds"] = {build_name(point): self._stack()}
        if self.requests is not None:
            update["runs"] = m.runs.model_copy(update={"requests": self.requests})
        matrix = m.model_copy(update=update)
        text = (f"# probe of {point_label(point)}, derived from {self.loaded.path}\n"
                + yaml.safe_dump(matrix.model_dump(mode="json"), sort_keys=False))
        if point["kind"] == "commit":
            return _CommitMatrix(self.loaded, matrix, text, GitCommitSource(repo=str(self.repo), commit=point["commit"]))
        derived = LoadedMatrix(matrix, self.loaded.path, text)
        derived.builds_dir = self.loaded.builds_dir
        derived.own_text = False
        return derived
