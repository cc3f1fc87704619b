"""A bisection's saved state (``bisect.json``) as typed records, with explicit (de)serialisation.

The JSON form is the one kvrepro has always written (a request, every point's runs, the steps,
the answer), so bisections recorded before these records existed are read and resumed: keys a
record does not know are ignored, keys it misses take their defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import SpecError
from ..records import BisectDetail, BisectStep
from .points import Point, point_from_json
from .rules import RunSummary

Json = object  # a value as json.loads returns it (read through the from_json methods below)


def _known(cls: type, value: Mapping[str, Json]) -> dict[str, Json]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in value.items() if k in names}


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
        known = _known(cls, value)
        if "patches" in known and known["patches"] is not None:
            known["patches"] = [str(p) for p in known["patches"]]  # type: ignore[union-attr]
        return cls(**known)  # type: ignore[arg-type]

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
        return cls(point=point_from_json(value["point"]),
                   runs=[RunSummary.from_json(r) for r in value.get("runs") or ()],  # type: ignore[union-attr]
                   probe_runs=[str(p) for p in value.get("probe_runs") or ()],  # type: ignore[union-attr]
                   verdict=value.get("verdict"), build_error=value.get("build_error"))  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Json]:
        data: dict[str, Json] = {"point": self.point.to_json(), "runs": [dataclasses.asdict(r) for r in self.runs],
                                 "probe_runs": list(self.probe_runs)}
        if self.build_error is not None:
            data["build_error"] = self.build_error
        if self.verdict is not None:
            data["verdict"] = self.verdict
        return data


def step_from_json(value: Mapping[str, Json]) -> BisectStep:
    known = _known(BisectStep, value)
    known["point"] = point_from_json(value["point"])
    known["probe_runs"] = tuple(value.get("probe_runs") or ())  # type: ignore[arg-type]
    known["counts"] = dict(value.get("counts") or {})  # type: ignore[arg-type]
    return BisectStep(**known)  # type: ignore[arg-type]


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
            request = BisectRequest.from_json(value["request"])
            return cls(
                bisection_id=str(value["bisection_id"]), kind=str(value["kind"]), request=request,
                alpha=float(value.get("alpha", request.alpha)), status=str(value.get("status") or "?"),
                started=value.get("started"),
                points={str(k): PointRecord.from_json(v) for k, v in (value.get("points") or {}).items()},
                steps=[step_from_json(s) for s in value.get("steps") or ()],
                answer=value.get("answer"), reason=str(value.get("reason") or ""), p_bad=value.get("p_bad"),
                confidence=value.get("confidence"), detail=dict(value.get("detail") or {}),
                owner=value.get("owner"), finished=value.get("finished"), seconds=value.get("seconds"),
            )
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
