"""A campaign: generated runs, one or several at a time, judged, deduplicated and recorded in order.

Layout (next to matrix runs)::

    results/explore-<id>/explore.json            the state: request, every run, coverage, weights, findings
    results/explore-<id>/runs/<run-id>/          one ordinary matrix run folder per generated run
    results/explore-<id>/findings/<n>-<slug>/    a new (or regressed) failure: its run, trace, draft entry

Each run is a one-build, one-repetition matrix made from the base matrix (the suite's way: the
release and patch stack of ``--base``/``--patch``, no ``common:``, no ``expect:``) and run by the
matrix runner on the campaign's target (sim, or ray: each run a Ray task); one target serves the
whole campaign, so the engine zygote (torch and vLLM imported once per release) is warm for every
run after the first, and a Ray cluster gets the build once. ``--jobs N`` runs N at once; run i's
spec is made from runs 0..i-N (:func:`run_campaign`), so timing never changes a campaign's runs.
"""

from __future__ import annotations

import copy
import fcntl
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from .. import stopping
from ..deploy import check_environment, get_target, known_targets, shares_one_instance
from ..deploy.base import Target
from ..engine.arcs import ENV as ARCS_ENV
from ..engine.arcs import INSTRUMENT as ARCS_INSTRUMENT
from ..errors import BadInputError, KvreproError, SpecError
from ..matrix import parse_matrix
from ..matrix.runner import MatrixOptions, Progress, SilentProgress, run_matrix
from ..records import RunResult, Verdict
from ..results import store as results
from ..spec.matrix import DEFAULT_MATRIX, LoadedMatrix
from ..suite.catalogue import Catalogue, build_key
from ..untrusted import quote
from .coverage import Targets, credit, features, in_target, patch_targets, points, run_arcs, steering
from .findings import minimize_finding
from .generator import ALL, RunSpec, apply, generate, replay, seed_corpus
from ..classify.failures import ending
from . import origin
from .judge import invariant_failures, judge_failure, run_failures
from .state import (CAMPAIGN_SCHEMA, CampaignRequest, CampaignState, FindingRecord, JudgedRecord, ReplayRecord,
                    RunRecord)

STATE_FILE = "explore.json"
LOCK_FILE = "explore.lock"
RUNS_FOLDER = "runs"
REPLAYS_FOLDER = "replays"  # a campaign with patches: its failing runs' specs run again (origin.py)
FINDINGS_FOLDER = "findings"
BUILD = "explore"
_DURATION = re.compile(r"^(?P<n>\d{1,12}(?:\.\d{1,6})?)(?P<unit>s|m|h|d)$")
# a campaign's budget at most (kvrepro's limits, docs/reliability.md): a million runs, 30 days of run time
MAX_BUDGET_RUNS = 1_000_000
MAX_BUDGET_SECONDS = 30 * 86_400.0


def parse_budget(text: str) -> tuple[int | None, float | None]:
    """``--budget``: ``20`` runs, or a duration ``90s``, ``30m``, ``2h``, ``2d`` (run time, resumes
    included); at most MAX_BUDGET_RUNS runs or MAX_BUDGET_SECONDS (bad input beyond, exit 2)."""
    text = text.strip().lower()
    shown = quote(text, 40)
    if text.isdigit() and len(text) <= 12 and int(text) > 0:
        if int(text) > MAX_BUDGET_RUNS:
            raise BadInputError(f"--budget {shown}: at most {MAX_BUDGET_RUNS:,} runs (a limit of kvrepro's, "
                                "docs/reliability.md)")
        return int(text), None
    m = _DURATION.match(text)
    if m and float(m["n"]) > 0:
        seconds = float(m["n"]) * {"s": 1, "m": 60, "h": 3600, "d": 86_400}[m["unit"]]
        if seconds > MAX_BUDGET_SECONDS:
            raise BadInputError(f"--budget {shown}: at most {MAX_BUDGET_SECONDS / 86_400:.0f}d of run time (a limit "
                                "of kvrepro's, docs/reliability.md)")
        return None, seconds
    raise BadInputError(f"--budget '{shown}': give a number of runs (20) or a duration (90s, 30m, 2h, 1d)")


def base_data(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise BadInputError(f"--matrix {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML ({exc}); check it with `kvrepro matrix validate`") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}:1: a matrix is a mapping (base:, builds:, engine:, load:, ...)")
    return data


