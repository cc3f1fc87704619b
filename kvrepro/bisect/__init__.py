"""Bisection: which release, commit or patch brought a crash in or took it away.

Three searches share one flaky-aware point rule (:mod:`.rules`) and one resumable session on
disk (:mod:`.session`): over vLLM releases, over commits of a vLLM checkout (each commit's Python
tree on the nearest release's wheel), and delta debugging over a set of candidate patches.
Every probe is an ordinary one-build matrix run by the runner (:mod:`.points`).

Public API: :func:`start`, :func:`resume`, :func:`probe_point`, :class:`Interrupted`, and the
records :class:`kvrepro.report.records.BisectStep` / :class:`kvrepro.report.records.BisectResult`.
"""

from __future__ import annotations

from collections import Counter
import dataclasses
from pathlib import Path

from .. import versions
from ..builds import gitcommit
from ..deploy import builds_commits, with_capability
from ..errors import SpecError
from ..report.records import BisectDetail, BisectResult
from ..matrix import load_matrix
from .points import CommitPoint, PatchSetPoint, Point, PointMatrices, ReleasePoint, releases_between
from .rules import Evidence, PointRule, PointVerdict, default_max_runs, evidence, runs_needed_for_good
from .search import bisect_linear, ddmin, next_midpoint
from .session import BisectionBusy, Interrupted, Session, ensure_idle, is_bisection, load_state, result_from_state
from .state import BisectRequest, SessionState

KINDS = ("releases", "commits", "patches")


def _matrices(request: BisectRequest) -> PointMatrices:
    loaded = load_matrix(request.matrix)
    return PointMatrices(loaded, build=request.build, requests=request.requests, repo=request.repo,
                         wheel=request.wheel)


def check_request(kind: str, request: BisectRequest) -> tuple[BisectRequest, PointMatrices]:
    """The request with everything the search depends on pinned (full shas, patch list), and the
    matrices it probes; SpecError naming the argument when something is wrong."""
    request = dataclasses.replace(request, matrix=str(Path(request.matrix).resolve()))
    matrices = _matrices(request)
    _complete_request(kind, request, matrices)
    return request, matrices


def start(kind: str, request: BisectRequest, root: Path, **session_kw) -> BisectResult:
    """Start a bisection of ``kind``; ``request`` holds the command's arguments (persisted)."""
    request, matrices = check_request(kind, request)
    session = Session.create(root, kind, request, matrices, **session_kw)
    return _drive(session)


def resume(root: Path, bisection_id: str, kind: str | None = None, **session_kw) -> BisectResult:
    """Finish an interrupted bisection: recorded verdicts are replayed, missing runs are run."""
    state = load_state(root, bisection_id)
    if kind is not None and state.kind != kind:
        raise SpecError(f"--resume {bisection_id}: that is a `bisect {state.kind}`, not `bisect {kind}`")
    if state.status == "complete":
        return result_from_state(state, root / state.bisection_id)
    state.status = "running"
    session = Session(root, state, _matrices(state.request), **session_kw)
    return _drive(session)


def _complete_request(kind: str, request: BisectRequest, matrices: PointMatrices) -> None:
    """Check the arguments and pin everything the search depends on (full shas, patch list)."""
    if kind == "releases":
        releases_between(str(request.bad), str(request.good))
    elif kind == "commits":
        _commits_need_sim(request, matrices)
        repo = str(Path(str(request.repo)).resolve())
        request.repo = repo
        matrices.repo = repo
        request.bad = gitcommit.resolve_commit(repo, str(request.bad))
        request.good = gitcommit.resolve_commit(repo, str(request.good))
        if request.bad == request.good:
            raise SpecError("--bad and --good name the same commit; give two different ones")
    elif kind == "patches":
        m = matrices.loaded.matrix
        declared = list(m.patches)
        if request.patches:
            unknown = [p for p in request.patches if p not in m.patches]
            if unknown:
                raise SpecError(f"--patch {', '.join(unknown)}: not declared under patches: in "
                                f"{matrices.loaded.path} (declared: {', '.join(declared)})")
            chosen = set(request.patches)
        else:  # every patch some build uses on top of `common`
            chosen = {p for stack in m.builds.values() for p in stack} - set(m.common)
        request.patches = [p for p in declared if p in chosen and p not in m.common]
        if not request.patches:
            raise SpecError(f"{matrices.loaded.path}: no candidate patches (beyond common:) to bisect; "
                            "name them with --patch")
    else:
        raise SpecError(f"unknown bisection kind {kind!r}; use one of {', '.join(KINDS)}")


