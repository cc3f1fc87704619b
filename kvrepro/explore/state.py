"""A campaign's saved state (``explore.json``), typed, rewritten after every run.

Everything the next run depends on is here (the request, the weights, the coverage so far), so
``--resume`` continues where an interrupted campaign stopped and makes the runs it would have made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .generator import RunSpec
from .judge import Failure, Judged


# explore.json's layout; a resume refuses any other (a campaign of another kvrepro resumed silently)
CAMPAIGN_SCHEMA = 1


def _known(cls: type, value: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in value.items() if k in names}


@dataclass(frozen=True)
class CampaignRequest:
    """The command's arguments, pinned."""

    base: str
    patches: tuple[str, ...] = ()
    budget_runs: int | None = None
    budget_seconds: float | None = None
    seed: int = 0
    guided: bool = True
    matrix: str = ""  # the base matrix (default: the repository's matrix.yaml)
    requests: int = 200  # request budget of each run
    duration_s: float = 90.0  # time budget of each run (under load)
    vocabulary: str = "all"  # all | load (generator.py: a generic randomised load, no engine knobs)
    minimize: bool = True  # shrink each new finding's trace and emit its pytest (findings.py)
    target: str = ""  # where the runs run (sim, ray, ...); "": the base matrix's target
    # runs in flight at once, pinned at the start: run i's spec is made from runs 0..i-jobs only
    # (campaign.py), so the same seed and jobs make the same runs however the runs' timing falls
    jobs: int = 1
    # guided campaigns start from the catalogue's entries (generator.seed_corpus); False: from the
    # base matrix alone, the same as unguided (what the corpus adds is measured against it)
    corpus: bool = True
    # the catalogue folder its failures are judged against (absolute), so a resume judges its runs
    # as the first session did; "": a campaign recorded before it was pinned (the default then)
    catalogue: str = ""
    # a campaign with patches replays each failing run's spec on the base without them (and with
    # them again) to tell the patch's failures from the base's (origin.py); the replays may take at
    # most this share of the budget (seconds of a duration budget, runs of a run budget), on top of it
    replay_share: float = 0.5

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> "CampaignRequest":
        known = _known(cls, value)
        known["patches"] = tuple(known.get("patches") or ())
        return cls(**known)


@dataclass(frozen=True)
class JudgedRecord:
    kind: str
    key: str
    title: str
    status: str
    signature: str | None = None
    entry: str | None = None
    expected: str | None = None

    # a campaign with patches: whose failure this is by the replays of this run's spec (origin.py):
    # patch | base | undecided; None: no patches, or not judged yet
    origin: str | None = None

    @classmethod
    def of(cls, judged: Judged) -> "JudgedRecord":
        f = judged.failure
        return cls(f.kind, f.key, f.title, judged.status, f.signature, judged.entry, judged.expected)

    def failure(self) -> Failure:
        return Failure(self.kind, self.key, self.title, self.signature)