def run_matrix_for(spec: RunSpec, data: dict[str, Any], request: CampaignRequest, path: Path) -> LoadedMatrix:
    """The one-build, one-repetition matrix of ``spec``; SpecError if the composition is not valid."""
    out = apply(spec, data)
    unknown = [p for p in request.patches if p not in (out.get("patches") or {})]
    if unknown:
        raise BadInputError(f"--patch {', '.join(unknown)}: not declared under patches: in {path}; "
                            f"declared: {', '.join(out.get('patches') or {})}")
    runs = dict(out.get("runs") or {})
    runs.update(repetitions=1, requests=request.requests, duration_s=request.duration_s)
    out.update(base=request.base, common=[], builds={BUILD: list(request.patches)}, expect={}, runs=runs)
    text = (f"# kvrepro explore: run {spec.index} ({spec.describe()}), over {path}\n"
            + yaml.safe_dump(out, sort_keys=False))
    loaded = parse_matrix(text, path)
    loaded.own_text = False
    return loaded


def check_request(request: CampaignRequest) -> LoadedMatrix:
    """Bad input before anything is written: the release has an engine adapter, the patches are the
    matrix's, the base matrix with run 0's (no) changes is valid, the target is one kvrepro has and
    what it takes from the environment ($RAY_ADDRESS) is well formed. Returns run 0's matrix."""
    from ..versions import release

    if release(request.base) is None:
        raise BadInputError(f"--base {request.base}: no GPU-free engine adapter for this release; see "
                            "`kvrepro setup` and kvrepro/versions.py for the supported ones")
    path = Path(request.matrix) if request.matrix else DEFAULT_MATRIX
    loaded = run_matrix_for(RunSpec(index=0), base_data(path), request, path)
    name = target_name(request, loaded)
    if name not in known_targets():
        raise BadInputError(f"--target {name}: not a target; known: {', '.join(known_targets())}")
    check_environment(name, loaded.matrix)
    return loaded


def target_name(request: CampaignRequest, loaded: LoadedMatrix) -> str:
    return request.target or loaded.matrix.target


def open_target(request: CampaignRequest) -> Target:
    """The campaign's target, opened before a campaign folder exists, so that a target that cannot
    serve (no Ray cluster address: exit 2; a cluster not there: exit 3) is one line and writes nothing."""
    loaded = check_request(request)
    return get_target(target_name(request, loaded))(loaded)


def new_campaign(root: Path, request: CampaignRequest) -> tuple[CampaignState, Path]:
    check_request(request)
    campaign_id = "explore-" + results.new_run_id()
    folder = root / campaign_id
    (folder / RUNS_FOLDER).mkdir(parents=True, exist_ok=False)
    state = CampaignState(campaign_id=campaign_id, request=request, started=time.time())
    save(state, folder)
    return state, folder


class CampaignBusy(KvreproError):
    """Another kvrepro is running this campaign right now (exit 2, as a busy bisection)."""

    exit_code = 2


def take_lock(folder: Path, campaign_id: str) -> int:
    """Hold the campaign's lock while this process runs it: an exclusive ``flock`` on ``explore.lock``
    (bisect's model: the kernel drops it however the holder exits, SIGKILL included, so a dead
    campaign never holds it). The holder's pid is written into the file for the message. Returns the
    file descriptor (close it to let go)."""
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # O_CLOEXEC: engines do not inherit it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            pid = os.read(fd, 32).decode(errors="replace").strip() or None
        except OSError:
            pid = None
        os.close(fd)
        who = f"pid {pid}" if pid else "another kvrepro"
        raise CampaignBusy(f"{campaign_id} is still running ({who}); wait for it to finish, or stop it "
                           f"(kill -INT {pid or 'PID'}) and then `kvrepro explore --resume {campaign_id}`") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def save(state: CampaignState, folder: Path) -> None:
    results.write_json(folder / STATE_FILE, state.to_json())


def load_campaign(root: Path, campaign_id: str) -> tuple[CampaignState, Path]:
    """``--resume ID`` (or ``latest``): the saved state; one line if there is none."""
    if campaign_id == "latest":
        found = sorted(d for d in root.glob("explore-*") if (d / STATE_FILE).is_file()) if root.is_dir() else []
        if not found:
            raise BadInputError(f"--resume latest: no campaign under {root}/; start one with `kvrepro explore`")
        folder = found[-1]
    else:
        folder = results.inside(root, root / campaign_id, f"--resume takes a campaign id under {root}/ (or latest)")
    path = folder / STATE_FILE
    if not path.is_file():
        raise BadInputError(f"--resume {campaign_id}: no {STATE_FILE} in {folder}; give an explore-... id "
                            f"under {root}/ or `latest`")
    try:
        data = results.read_json(path)
    except (OSError, ValueError) as exc:
        raise BadInputError(f"{path}: cannot read it ({quote(exc, 160)}); the campaign cannot resume") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != CAMPAIGN_SCHEMA or isinstance(schema, bool):
        what = "no schema marker" if schema is None else f"schema {quote(schema, 20)}"
        raise BadInputError(f"{path}: {what}; this kvrepro resumes campaigns of schema {CAMPAIGN_SCHEMA} (this one "
                            "was written by another kvrepro, or by hand): start a new campaign, or resume it with "
                            "the kvrepro that wrote it")
    try:
        return CampaignState.from_json(data), folder
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BadInputError(f"{path}: not a campaign this kvrepro wrote ({quote(exc, 160)}); the campaign cannot "
                            "resume") from None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "failure"


