"""A bisection's saved state (``bisect.json``) as typed records, with explicit (de)serialisation.

The JSON form is the one kvrepro has always written (a request, every point's runs, the steps,
the answer), so bisections recorded before these records existed are read and resumed: keys a
record does not know are ignored, keys it misses take their defaults. Read back the one way
every saved file is (kvrepro.records.from_jsonable, typed field by field), with a reader for
the points (a bisect type records cannot know).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import SpecError
from ..records import RecordError, from_jsonable
from ..report.records import BisectDetail, BisectPoint, BisectStep
from .points import Point, point_from_json
from .rules import RunSummary

Json = object  # a value as json.loads returns it (read through the from_json methods below)


def _point(value: Json, where: str) -> Point:
    try:
        return point_from_json(value)
    except SpecError:
        raise RecordError(where or "point", f"not a bisection point: {value!r}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RecordError(where or "point", f"not a bisection point ({type(exc).__name__}: {exc})") from None


_POINTS = {Point: _point, BisectPoint: _point}


def read(cls: type, value: Json, where: str = "") -> object:
    """``value`` (as json.loads gave it) as the typed record ``cls``: unknown keys skipped, missing
    ones defaulted, points read by kvrepro.bisect.points; RecordError names a wrong field."""
    return from_jsonable(cls, value, where, readers=_POINTS, ignore_unknown=True)


@dataclass
class BisectRequest:
    """The command's arguments, persisted (everything the search depends on pinned: full shas,
    the patch list) so ``--resume`` replays the same search."""

    matrix: str
    alpha: float = 0.05
    calibrate: int = 3
    bad: str | None = None
    good: str | None = None
    build: str | None = None
    target: str | None = None
    title: str | None = None
    max_runs: int | None = None
    requests: int | None = None
    jobs: int | None = None
    repo: str | None = None  # bisect commits / matrix verdict --repo
    wheel: str | None = None
    patches: list[str] | None = None  # bisect patches
    commit: str | None = None  # matrix verdict
    release: str | None = None
    p_bad: float | None = None

    @classmethod
    def from_json(cls, value: Mapping[str, Json]) -> "BisectRequest":
        return read(cls, value, "request")  # type: ignore[return-value]

    def to_json(self) -> dict[str, Json]:
        return dataclasses.asdict(self)


@dataclass
class PointRecord:
    """One point's runs so far, the probe runs they came from, and its verdict once decided."""

    point: Point
    runs: list[RunSummary] = field(default_factory=list)
    probe_runs: list[str] = field(default_factory=list)
    verdict: str | None = None
    build_error: str | None = None

    @classmethod
    def from_json(cls, value: Mapping[str, Json]) -> "PointRecord":
        return read(cls, value, "point")  # type: ignore[return-value]

    def to_json(self) -> dict[str, Json]:
        data: dict[str, Json] = {"point": self.point.to_json(), "runs": [dataclasses.asdict(r) for r in self.runs],
                                 "probe_runs": list(self.probe_runs)}
        if self.build_error is not None:
            data["build_error"] = self.build_error
        if self.verdict is not None:
            data["verdict"] = self.verdict
        return data


def step_from_json(value: Mapping[str, Json]) -> BisectStep:
    return read(BisectStep, value, "step")  # type: ignore[return-value]


def step_to_json(step: BisectStep) -> dict[str, Json]:
    data = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
    data["point"] = step.point.to_json()
    data["probe_runs"] = list(step.probe_runs)
    return data


@dataclass
class SessionState:
    """``bisect.json``: the request, every run per point, the steps, the answer."""

    bisection_id: str
    kind: str  # "releases" | "commits" | "patches" | "verdict"
    request: BisectRequest
    alpha: float
    status: str = "running"  # "running" | "interrupted" | "complete"
    started: float | None = None
    points: dict[str, PointRecord] = field(default_factory=dict)
    steps: list[BisectStep] = field(default_factory=list)
    answer: str | list[str] | None = None
    reason: str = ""
    p_bad: float | None = None
    confidence: float | None = None
    detail: dict[str, BisectDetail] = field(default_factory=dict)
    owner: dict[str, str] | None = None
    finished: float | None = None
    seconds: float | None = None

    @classmethod
    def from_json(cls, value: Json, where: str = "bisect.json") -> "SessionState":
        if not isinstance(value, Mapping):
            raise SpecError(f"{where}: not a bisection's state (expected an object)")
        try:
            request = value["request"]
            # what the dict-era files left out or wrote as null: the request's alpha, an unknown status
            defaults = {"alpha": request.get("alpha", BisectRequest.alpha), "status": "?", "reason": ""}
            filled = {**value, **{k: v for k, v in defaults.items() if value.get(k) is None}}
            return read(cls, filled)  # type: ignore[return-value]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SpecError(f"{where}: not a bisection's state this kvrepro can read ({type(exc).__name__}: {exc})") from None

    def to_json(self) -> dict[str, Json]:
        data: dict[str, Json] = {
            "bisection_id": self.bisection_id, "kind": self.kind, "status": self.status, "started": self.started,
            "request": self.request.to_json(), "points": {k: r.to_json() for k, r in self.points.items()},
            "steps": [step_to_json(s) for s in self.steps], "answer": self.answer, "reason": self.reason,
            "p_bad": self.p_bad, "alpha": self.alpha, "confidence": self.confidence, "detail": self.detail,
        }
        for name in ("owner", "finished", "seconds"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        return data

    def record(self, point: Point) -> PointRecord | None:
        return self.points.get(point.key)
