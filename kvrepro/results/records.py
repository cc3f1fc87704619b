"""results/<run>/run.json, read back typed: what was run, where, and how far it got."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..records import RESULTS_SCHEMA


@dataclass(frozen=True)
class HostInfo:
    """Where kvrepro itself ran (the docker target's engine hosts are in the build manifests)."""

    hostname: str = ""
    platform: str = ""
    python: str = ""
    cpus: int = 0


@dataclass(frozen=True)
class RunBuildEntry:
    """One (base, build) cell as run.json lists it, under its cell name (``A`` or ``A@0.30.0``)."""

    patches: tuple[str, ...] = ()
    base: str | None = None  # default: the run's base
    build: str | None = None  # the matrix's build name (what `expect:` names); default: the cell name


@dataclass(frozen=True)
class RunInfo:
    """results/<run>/run.json: what was run, and how far it got."""

    run_id: str
    status: str  # "running" | "complete" | "interrupted" | "failed" (with ``error``)
    schema: int = RESULTS_SCHEMA
    started: float | None = None
    finished: float | None = None
    matrix: str = ""
    matrix_sha256: str = ""
    target: str = ""
    base: str | tuple[str, ...] = ""  # one release, or every release when the run spans several
    bases: tuple[str, ...] = ()
    repetitions: int = 0  # the most any build runs (with `adaptive`, each stops once decisive)
    adaptive: bool = False
    build_order: tuple[str, ...] = ()
    builds: dict[str, RunBuildEntry] = field(default_factory=dict)
    expect: dict[str, str] = field(default_factory=dict)  # by matrix build name, as matrix.yaml says
    kvrepro_version: str = ""
    host: HostInfo | None = None
    # the kvrepro process running it (kvrepro/lifetime.py): "running" + owner gone = aborted
    owner: dict[str, str] | None = None
    error: str | None = None  # status "failed": what stopped it (a full disk, a read-only folder)

    @property
    def base_text(self) -> str:
        """The release(s) for a title: ``0.26.0`` or ``0.26.0, 0.30.0``."""
        from ..versions import label

        return label(self.base) if isinstance(self.base, str) else ", ".join(label(b) for b in self.base)

    @property
    def default_base(self) -> str:
        """The base of a build that names none: the run's (first) release."""
        if isinstance(self.base, str):
            return self.base
        return self.base[0] if self.base else (self.bases[0] if self.bases else "")
