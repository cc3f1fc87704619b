"""What one repetition was going to run (``manifest.json``: the build as results record it, its
patches, the engine's arguments, the load), as the runner writes it and a target that runs whole
runs elsewhere completes it. Here, not in results/, because a target (ray) reads and rewrites it:
deploy is the earliest stage that needs it (build.json's BuildRecord, which a manifest holds, with it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..builds.records import BuildManifest
from ..records import OMIT_UNSET, Json


@dataclass(frozen=True)
class PatchInfo:
    """A patch of a build's stack as the results record it (name, where it came from, sha256)."""

    name: str
    upstream: str = ""
    sha256: str = ""
    reverse: bool = field(default=False, metadata=OMIT_UNSET)  # applied in reverse: the build reverts this upstream change


@dataclass(frozen=True)
class BuildRecord:
    """results/<run>/<build>/build.json: the build's artifact, or why it failed.

    ``manifest`` is what the target wrote about the artifact (an overlay's or an image's, a
    :class:`BuildManifest`); the properties below read what every report needs of it.
    """

    ok: bool
    ref: str | None = None
    error: str | None = None
    reused: bool = False
    manifest: BuildManifest = field(default_factory=lambda: BuildManifest())

    @property
    def wheel(self) -> str | None:
        return self.manifest.wheel

    @property
    def wheel_sha256(self) -> str | None:
        return self.manifest.wheel_sha256

    @property
    def probe_sha256(self) -> str | None:
        return self.manifest.probe_hash


@dataclass(frozen=True)
class FsTierFolder:
    """One ``fs`` offload tier of a run: the root_dir the matrix named and the folder of the run's
    own the engine was given instead (kvrepro/spec/fs_tier.py says why), as the engine saw it."""

    tier: int           # index in --kv-transfer-config's secondary_tiers
    configured: str     # root_dir as the matrix wrote it
    engine_root_dir: str  # root_dir the engine got: <run folder>/fs-tier-<tier> (a container path on docker)


@dataclass(frozen=True)
class RunManifest:
    """results/<run>/<build>/<rep>/manifest.json: exactly what one repetition was going to run."""

    build: str
    rep: int
    base: str
    target: str
    patches: tuple[PatchInfo, ...] = ()
    artifact: BuildRecord | None = None
    engine_args: tuple[str, ...] | None = None
    sim_seed: int | None = None
    load_seed: int | None = None
    # The matrix's ``load:`` and ``runs:`` as recorded (LoadSpec / RunsSpec .model_dump()): kept as
    # the raw JSON mapping on purpose. records is the base layer and may not import spec (pydantic)
    # and a manifest must read back whatever a kvrepro of another version recorded there; the
    # report only shows them, and a replay re-validates the trace's own copy (Trace.load_spec).
    load: dict[str, Json] = field(default_factory=dict)
    runs: dict[str, Json] = field(default_factory=dict)
    kvrepro_version: str = ""
    replay_of: str | None = None  # the trace a `kvrepro load replay` sent instead of the matrix's load
    fs_tiers: tuple[FsTierFolder, ...] = ()  # each fs offload tier's folder of this run (engine.extra_args)
    # the target's own part, by target name (as RunResult.by_target: ray's node and placement group)
    by_target: dict[str, Json] = field(default_factory=dict)