def _draft_entry(judged: JudgedRecord, loaded: LoadedMatrix, request: CampaignRequest, spec: RunSpec) -> str:
    """A catalogue entry to start from (defects/<name>.yaml): what reached it and where it showed."""
    data = yaml.safe_load(loaded.text) or {}
    fragment = {k: data[k] for k in ("engine", "load") if k in data}
    fragment["runs"] = {"requests": request.requests, "repetitions": 1}
    entry = {
        "name": _slug(judged.key)[:63],
        # an engine invariant has a catalogue kind of its own; the load's request invariant has none
        "kind": judged.kind if judged.kind != "invariant" else ("invariant" if judged.signature else "crash"),
        "title": f"DRAFT: {judged.title}",
        "signature": judged.signature or "TODO: a signature name from `kvrepro signatures` (add one under "
                                         "kvrepro/classify/signatures/ first)",
        "matrix": fragment,
        "present_in": [build_key(request.base, request.patches)],
        "path": {"counter": "requests", "at_least": 1, "means": "TODO: the counter that shows its path ran"},
        "notes": f"found by kvrepro explore run {spec.index}: {spec.describe()}; read it against vLLM's source "
                 "before adding it to defects/",
    }
    return ("# DRAFT written by `kvrepro explore`: not validated; edit, then move to defects/\n"
            + yaml.safe_dump(entry, sort_keys=False))


def _write_finding(folder: Path, state: CampaignState, judged: JudgedRecord, run: RunResult, loaded: LoadedMatrix,
                   spec: RunSpec) -> str:
    name = f"{sum(1 for f in state.findings.values() if f.folder) + 1:03d}-{_slug(judged.key)}"
    target = results.inside(folder / FINDINGS_FOLDER, folder / FINDINGS_FOLDER / name)
    target.mkdir(parents=True, exist_ok=True)
    run_dir = Path(run.run_dir) if run.run_dir else None
    for file in ("trace.jsonl", "load.jsonl", "verdict.json"):
        if run_dir is not None and (run_dir / file).is_file():
            shutil.copyfile(run_dir / file, target / file)
    text = loaded.text
    if judged.kind == "crash" and run.signature is not None:
        # the finding's own crash is the matrix's target: `matrix run` says CRASH(target) when it comes
        # back, and `kvrepro minimize` shrinks toward it (findings.py)
        sig = run.signature
        data = yaml.safe_load(text) or {}
        data["target_signature"] = {"exception": sig.exception, "function": sig.function, "file": sig.file,
                                    **({"expression": sig.expression} if sig.expression else {})}
        text = (f"# kvrepro explore finding: {judged.title}\n"
                + yaml.safe_dump(data, sort_keys=False))
    (target / "matrix.yaml").write_text(text)
    # the patches the matrix declares, next to it, so `kvrepro matrix run -m <finding>/matrix.yaml` runs as is
    for name in loaded.matrix.patches:
        source = loaded.patch_ref(name).path
        copy_to = results.inside(target, target / "builds" / loaded.matrix.patches[name].file)
        copy_to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, copy_to)
    (target / "draft-entry.yaml").write_text(_draft_entry(judged, loaded, state.request, spec))
    results.write_json(target / "finding.json", {
        "key": judged.key, "title": judged.title, "kind": judged.kind, "status": judged.status,
        "entry": judged.entry, "expected": judged.expected, "run_dir": str(run_dir) if run_dir else None,
        "spec": spec.to_json(), "build": build_key(state.request.base, state.request.patches),
        "rerun": f"kvrepro matrix run -m {target / 'matrix.yaml'}"})
    return str(target.relative_to(folder))


