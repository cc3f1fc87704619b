"""results/suite-<id>/suite.json, read back typed (kvrepro.suite.run.load_suite)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SuiteBuildRecord:
    """One build of a suite run in suite.json: a release and the patch stack on it."""

    release: str
    patches: tuple[str, ...] = ()


@dataclass(frozen=True)
class SuiteEntryRecord:
    """One entry of a suite run in suite.json: the matrix run that ran it (a folder under runs/),
    or the line that stopped it before a run existed."""

    testable: bool = True
    run: str | None = None
    reps: int | None = None
    error: str | None = None
    # `suite run --patch`: the same entry on the releases without the stack, run when the stack's
    # runs failed, so that its failures the base does not show read as introduced by the stack
    base_run: str | None = None


@dataclass(frozen=True)
class SuiteRecord:
    """results/suite-<id>/suite.json, read back typed: a hand-edited or foreign file is one line
    naming the field (kvrepro.suite.run.load_suite), never a traceback or a silent misreading."""

    suite_id: str
    status: str  # "running" | "complete" | "interrupted"; shown "aborted" when running and its owner is gone
    started: float | None = None
    finished: float | None = None
    catalogue: str = ""
    command: str = ""
    kvrepro_version: str = ""
    builds: tuple[SuiteBuildRecord, ...] = ()
    entries: dict[str, SuiteEntryRecord] = field(default_factory=dict)
    # the kvrepro process running it (kvrepro/lifetime.py), as run.json's: a SIGKILLed suite reads aborted
    owner: dict[str, str] | None = None
