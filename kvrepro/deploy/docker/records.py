"""The docker target's part of a build manifest: the image it assembled (tag, base image, the files
the patches touched) and each host's copy of it.

Shared records hold no field of a target: a build manifest (``build.json``'s ``manifest``, the
image's manifest label) is one flat JSON object, and the keys of it no shared record types are kept
in :attr:`kvrepro.builds.records.BuildManifest.extra`; :class:`ImageManifest` reads and writes the
docker ones there with the one JSON pair (kvrepro.records.to_jsonable / from_jsonable). Files on
disk keep the shape they always had.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...builds.records import BuildManifest
from ...records import from_jsonable, to_jsonable


@dataclass(frozen=True)
class FileChange:
    """A file a docker build's patches touched: its sha256 before and after (None: added/removed)."""

    before: str | None
    after: str | None


@dataclass(frozen=True)
class ImageRef:
    tag: str
    id: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HostImage:
    """One docker host's copy of a build's image."""

    image_id: str
    reused: bool
    seconds: float




@dataclass(frozen=True)
class ImageManifest:
    """A docker image's keys of its build manifest (kvrepro.deploy.docker.assemble writes them, the
    target adds ``image`` and ``hosts``)."""

    format: int | None = None
    key: str | None = None
    tag: str | None = None
    base_image: str | None = None
    base_image_id: str | None = None
    base_digest: str | None = None
    base_digest_source: str | None = None
    vllm_version_in_base: str | None = None
    python_in_base: str | None = None
    site_dir: str | None = None
    files: dict[str, FileChange] | None = None
    image: ImageRef | None = None
    hosts: dict[str, HostImage] | None = None

    @classmethod
    def of(cls, manifest: BuildManifest, where: str = "manifest") -> "ImageManifest":
        """The docker keys of ``manifest`` (all None for a build of another target), typed; a key
        of the wrong type raises RecordError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        return from_jsonable(cls, {k: v for k, v in manifest.extra.items() if k in names and v is not None}, where)

    def onto(self, manifest: BuildManifest) -> BuildManifest:
        """``manifest`` with these keys set (flat, as the image's label and build.json hold them)."""
        own = {f.name: to_jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)
               if getattr(self, f.name) is not None}
        return dataclasses.replace(manifest, extra={**manifest.extra, **own})