def _failure_files(state: CampaignState, folder: Path, data: dict[str, Any], path: Path, became: list[str]) -> None:
    """Findings that became the patch's (origin.py) get a folder if the catalogue had let them pass
    as known, from the run that first showed them; every finding folder's finding.json says whose
    failure it is, with the counts."""
    by_index = {r.spec.index: r for r in state.runs}
    for key in became:
        finding = state.findings[key]
        record = by_index.get(finding.first_run)
        if finding.folder is not None or record is None or not record.run_id:
            continue
        judged = next((j for j in record.failures if j.key == key), None)
        try:
            loaded = run_matrix_for(record.spec, data, state.request, path)
            run = results.load_run(folder / RUNS_FOLDER, record.run_id).build(BUILD).runs[0]
        except (KvreproError, OSError, IndexError, AttributeError):
            continue  # the run folder is gone: the state still lists it as the patch's
        if judged is None:
            continue
        where = _write_finding(folder, state, replace(judged, status="new"), run, loaded, record.spec)
        state.findings[key] = replace(finding, folder=where)
    for finding in state.findings.values():
        record_path = folder / str(finding.folder) / "finding.json" if finding.folder else None
        if record_path is None or not record_path.is_file() or finding.origin is None:
            continue
        data_ = results.read_json(record_path)
        data_.update(origin=finding.origin, status=finding.status, catalogue_status=finding.catalogue_status,
                     with_patches=f"{finding.with_failed}/{finding.with_runs}",
                     without_patches=f"{finding.without_failed}/{finding.without_runs}")
        results.write_json(record_path, data_)


def campaign_targets(loaded: LoadedMatrix, patches: tuple[str, ...]) -> Targets:
    """The lines the campaign's patches change (coverage.patch_targets); none without patches."""
    texts = []
    for name in patches:
        try:
            texts.append(loaded.patch_ref(name).path.read_text(errors="replace"))
        except (OSError, KeyError):
            continue  # the build step names an unreadable patch; here it only loses the aim
    return patch_targets(texts)


def guided_weights(state: CampaignState) -> dict[str, float] | None:
    """What the next run is drawn with: None unguided; guided, the credited weights with the
    values no run has tried yet raised to the best (coverage.steering)."""
    if not state.request.guided:
        return None
    return steering(state.weights, (key for r in state.runs for key in r.spec.keys()))


def campaign_corpus(request: CampaignRequest, catalogue: Catalogue) -> tuple[RunSpec, ...]:
    """The seed corpus a guided campaign starts from: every catalogue entry's engine and load
    fragment (generator.seed_corpus), in an order shuffled by the campaign seed; none unguided,
    with the generic load vocabulary, or with ``corpus`` off."""
    if not (request.guided and request.corpus and request.vocabulary == ALL):
        return ()
    corpus = list(seed_corpus((e.name, e.fragment) for e in catalogue.entries))
    random.Random(f"kvrepro-explore-corpus/{request.seed}").shuffle(corpus)
    return tuple(corpus)


def next_spec(state: CampaignState, index: int, base_profile: str, corpus: tuple[RunSpec, ...] = ()) -> RunSpec:
    """Run ``index``'s spec: runs 1..len(corpus) replay the corpus (syzkaller runs its corpus
    first), then guided runs mutate the closest run or draw fresh by the weights (generate)."""
    request = state.request
    if 0 < index <= len(corpus):
        return replay(request.seed, index, corpus[index - 1])
    return generate(request.seed, index, base_profile, guided_weights(state), request.vocabulary,
                    parent_for(state, index))


def parent_for(state: CampaignState, index: int) -> RunSpec | None:
    """Guided campaigns: every other run (seeded) mutates the earlier run that reached most of the
    target lines (ties: the one whose new features were worth most, then the earliest); the others
    are drawn fresh by the weights. None before a run with changes has come back clean.

    A run that failed is never a parent (AFL does not queue its crashes and hangs): its children
    fail the same way. The 30-minute campaigns of 2026-12-02 15:53 spent 20 of 57 runs on 0.30.0
    and 20 of 56 on 0.33.0 on mutations of one stall of recompute-failed-load-stall's load, known each time."""
    done = [r for r in state.runs if r.run_id and r.verdict not in ("INVALID", "INFRA") and r.spec.index > 0
            and not r.failures]
    if not state.request.guided or not done:
        return None
    if random.Random(f"kvrepro-explore-parent/{state.request.seed}/{index}").random() < 0.5:
        return None
    best = max(done, key=lambda r: (r.target_arcs, r.points, -r.spec.index))
    return best.spec