@dataclass(frozen=True)
class RunRecord:
    """One run of the campaign: what it changed, where it is recorded, what it showed."""

    spec: RunSpec
    run_id: str | None  # the matrix run under <campaign>/runs/; None: it never started
    verdict: str
    seconds: float
    failures: tuple[JudgedRecord, ...] = ()
    new_features: tuple[str, ...] = ()
    error: str | None = None  # why it could not be judged (an invalid composition, infrastructure)
    arcs: int = 0  # arcs of the code under test the run executed (kvrepro/engine/arcs.py)
    target_arcs: int = 0  # of them, arcs in the lines the campaign's patches change: 0 = not reached
    points: float = 0.0  # what its new features credited (coverage.points)

    def to_json(self) -> dict[str, Any]:
        return {"spec": self.spec.to_json(), "run_id": self.run_id, "verdict": self.verdict,
                "seconds": self.seconds, "failures": [dataclasses.asdict(f) for f in self.failures],
                "new_features": list(self.new_features), "error": self.error, "arcs": self.arcs,
                "target_arcs": self.target_arcs, "points": round(self.points, 3)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> "RunRecord":
        return cls(spec=RunSpec.from_json(value["spec"]), run_id=value.get("run_id"), verdict=value["verdict"],
                   seconds=float(value.get("seconds") or 0.0),
                   failures=tuple(JudgedRecord(**_known(JudgedRecord, f)) for f in value.get("failures") or ()),
                   new_features=tuple(value.get("new_features") or ()), error=value.get("error"),
                   arcs=int(value.get("arcs") or 0), target_arcs=int(value.get("target_arcs") or 0),
                   points=float(value.get("points") or 0.0))


@dataclass(frozen=True)
class FindingRecord:
    """A failure key seen by the campaign: how often, first where, and (new ones) its folder."""

    key: str
    kind: str
    title: str  # the first instance's
    status: str  # new | known | regression
    entry: str | None
    first_run: int
    runs: int = 1
    folder: str | None = None  # findings/<slug> under the campaign (new and regression only)
    minimized: str | None = None  # what minimizing it gave, one line (findings.py); None: not tried
    # a campaign with patches (origin.py): patch (fails with them, never without) | base (the base
    # fails the same way under the same spec) | undecided; the runs of the specs that showed it with
    # the patches (the campaign's runs and their replays) and without them (the base's replays), and
    # how many of each failed so; status is then `new` for the patch's whatever the catalogue says,
    # which catalogue_status keeps
    origin: str | None = None
    with_failed: int = 0
    with_runs: int = 0
    without_failed: int = 0
    without_runs: int = 0
    catalogue_status: str | None = None


@dataclass(frozen=True)
class ReplayRecord:
    """A failing run's spec run once more (origin.py): on the base without the campaign's patches
    (``base``) or with them again (``patched``, for flakiness); the failure keys it showed."""

    spec_key: str
    build: str  # base | patched
    run_id: str | None  # under <campaign>/replays/; None: it never started
    verdict: str
    seconds: float
    keys: tuple[str, ...] = ()
    error: str | None = None
    # the failure that ended it before its load was spent (classify.failures.ending); None: it ran its
    # course. A base replay cut short by a failure the campaign's run did not have says nothing of
    # what that run showed later (origin.run_counts)
    ended_by: str | None = None

    @property
    def judged(self) -> bool:
        """The run says something: it ran and was judged (not INFRA, INVALID or unjudgeable)."""
        return self.run_id is not None and self.verdict not in ("INFRA", "INVALID") and self.error is None

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> "ReplayRecord":
        known = _known(cls, value)
        known["keys"] = tuple(known.get("keys") or ())
        return cls(**known)


@dataclass
class CampaignState:
    campaign_id: str
    request: CampaignRequest
    status: str = "running"  # running | complete | interrupted (a signal) | stopped (by its caller) | failed
    started: float | None = None
    elapsed_s: float = 0.0  # seconds spent in runs, over every session (the DURATION budget)
    runs: list[RunRecord] = field(default_factory=list)
    coverage: list[str] = field(default_factory=list)  # features reached, in the order first reached
    weights: dict[str, float] = field(default_factory=dict)
    findings: dict[str, FindingRecord] = field(default_factory=dict)
    # runs made (their specs fixed) but not recorded yet, in index order: in flight, interrupted, or
    # made ahead for a larger budget (campaign.py); a resume runs these specs, it does not remake them
    pending: list[RunSpec] = field(default_factory=list)
    # a campaign with patches (origin.py): each replayed spec (by origin.spec_key) and build
    # (base | patched) -> its replay; the seconds they took; the failing runs waiting for theirs
    replays: dict[str, dict[str, ReplayRecord]] = field(default_factory=dict)
    replay_s: float = 0.0
    replay_queue: list[int] = field(default_factory=list)

    @property
    def new_findings(self) -> list[FindingRecord]:
        return [f for f in self.findings.values() if f.status != "known"]

    @property
    def introduced(self) -> list[FindingRecord]:
        """A campaign with patches: the failures its patches bring (the base does not show them)."""
        return [f for f in self.findings.values() if f.origin == "patch"]

    @property
    def failing(self) -> list[FindingRecord]:
        """What `--ci` fails on: with patches, what they introduce; without, what the catalogue lacks."""
        return self.introduced if self.request.patches else self.new_findings

    def budget_left(self) -> bool:
        r = self.request
        if r.budget_runs is not None and len(self.runs) >= r.budget_runs:
            return False
        return not (r.budget_seconds is not None and self.elapsed_s >= r.budget_seconds)

    def to_json(self) -> dict[str, Any]:
        return {"schema": CAMPAIGN_SCHEMA,  # what --resume checks first (campaign.load_campaign)
                "campaign_id": self.campaign_id, "request": dataclasses.asdict(self.request), "status": self.status,
                "started": self.started, "elapsed_s": round(self.elapsed_s, 3),
                "runs": [r.to_json() for r in self.runs], "coverage": list(self.coverage),
                "weights": dict(sorted(self.weights.items())),
                "findings": {k: dataclasses.asdict(f) for k, f in self.findings.items()},
                "pending": [p.to_json() for p in self.pending],
                "replays": {k: {b: dataclasses.asdict(r) for b, r in v.items()} for k, v in self.replays.items()},
                "replay_s": round(self.replay_s, 3), "replay_queue": list(self.replay_queue)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> "CampaignState":
        return cls(campaign_id=str(value["campaign_id"]), request=CampaignRequest.from_json(value["request"]),
                   status=str(value.get("status", "interrupted")), started=value.get("started"),
                   elapsed_s=float(value.get("elapsed_s") or 0.0),
                   runs=[RunRecord.from_json(r) for r in value.get("runs") or ()],
                   coverage=[str(c) for c in value.get("coverage") or ()],
                   weights={str(k): float(v) for k, v in (value.get("weights") or {}).items()},
                   findings={str(k): FindingRecord(**_known(FindingRecord, f))
                             for k, f in (value.get("findings") or {}).items()},
                   pending=[RunSpec.from_json(p) for p in value.get("pending") or ()],
                   replays={str(k): {str(b): ReplayRecord.from_json(r) for b, r in v.items()}
                            for k, v in (value.get("replays") or {}).items()},
                   replay_s=float(value.get("replay_s") or 0.0),
                   replay_queue=[int(i) for i in value.get("replay_queue") or ()])
