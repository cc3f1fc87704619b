"""A bisection's steps and answer (bisect.json), as kvrepro.bisect writes them and the report shows
them. Owned by the bisection, kept here because report/ renders them and report comes before
bisect/ in the pipeline (a record in bisect/ would be an import of a later stage).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field


class BisectPoint(typing.Protocol):
    """A point of a bisection (kvrepro.bisect.points: a release, a commit or a patch set)."""

    kind: str

    @property
    def key(self) -> str: ...

    @property
    def label(self) -> str: ...

    def to_json(self) -> dict[str, str | list[str]]: ...


# what a bisection adds about its answer: direction, the last/first points, a commit's subject, per
# patch what removing it does
BisectDetail = typing.Union[str, list[str], dict[str, str]]


@dataclass(frozen=True)
class BisectStep:
    """One point of a bisection and what its runs showed (written after every step).

    ``point`` is what was tried (a :class:`BisectPoint`: a release, a commit or a set of patches);
    ``label`` a short name for it. ``verdict`` is
    good / bad / skip (kvrepro.bisect.rules decides it from ``counts``, the run verdict labels
    seen). ``state`` says for a good point whether the bug's state occurred and was handled
    ("handled"), never occurred ("unreached") or both across runs ("mixed").
    """

    point: BisectPoint
    label: str
    role: str  # "bad end" | "good end" | "midpoint" | "subset" | "complement" | "removal"
    verdict: str
    counts: dict[str, int]
    runs_needed_for_good: int | None  # None at the bad end (it measures p_bad, it is never good)
    state: str | None = None
    reason: str = ""
    probe_runs: tuple[str, ...] = ()  # run folders (under the bisection's probes/) of this point
    seconds: float = 0.0


@dataclass(frozen=True)
class BisectResult:
    """What a bisection found: ``answer`` (release, commit or patch list) or None and ``reason``."""

    kind: str  # "releases" | "commits" | "patches" | "verdict"
    answer: str | list[str] | None
    reason: str
    confidence: float | None
    p_bad: float | None
    alpha: float
    steps: tuple[BisectStep, ...]
    status: str  # "running" | "interrupted" | "complete"
    bisection_id: str = ""
    path: str = ""
    detail: dict[str, BisectDetail] = field(default_factory=dict)