def record_run(state: CampaignState, folder: Path, catalogue: Catalogue, spec: RunSpec, loaded: LoadedMatrix,
               run: RunResult, run_id: str, targets: Targets | None = None) -> RunRecord:
    """Judge one finished run and fold it into ``state``: findings, coverage, weights."""
    request = state.request
    targets = targets or {}
    failures = run_failures(run) + invariant_failures(Path(run.run_dir) if run.run_dir else folder,
                                                      run.load.stopped_because if run.load else None)
    judged = [JudgedRecord.of(judge_failure(f, catalogue, request.base, request.patches, run,
                                                     spec.seed_entries)) for f in failures]
    arcs = run_arcs(Path(run.run_dir) if run.run_dir else None)
    reached = features(run, [j.key for j in judged]) | arcs
    seen = set(state.coverage)
    new = sorted(reached - seen)
    state.coverage.extend(new)
    worth = points(new, targets)
    if request.guided:
        state.weights = credit(state.weights, spec.keys(), worth)
    for j in judged:
        known = state.findings.get(j.key)
        if known is not None:
            state.findings[j.key] = FindingRecord(**{**known.__dict__, "runs": known.runs + 1})
            continue
        where = _write_finding(folder, state, j, run, loaded, spec) if j.status != "known" else None
        state.findings[j.key] = FindingRecord(key=j.key, kind=j.kind, title=j.title, status=j.status, entry=j.entry,
                                              first_run=spec.index, folder=where)
    return RunRecord(spec=spec, run_id=run_id, verdict=run.label, seconds=run.seconds, failures=tuple(judged),
                     new_features=tuple(new), arcs=len(arcs), target_arcs=sum(1 for a in arcs if in_target(targets, a)),
                     points=worth)


@dataclass
class _Outcome:
    """What one run gave, before it is judged and folded into the state (in the campaign's thread)."""

    spec: RunSpec
    loaded: LoadedMatrix | None = None
    run: RunResult | None = None
    run_id: str | None = None
    record: RunRecord | None = None  # already decided: INVALID or INFRA
    interrupted: bool = False  # not counted: a resume runs the spec again


def _error_line(exc: BaseException) -> str:
    """One line for a run's record: kvrepro's own errors by their sentence, anything else (a bug in
    kvrepro, not in the code under test) by its type too, so that it is not mistaken for a verdict."""
    text = (str(exc).strip() or repr(exc)).splitlines()[0]
    return (text if isinstance(exc, KvreproError) else f"{type(exc).__name__}: {text}")[:300]


def _execute(spec: RunSpec, data: dict[str, Any], request: CampaignRequest, path: Path, target: Target | None,
             name: str, folder: Path, progress: Progress, stop: threading.Event,
             campaign_stop: threading.Event | None = None, runs_folder: str = RUNS_FOLDER) -> _Outcome:
    """One generated run through the matrix runner (in a worker thread when several run at once).

    ``stop`` is this run's own: the matrix runner sets it when the run fails (its other slots stop),
    which must not end the campaign; the campaign sets it when ``campaign_stop`` (a signal, or the
    caller) is set. Only then does an interrupt reach the target the campaign's runs share. Whatever
    the run does, it comes back as an outcome: an error of kvrepro's is an INFRA record naming it."""
    started = time.monotonic()
    campaign_stop = campaign_stop or stop
    try:
        loaded = run_matrix_for(spec, data, request, path)
    except SpecError as exc:  # a composition the spec refuses: recorded, costs a run, never fatal
        return _Outcome(spec, record=RunRecord(spec=spec, run_id=None, verdict="INVALID", seconds=0.0,
                                               error=str(exc).strip().splitlines()[-1][:300]))
    except Exception as exc:  # noqa: BLE001 - recorded, the campaign goes on
        return _Outcome(spec, record=RunRecord(spec=spec, run_id=None, verdict="INFRA", seconds=0.0,
                                               error=_error_line(exc)))
    sibling = None
    if target is not None:
        sibling = copy.copy(target)
        sibling.loaded = loaded
        # the engine reports the branches of the code under test it ran (feedback, coverage.py;
        # kvrepro/engine/branches.py: probes compiled in, about 1.1x the engine's CPU)
        sibling.engine_env = {**getattr(target, "engine_env", {}), ARCS_ENV: ARCS_INSTRUMENT}

        def interrupt(shared: Target = target) -> None:
            # the runner interrupts its target when this run's stop is set; the shared target (its
            # engine zygote, its Ray connection) gives up only when the campaign is stopping
            if campaign_stop.is_set():
                shared.interrupt()

        sibling.interrupt = interrupt  # type: ignore[method-assign]
    try:
        matrix_run = run_matrix(loaded, MatrixOptions(target=name, repetitions=1, jobs=1,
                                                      results_root=folder / runs_folder),
                                progress, stop, target=sibling)
        runs = matrix_run.runs()
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - KvreproError or a bug of kvrepro's: recorded, never fatal
        if campaign_stop.is_set():
            return _Outcome(spec, interrupted=True)
        return _Outcome(spec, record=RunRecord(spec=spec, run_id=None, verdict="INFRA",
                                               seconds=time.monotonic() - started, error=_error_line(exc)))
    if not runs or runs[0].verdict in (Verdict.INTERRUPTED, Verdict.INCOMPLETE, Verdict.DAMAGED):
        if campaign_stop.is_set():
            return _Outcome(spec, interrupted=True)
    if not runs:
        return _Outcome(spec, record=RunRecord(spec=spec, run_id=matrix_run.run_id, verdict="INFRA",
                                               seconds=time.monotonic() - started, error="no repetition recorded"))
    if runs[0].verdict is Verdict.INFRA:
        return _Outcome(spec, record=RunRecord(spec=spec, run_id=matrix_run.run_id, verdict="INFRA",
                                               seconds=runs[0].seconds, error=runs[0].title[:300]))
    return _Outcome(spec, loaded=loaded, run=runs[0], run_id=matrix_run.run_id)