def _commits_need_sim(request: BisectRequest, matrices: PointMatrices) -> None:
    target = request.target or matrices.loaded.matrix.target
    if not builds_commits(target):
        able = with_capability(builds_commits)
        raise SpecError(f"--target {target}: commits can only be probed on a target that builds a commit's "
                        f"source ({', '.join(able)}; the docker target assembles images from release wheels "
                        f"only); use --target {able[0]}")


def _drive(session: Session) -> BisectResult:
    kind = session.state.kind
    try:
        if kind == "releases":
            return _linear(session, [ReleasePoint(r) for r in releases_between(str(session.request.bad),
                                                                               str(session.request.good))])
        if kind == "commits":
            return _commits(session)
        return _patches(session)
    except BaseException:
        if session.state.status != "complete":
            session.mark_interrupted()
        raise
    finally:
        session.close()


def _check_ends(session: Session, bad: Point, good: Point, also: list[Point]) -> str | None:
    """Run both ends first (bad end also measures p_bad); a reason when they are not as claimed."""
    session.prefetch([good, *also])
    verdict = session.verdict_of(bad, "bad end", session.end_rule())
    if verdict is PointVerdict.SKIP and _reason(session, bad).startswith("build failed"):
        return f"the bad end {bad.label} could not be built: {_reason(session, bad)}"
    if verdict is not PointVerdict.BAD:
        return (f"the bad end {bad.label} did not show the crash in "
                f"{session.tally(bad).attempts} runs ({_counts(session, bad)})")
    session.measure_p_bad(bad)
    verdict = session.verdict_of(good, "good end", session.point_rule())
    if verdict is PointVerdict.BAD:
        return f"the good end {good.label} is bad too ({_counts(session, good)})"
    if verdict is PointVerdict.SKIP:
        return f"the good end {good.label} could not be decided: {_reason(session, good)}"
    return None


def _reason(session: Session, point: Point) -> str:
    """Why the point's step came out as it did (its step's reason), also on --resume."""
    return next((s.reason for s in reversed(session.steps) if s.point == point), "")


def _counts(session: Session, point: Point) -> str:
    labels = session.tally(point).labels
    return ", ".join(f"{n}x {label}" for label, n in sorted(labels.items())) or "no runs"


def _linear(session: Session, points: list[Point]) -> BisectResult:
    """Points are oldest first; the bad end is the first (a fix is sought) or the last (a regression)."""
    bad_is_older = points[0].names(str(session.request.bad))
    bad, good = (points[0], points[-1]) if bad_is_older else (points[-1], points[0])
    first_mid = next_midpoint(0, len(points) - 1, set())
    reason = _check_ends(session, bad, good, [points[first_mid]] if first_mid is not None else [])
    if reason:
        return session.finish(None, reason)
    old = PointVerdict.BAD if bad_is_older else PointVerdict.GOOD
    rule = session.point_rule()
    outcome = bisect_linear(len(points), old,
                            oracle=lambda i: session.verdict_of(points[i], "midpoint", rule),
                            prefetch=lambda idx: session.prefetch([points[i] for i in idx]))
    changed_to = "good" if bad_is_older else "bad"
    detail: dict[str, BisectDetail] = {"direction": "fixed" if bad_is_older else "introduced",
              "last_" + ("bad" if bad_is_older else "good"): points[outcome.last_old].label,
              "first_" + changed_to: points[outcome.first_new].label}
    if outcome.decided:
        first = points[outcome.first_new]
        return session.finish(first.answer, detail=detail)
    skipped = ", ".join(points[i].label for i in outcome.skipped)
    return session.finish(None, f"the verdict changes between {points[outcome.last_old].label} and "
                                f"{points[outcome.first_new].label}, but {skipped} could not be "
                                "decided (skip)", detail=detail)


def _commits(session: Session) -> BisectResult:
    request = session.request
    repo, bad, good = str(request.repo), str(request.bad), str(request.good)
    older, newer = (bad, good) if gitcommit.is_ancestor(repo, bad, good) else (good, bad)
    shas = gitcommit.commits_between(repo, older, newer)
    result = _linear(session, [CommitPoint(sha) for sha in shas])
    if isinstance(result.answer, str):
        session.state.detail["subject"] = gitcommit.short_subject(repo, result.answer)
        session.save()
        return session.result()
    return result


