"""The records of the builds stage: a build's artifact and its manifest (what a target wrote about
it), and what vLLM's own tests did on each build
(``kvrepro builds test``, kvrepro/builds/upstream_tests.py).

Frozen dataclasses, written to JSON and read back with :func:`kvrepro.records.to_jsonable` /
:func:`kvrepro.records.from_jsonable`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..records import OMIT_UNSET, REST, Json, fields_from_jsonable, fields_to_jsonable
from ..spec.records import BuildPlan


@dataclass(frozen=True)
class PatchFailure:
    """A hunk that did not apply: names the patch, the file and the hunk."""

    patch: str
    file: str
    hunk: str
    detail: str

    def __str__(self) -> str:
        return f"patch {self.patch}: {self.file}: hunk {self.hunk} does not apply ({self.detail})"


@dataclass(frozen=True)
class ManifestPatch:
    """A patch as a build manifest names it."""

    name: str
    sha256: str
    upstream: str | None = None
    # the build applied it in reverse (reverted the upstream change); written only when set, so
    # manifests of forward builds read and write back as before
    reverse: bool = field(default=False, metadata=OMIT_UNSET)


@dataclass(frozen=True)
class ProbeRef:
    """Where a packaged artifact (a docker image) holds the probe, and its sha256."""

    path: str
    sha256: str


@dataclass(frozen=True)
class BuildManifest:
    """What the target wrote about a build's artifact (``build.json``'s ``manifest``, an overlay's
    ``manifest.json``, a docker image's manifest label).

    Which fields are set depends on the kind of build: a release overlay (kvrepro.builds.overlay),
    a git commit's overlay (kvrepro.builds.gitcommit: ``source``, ``repo``, ``commit``,
    ``from_wheel``), a packaged artifact (``probe``: where it holds the probe), or a failed build
    (``error_kind``). The JSON object is flat: keys this record does not type are kept in ``extra``
    (and written back), so manifests already on disk are read whatever wrote them. A target's own
    keys are among them and typed by the target (a docker image's: its tag, base image, files and
    hosts, kvrepro.deploy.docker.records.ImageManifest), so a new target adds no field here.
    """

    base: str | None = None
    patches: tuple[ManifestPatch, ...] | None = None
    # overlays (the sim target)
    wheel: str | None = None
    wheel_sha256: str | None = None
    probe_sha256: str | None = None
    probe_target_sha256: str | None = None  # what the probe must log as source_sha256 when this code runs
    overlay_key: str | None = None
    overlay_sha256: str | None = None
    created: str | None = None
    # a git commit's overlay
    source: str | None = None
    repo: str | None = None
    commit: str | None = None
    from_wheel: tuple[str, ...] | None = None
    probe: ProbeRef | None = None  # a packaged artifact (an image): where it holds the probe
    # a failed build
    error_kind: str | None = None
    extra: dict[str, Json] = field(default_factory=dict, metadata=REST)  # written flat, after the fields

    __json_omit_unset__ = True  # only the fields that are set are written

    @classmethod
    def from_json(cls, value: Json, where: str = "manifest") -> "BuildManifest":
        """Lenient on purpose: unknown keys go to ``extra``; a known key of the wrong type raises
        :class:`RecordError` naming it; null (a manifest never written) is an empty one."""
        return cls() if value is None else fields_from_jsonable(cls, value, where)

    __json__ = fields_to_jsonable

    @property
    def probe_hash(self) -> str | None:
        """The probe's sha256: an overlay's ``probe_sha256`` or a packaged artifact's ``probe.sha256``."""
        return self.probe_sha256 or (self.probe.sha256 if self.probe is not None else None)


@dataclass(frozen=True)
class BuildArtifact:
    """The result of building one BuildPlan for a target: a runnable engine, or why not.

    ``ref`` names what the target runs: for `sim` the overlay directory holding the patched
    ``vllm`` package and the probe (put in front of the shared runtime env's ``sys.path``), for
    `docker` the image tag. ``error`` is set (and ``ref`` is None) when the build failed; every
    run of that build is then INFRA while the other builds go on.
    """

    plan: BuildPlan
    ref: str | None
    manifest: BuildManifest
    error: str | None = None
    reused: bool = False
    # a host folder holding the build's (patched) ``vllm/`` sources, so the classifier can turn a
    # traceback's file:line into the whole failing statement
    source_root: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ref is not None