def _replay(spec: RunSpec, build: str, data: dict[str, Any], request: CampaignRequest, path: Path,
            target: Target | None, name: str, folder: Path, progress: Progress,
            stop: threading.Event) -> ReplayRecord | None:
    """``spec`` run once more on the base without the campaign's patches (``base``) or with them
    (``patched``), under <campaign>/replays/; its failure keys, judged as the campaign's own runs
    are. None: the campaign is stopping (it was not recorded)."""
    started = time.monotonic()
    variant = request if build == origin.PATCHED_BUILD else replace(request, patches=())
    outcome = _execute(spec, data, variant, path, target, name, folder, progress, threading.Event(), stop,
                       runs_folder=REPLAYS_FOLDER)
    key = origin.spec_key(spec)
    if outcome.interrupted or stop.is_set():
        return None
    if outcome.record is not None:  # INVALID, INFRA: it says nothing of the failure
        return ReplayRecord(key, build, outcome.record.run_id, outcome.record.verdict,
                            time.monotonic() - started, error=outcome.record.error)
    run = outcome.run
    assert run is not None
    try:
        failures = run_failures(run) + invariant_failures(Path(run.run_dir) if run.run_dir else folder,
                                                          run.load.stopped_because if run.load else None)
    except Exception as exc:  # noqa: BLE001 - a replay kvrepro cannot judge decides nothing
        return ReplayRecord(key, build, str(outcome.run_id), run.label, time.monotonic() - started,
                            error=f"not judged: {_error_line(exc)}")
    return ReplayRecord(key, build, str(outcome.run_id), run.label, time.monotonic() - started,
                        keys=tuple(dict.fromkeys(f.key for f in failures)), ended_by=ending(run))


def _settle_origins(state: CampaignState, folder: Path, data: dict[str, Any], path: Path, target: Target | None,
                    name: str, progress: Progress, stop: threading.Event, eager: bool) -> None:
    """Replay the queued failing runs of a campaign with patches, while the replay share allows
    (origin.may_replay, checked before each run's replays), and judge every failure again.

    ``eager`` (right after a run): only runs with a failure of no origin yet; the others wait for the
    campaign's end, when the rest of the share goes to them in order. A spec already replayed is not
    run again (another run of the same spec, a finding of the same run: one replay serves them)."""
    request = state.request
    if not request.patches:
        return
    while not stop.is_set() and state.replay_queue and origin.may_replay(state):
        record = origin.next_to_replay(state, eager)
        if record is None:
            break
        key = origin.spec_key(record.spec)
        for build in origin.needs(record, state.replays.get(key, {})):
            if stop.is_set():
                break
            what = ("the base without the patches" if build == origin.BASE_BUILD else "the patched build again")
            progress.stage(f"replay of run {record.spec.index} on {what}")
            got = _replay(record.spec, build, data, request, path, target, name, folder, progress, stop)
            if got is None:
                break
            state.replays.setdefault(key, {})[build] = got
            state.replay_s += got.seconds
            save(state, folder)
        if stop.is_set():
            break
        if not origin.needs(record, state.replays.get(key, {})):
            state.replay_queue = [i for i in state.replay_queue if i != record.spec.index]
    became = origin.refresh(state)
    _failure_files(state, folder, data, path, became)
    save(state, folder)


def _may_start(state: CampaignState, index: int) -> bool:
    r = state.request
    if r.budget_runs is not None and index >= r.budget_runs:
        return False
    return not (r.budget_seconds is not None and state.elapsed_s >= r.budget_seconds)