def _patches(session: Session) -> BisectResult:
    """ddmin over the candidates on the base (matrix base + common): the smallest subset that
    removes the crash, then each candidate removed alone from the full set."""
    candidates: list[str] = list(session.request.patches or ())

    def point(subset: list[str]) -> Point:
        return PatchSetPoint(tuple(p for p in candidates if p in subset))

    reason = _check_ends(session, point([]), point(candidates), [point([c]) for c in candidates])
    if reason:
        return session.finish(None, reason)
    rule = session.point_rule()

    def removes_crash(subset: list[str], role: str = "subset") -> PointVerdict:
        return session.verdict_of(point(subset), role, rule)

    minimal = ddmin(candidates, removes_crash,
                    prefetch=lambda subsets: session.prefetch([point(s) for s in subsets]))
    removal: dict[str, str] = {}
    for patch in candidates:
        subset = [c for c in candidates if c != patch]
        removal[patch] = _effect(session, point(subset), removes_crash(subset, "removal"))
    # what each member of the answer removes: the answer without it (ddmin has run these points
    # to prove the answer 1-minimal, so they come from the record)
    members = {patch: _effect(session, point([c for c in minimal if c != patch]),
                              removes_crash([c for c in minimal if c != patch], "member"))
               for patch in minimal}
    return session.finish(minimal, detail={"without_each": removal, "member_removes": members,
                                           "base": session.matrices.loaded.matrix.bases[0],
                                           "common": list(session.matrices.loaded.matrix.common)})


def _effect(session: Session, point: Point, verdict: PointVerdict) -> str:
    """What a point's runs showed, in words: which bad verdicts came back, or that it stayed clean."""
    tally = session.tally(point)
    if verdict is PointVerdict.BAD:
        title = session.request.title
        bad = [run for run in session.runs_of(point) if evidence(run, title) is Evidence.BAD]
        labels = Counter(r.label + ("+CORRUPT" if r.kv_check == "corrupt" and r.label != "CORRUPT"
                                         and title is None else "") for r in bad)
        return "bad again: " + ", ".join(f"{n}x {label}" for label, n in sorted(labels.items()))
    if verdict is PointVerdict.GOOD:
        return f"still clean ({tally.clean} clean runs, {tally.state})"
    return f"undecided (skip): {_reason(session, point) or _counts(session, point)}"


def probe_point(root: Path, request: BisectRequest, **session_kw) -> tuple[PointVerdict, BisectResult]:
    """One point to a decisive verdict (for `git bisect run`): the commit at the checkout's HEAD,
    a release, or the matrix's base. ``p_bad`` is given instead of measured."""
    request = dataclasses.replace(request, matrix=str(Path(request.matrix).resolve()))
    matrices = _matrices(request)
    point: Point
    if request.repo:
        _commits_need_sim(request, matrices)
        request.repo = str(Path(request.repo).resolve())
        matrices.repo = request.repo
        point = CommitPoint(gitcommit.resolve_commit(request.repo, request.commit or "HEAD"))
    else:
        release = request.release or matrices.loaded.matrix.bases[0]
        if release not in versions.SUPPORTED_RELEASES:  # bad input (128), not a skip (125)
            raise SpecError(f"--release {release}: not a vLLM release kvrepro supports; supported: "
                            f"{', '.join(versions.SUPPORTED_RELEASES)}")
        point = ReleasePoint(release)
    p_bad = request.p_bad if request.p_bad is not None else 0.5
    session = Session.create(root, "verdict", request, matrices, **session_kw)
    session.state.p_bad = p_bad
    needed = runs_needed_for_good(p_bad, request.alpha)
    try:
        verdict = session.verdict_of(point, "point", PointRule(runs_for_good=needed,
                                                               max_runs=request.max_runs or default_max_runs(needed)))
        result = session.finish(verdict.value)
    except BaseException:
        session.mark_interrupted()
        raise
    finally:
        session.close()
    return verdict, result


__all__ = ["BisectRequest", "BisectionBusy", "CommitPoint", "PatchSetPoint", "ReleasePoint", "SessionState", "Interrupted", "ensure_idle", "KINDS", "check_request", "is_bisection", "load_state", "probe_point", "result_from_state", "resume", "start"]