# -- vLLM's own tests on each build (kvrepro builds test; kvrepro/builds/upstream_tests.py) ---------


@dataclass(frozen=True)
class CopiedHelper:
    """A helper a patch's upstream test needs, copied from the later release (never edited)."""

    name: str
    release: str
    file: str
    why: str  # "not in vllm 0.26.0's tests/" | "differs from vllm 0.26.0's"


@dataclass(frozen=True)
class UpstreamTestOutcome:
    """What one test did on one tree: passed, failed (with the assertion), error or skipped."""

    nodeid: str  # the id in the release's tests/, or ``vllm <release> <id>`` for a patch's test
    outcome: str  # "passed" | "failed" | "error" | "skipped" | "missing"
    message: str = ""  # the exception line (``AssertionError: assert 41 not in [41, 42]``)
    line: str = ""  # the failing source line, as pytest marks it with ``>``
    patch: str = ""  # the patch whose Upstream-Test this is ("" for the release's own tests)
    seconds: float = 0.0  # setup + call + teardown, as pytest timed them
    spawned: bool = False  # started a process (what it ran is not in coverage data: always run)
    not_run: str = ""  # why this build did not run it and took the release's outcome (impact rule)


@dataclass(frozen=True)
class ExcludedTest:
    """A test of the release left out of every build: it does not pass on the unpatched release."""

    nodeid: str
    why: str  # "skipped: <reason>" | "failed: <assertion>" | "error: <exception>"


@dataclass(frozen=True)
class UpstreamTestChange:
    """A test whose outcome on a build differs from the unpatched release, and which patch of the
    stack changed it (the first stack prefix on which the build's outcome appears)."""

    nodeid: str
    release_outcome: str
    build_outcome: str
    changed_by: str | None  # a patch name; None if no prefix of the stack reproduced it
    stack_position: int | None  # 1-based position of that patch in the build's stack
    message: str = ""
    later: str = ""  # what a newer release changed in the same test ("" when not looked up)


@dataclass(frozen=True)
class ChangedCode:
    """A unit of code a build's patch stack changed, as the test impact rule sees it
    (kvrepro/builds/upstream_impact.py): a function's body, or module-level code of a file."""

    file: str  # vllm/... (or tests/...)
    scope: str  # "function" | "module" | "new file" | "test file" | "other"
    name: str = ""  # the function's qualified name
    note: str = ""
    lines: tuple[int, int] = (0, 0)  # the function body's lines in the release's file


@dataclass(frozen=True)
class UpstreamBuildTests:
    """vLLM's own tests on one build: counts, every outcome, and what differs from the release."""

    build: str
    patches: tuple[str, ...]
    key: str  # the cache key: overlay key + tests + selection
    passed: int
    failed: int
    excluded: int
    outcomes: tuple[UpstreamTestOutcome, ...]
    changes: tuple[UpstreamTestChange, ...] = ()
    seconds: float = 0.0
    cached: bool = False
    error: str | None = None
    ran: int = 0  # tests run on this build; the rest took the release's outcome (``not_run`` says why)
    changed_code: tuple[ChangedCode, ...] = ()  # what the impact rule saw changed


@dataclass(frozen=True)
class PatchTestModule:
    """The module kvrepro wrote for one patch's upstream tests, and what it had to copy."""

    patch: str
    release: str
    tests: tuple[str, ...]
    helpers: tuple[CopiedHelper, ...] = ()
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class UpstreamTestRun:
    """``kvrepro builds test``: the release's CPU-runnable tests and the patches' tests on every build."""

    base: str
    sdist_sha256: str
    roots: tuple[str, ...]
    selected: int  # the release's tests that pass unpatched (run on every build)
    excluded: tuple[ExcludedTest, ...]
    patch_tests: tuple[PatchTestModule, ...]
    release: UpstreamBuildTests  # the unpatched release itself
    builds: tuple[UpstreamBuildTests, ...]
    seconds: float
    command: str = ""
    created: str = ""
    offline_models: tuple[str, ...] = ()  # model configs (config.json only) put in an offline HF hub cache
    impact_rule: bool = False  # builds ran only the tests that reach a change (False: --all)