def run_campaign(state: CampaignState, folder: Path, catalogue: Catalogue, progress: Progress | None = None,
                 stop: threading.Event | None = None,
                 on_run: Callable[[RunRecord], None] | None = None, target: Target | None = None,
                 jobs: int | None = None) -> CampaignState:
    """Run until the budget is spent or ``stop`` is set; ``explore.json`` is rewritten after every run.

    Up to ``jobs`` runs (default and at most: the request's pinned ``jobs``) run at once, on
    ``target`` (default: opened here and closed at the end). Runs are recorded in index order.
    The spec of run ``i`` is made when runs ``0 .. i - request.jobs`` are recorded, from the
    weights they left (guided campaigns), and kept in ``state.pending`` until it is recorded: it
    depends on the seed, the index and ``request.jobs`` only, never on which run happened to finish
    first, and a resume runs the pending specs rather than remaking them. With ``jobs`` 1 that is
    run ``i`` made from every run before it."""
    progress = progress or SilentProgress()
    stop = stop or threading.Event()
    request = state.request
    path = Path(request.matrix) if request.matrix else DEFAULT_MATRIX
    data = base_data(path)
    base_profile = str((data.get("load") or {}).get("profile", "partial-prefix"))
    loaded0 = check_request(request)  # a resumed campaign's matrix may have changed since
    name = target_name(request, loaded0)
    lag = max(1, request.jobs)
    slots = max(1, min(jobs or lag, lag))
    targets = campaign_targets(loaded0, request.patches)
    corpus = campaign_corpus(request, catalogue)
    lock = take_lock(folder, state.campaign_id)
    owned = target is None
    pool: ThreadPoolExecutor | None = None
    run_stops: dict[int, threading.Event] = {}  # each run's own stop (_execute), set when `stop` is
    try:
        if target is None:
            target = get_target(name)(loaded0)
        # a target one instance of which serves every run of the campaign (each run a shallow copy
        # holding its matrix, kvrepro.deploy.shares_one_instance); any other is opened per run
        shared = target if shares_one_instance(name) else None
        if shared is not None and slots > 1:
            # the build once, before several runs would each make (ray: pack and ship) it at the same time
            try:
                shared.prepare(loaded0.plans()[0])
            except KvreproError:
                pass  # each run records the build's failure as INFRA, as with one run at a time

        def top_up() -> None:
            # run i is made once runs 0..i-lag are recorded: at most `lag` made and not recorded
            while len(state.pending) < lag:
                index = len(state.runs) + len(state.pending)
                state.pending.append(next_spec(state, index, base_profile, corpus))

        def fold(outcome: _Outcome) -> RunRecord:
            spec = outcome.spec
            if outcome.record is not None:
                record = outcome.record
            else:
                assert outcome.loaded is not None and outcome.run is not None
                try:
                    record = record_run(state, folder, catalogue, spec, outcome.loaded, outcome.run,
                                        str(outcome.run_id), targets)
                except Exception as exc:  # noqa: BLE001 - a run kvrepro cannot judge is recorded as such
                    record = RunRecord(spec=spec, run_id=str(outcome.run_id), verdict=outcome.run.label,
                                       seconds=outcome.run.seconds, error=f"not judged: {_error_line(exc)}")
            state.runs.append(record)
            state.pending.pop(0)
            top_up()
            save(state, folder)
            if request.patches and record.failures:
                # whose failures these are: the spec again on the base without the patches (origin.py)
                state.replay_queue.append(record.spec.index)
                _settle_origins(state, folder, data, path, shared, name, progress, stop, eager=True)
                record = state.runs[-1]  # its failures now say whose they are
            if request.minimize and record.run_id:
                _minimize_new(state, folder, record, progress, stop)
            if on_run is not None:
                on_run(record)
            return record

        state.status = "running"
        top_up()
        save(state, folder)
        pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="kvrepro-explore")
        inflight: dict[int, Future] = {}
        done: dict[int, _Outcome] = {}

        def settle(index: int, future: Future) -> None:
            run_stops.pop(index, None)
            try:
                done[index] = future.result()
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - _execute records what it can; this is the rest
                spec = next(s for s in state.pending if s.index == index)
                done[index] = _Outcome(spec, record=RunRecord(spec=spec, run_id=None, verdict="INFRA", seconds=0.0,
                                                              error=_error_line(exc)))

        while True:
            while state.pending and state.pending[0].index in done and not done[state.pending[0].index].interrupted:
                fold(done.pop(state.pending[0].index))
            if stop.is_set():
                break
            for spec in list(state.pending):
                if len(inflight) >= slots or not _may_start(state, spec.index):
                    break
                if spec.index in inflight or spec.index in done:
                    continue
                progress.stage(f"run {spec.index}: {spec.describe()}")
                run_stops[spec.index] = threading.Event()
                inflight[spec.index] = pool.submit(_execute, spec, data, request, path, shared, name, folder,
                                                   progress, run_stops[spec.index], stop)
            if not inflight:
                break
            ticked = time.monotonic()
            wait(list(inflight.values()), timeout=0.5, return_when=FIRST_COMPLETED)
            state.elapsed_s += time.monotonic() - ticked  # run time: while a run is in flight
            for index in [i for i, f in inflight.items() if f.done()]:
                settle(index, inflight.pop(index))
        # stopped: the runs in flight end as interrupted (the target cancels them); what finished
        # before the first gap is recorded, the rest stays pending for a resume
        for event in run_stops.values():
            event.set()
        for index, future in list(inflight.items()):
            settle(index, future)
            inflight.pop(index)
        while state.pending and state.pending[0].index in done and not done[state.pending[0].index].interrupted:
            fold(done.pop(state.pending[0].index))
        if not stop.is_set():
            # the budget is spent: the failing runs still waiting get the rest of the replay share
            _settle_origins(state, folder, data, path, shared, name, progress, stop, eager=False)
            if request.minimize and state.runs:
                _minimize_new(state, folder, state.runs[-1], progress, stop)  # folders the replays made
        state.status = _ended(stop, state)
    except BaseException as exc:
        stop.set()  # every run in flight records what it has and stops
        for event in run_stops.values():
            event.set()
        state.status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        raise
    finally:
        try:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            with stopping.deferred():
                save(state, folder)
        finally:
            try:
                if owned and target is not None:
                    target.close()
            finally:
                os.close(lock)
    return state


def _ended(stop: threading.Event, state: CampaignState) -> str:
    """How a campaign that returned ended: ``complete`` (its budget spent), ``interrupted`` (a stop
    signal: `--resume` goes on), or ``stopped`` (its caller set ``stop`` before the budget was spent,
    as the planted-bug benchmark does at a find; resumable too). Nothing a run or the minimizer does
    ends a campaign: they are recorded and it goes on."""
    if not (stop.is_set() and state.budget_left()):
        return "complete"
    return "interrupted" if stopping.last_signal() is not None else "stopped"


def rerun_spec(root: Path, request: CampaignRequest, spec: RunSpec, catalogue: Catalogue,
               stop: threading.Event | None = None) -> RunRecord | None:
    """``spec`` run once more, as it was drawn (its changes and seeds), under ``request`` (another
    build, say: the release without a campaign's patches), recorded as a one-run campaign under
    ``root``. The spec goes in as the campaign's pending run, as a resume would run it; None if the
    run was interrupted before it was recorded."""
    state, folder = new_campaign(root, replace(request, budget_runs=spec.index + 1))
    state.pending = [spec]
    stop = stop or threading.Event()
    got: list[RunRecord] = []

    def on_run(record: RunRecord) -> None:
        got.append(record)
        stop.set()  # the one run asked for; the campaign would go on drawing the next

    run_campaign(state, folder, catalogue, stop=stop, on_run=on_run)
    return got[0] if got else None


def _minimize_new(state: CampaignState, folder: Path, record: RunRecord, progress: Progress,
                  stop: threading.Event) -> None:
    """Minimize the findings this run made (not its time budget: minimizing is not exploring).

    Each one ends minimized or marked why not: the minimizer's failures are its note
    (findings.minimize_finding never raises for them), and a stop before or during it says so; a
    resume does not retry it (`kvrepro minimize` on the run does the same by hand)."""
    for key, finding in list(state.findings.items()):
        # a finding's folder may come after its run (the patch's failure a replay decided: origin.py)
        if finding.folder is None or finding.first_run > record.spec.index or finding.minimized is not None:
            continue
        run_id = next((r.run_id for r in state.runs if r.spec.index == finding.first_run), record.run_id)
        if stop.is_set():
            note = (f"not minimized: the campaign was stopped first; `kvrepro minimize {run_id} --build "
                    f"{BUILD} -m {folder / str(finding.folder) / 'matrix.yaml'} --results {folder / RUNS_FOLDER}` "
                    "does it by hand")
        else:
            progress.stage(f"minimizing {finding.folder}")
            try:
                note = minimize_finding(folder, finding, str(run_id), on_line=progress.stage).note
            except KeyboardInterrupt:
                state.findings[key] = FindingRecord(**{**finding.__dict__,
                                                       "minimized": "not minimized: interrupted by a stop signal"})
                raise
            except Exception as exc:  # noqa: BLE001 - minimize_finding notes its own; this is a bug past it
                note = f"not minimized: the minimizer failed ({_error_line(exc)})"
        state.findings[key] = FindingRecord(**{**finding.__dict__, "minimized": note})
        save(state, folder)


def summary(state: CampaignState) -> dict[str, Any]:
    """What `kvrepro explore --json` prints: the state, and the counts a reader wants first."""
    verdicts: dict[str, int] = {}
    for r in state.runs:
        verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
    return {"campaign": state.campaign_id, "status": state.status, "runs": len(state.runs),
            "seconds": round(state.elapsed_s, 1), "verdicts": verdicts, "coverage": len(state.coverage),
            "known": sorted(f.title for f in state.findings.values() if f.status == "known"),
            "new": [f.__dict__ for f in state.new_findings],
            **({"origin": {o: [f.__dict__ for f in fs] for o, fs in origin.grouped(state).items()},
                "replays": origin.cost(state)} if state.request.patches else {}),
            "state": state.to_json()}
