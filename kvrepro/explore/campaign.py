"""A campaign: generated runs, one at a time, judged, deduplicated and recorded.

Layout (next to matrix runs)::

    results/explore-<id>/explore.json            the state: request, every run, coverage, weights, findings
    results/explore-<id>/runs/<run-id>/          one ordinary matrix run folder per generated run
    results/explore-<id>/findings/<n>-<slug>/    a new (or regressed) failure: its run, trace, draft entry

Each run is a one-build, one-repetition matrix made from the base matrix (the suite's way: the
release and patch stack of ``--base``/``--patch``, no ``common:``, no ``expect:``) and run by the
matrix runner on the sim target; one target serves the whole campaign, so the engine zygote (torch
and vLLM imported once per release) is warm for every run after the first.
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
from pathlib import Path
from typing import Any

import yaml

from ..deploy import get_target
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
from .coverage import Targets, credit, features, in_target, patch_targets, points, run_arcs, steering
from .findings import minimize_finding
from .generator import RunSpec, apply, generate
from .judge import invariant_failures, judge_failure, run_failures
from .state import CampaignRequest, CampaignState, FindingRecord, JudgedRecord, RunRecord

STATE_FILE = "explore.json"
LOCK_FILE = "explore.lock"
RUNS_FOLDER = "runs"
FINDINGS_FOLDER = "findings"
BUILD = "explore"
_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>s|m|h)$")


def parse_budget(text: str) -> tuple[int | None, float | None]:
    """``--budget``: ``20`` runs, or a duration ``90s``, ``30m``, ``2h`` (run time, resumes included)."""
    text = text.strip().lower()
    if text.isdigit() and int(text) > 0:
        return int(text), None
    m = _DURATION.match(text)
    if m and float(m["n"]) > 0:
        return None, float(m["n"]) * {"s": 1, "m": 60, "h": 3600}[m["unit"]]
    raise BadInputError(f"--budget {text!r}: give a number of runs (20) or a duration (90s, 30m, 2h)")


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


def check_request(request: CampaignRequest) -> None:
    """Bad input before anything is written: the release has an engine adapter, the patches are the
    matrix's, the base matrix with run 0's (no) changes is valid."""
    from ..versions import release

    if release(request.base) is None:
        raise BadInputError(f"--base {request.base}: no GPU-free engine adapter for this release; see "
                            "`kvrepro setup` and kvrepro/versions.py for the supported ones")
    path = Path(request.matrix) if request.matrix else DEFAULT_MATRIX
    run_matrix_for(RunSpec(index=0), base_data(path), request, path)


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
        return CampaignState.from_json(results.read_json(path)), folder
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInputError(f"{path}: cannot read it ({exc}); the campaign cannot resume") from None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "failure"


def _draft_entry(judged: JudgedRecord, loaded: LoadedMatrix, request: CampaignRequest, spec: RunSpec) -> str:
    """A catalogue entry to start from (defects/<name>.yaml): what reached it and where it showed."""
    data = yaml.safe_load(loaded.text) or {}
    fragment = {k: data[k] for k in ("engine", "load") if k in data}
    fragment["runs"] = {"requests": request.requests, "repetitions": 1}
    entry = {
        "name": _slug(judged.key)[:63],
        "kind": judged.kind if judged.kind != "invariant" else "crash",
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
    name = f"{len(state.new_findings) + 1:03d}-{_slug(judged.key)}"
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


def parent_for(state: CampaignState, index: int) -> RunSpec | None:
    """Guided campaigns: every other run (seeded) mutates the earlier run that reached most of the
    target lines (ties: the one whose new features were worth most, then the earliest); the others
    are drawn fresh by the weights. None before run 2: no run with changes has come back yet."""
    done = [r for r in state.runs if r.run_id and r.verdict not in ("INVALID", "INFRA") and r.spec.index > 0]
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
    judged = [JudgedRecord.of(judge_failure(f, catalogue, request.base, request.patches, run)) for f in failures]
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


def run_campaign(state: CampaignState, folder: Path, catalogue: Catalogue, progress: Progress | None = None,
                 stop: threading.Event | None = None,
                 on_run: Callable[[RunRecord], None] | None = None) -> CampaignState:
    """Run until the budget is spent or ``stop`` is set; ``explore.json`` is rewritten after every run."""
    progress = progress or SilentProgress()
    stop = stop or threading.Event()
    request = state.request
    path = Path(request.matrix) if request.matrix else DEFAULT_MATRIX
    data = base_data(path)
    base_profile = str((data.get("load") or {}).get("profile", "partial-prefix"))
    check_request(request)  # a resumed campaign's matrix may have changed since
    targets = campaign_targets(run_matrix_for(RunSpec(index=0), data, request, path), request.patches)
    lock = take_lock(folder, state.campaign_id)
    shared: Target | None = None
    try:
        state.status = "running"
        save(state, folder)
        while state.budget_left() and not stop.is_set():
            index = len(state.runs)
            spec = generate(request.seed, index, base_profile, guided_weights(state), request.vocabulary,
                            parent_for(state, index))
            progress.stage(f"run {spec.index}: {spec.describe()}")
            started = time.monotonic()
            try:
                loaded = run_matrix_for(spec, data, request, path)
            except SpecError as exc:  # a composition the spec refuses: recorded, costs a run, never fatal
                record = RunRecord(spec=spec, run_id=None, verdict="INVALID", seconds=0.0,
                                   error=str(exc).strip().splitlines()[-1][:300])
            else:
                if shared is None:
                    shared = get_target("sim")(loaded)
                target = copy.copy(shared)
                target.loaded = loaded
                # the engine reports the branches of the code under test it ran (feedback, coverage.py;
                # kvrepro/engine/branches.py: probes compiled in, about 1.1x the engine's CPU)
                target.engine_env = {**getattr(shared, "engine_env", {}), ARCS_ENV: ARCS_INSTRUMENT}
                try:
                    matrix_run = run_matrix(loaded, MatrixOptions(target="sim", repetitions=1, jobs=1,
                                                                  results_root=folder / RUNS_FOLDER),
                                            progress, stop, target=target)
                    runs = matrix_run.runs()
                except KvreproError as exc:
                    record = RunRecord(spec=spec, run_id=None, verdict="INFRA", seconds=time.monotonic() - started,
                                       error=str(exc).strip().splitlines()[0][:300])
                else:
                    if not runs or runs[0].verdict in (Verdict.INTERRUPTED, Verdict.INCOMPLETE, Verdict.DAMAGED):
                        if stop.is_set():
                            break  # interrupted: the run is not counted, a resume makes it again
                    if not runs:
                        record = RunRecord(spec=spec, run_id=matrix_run.run_id, verdict="INFRA",
                                           seconds=time.monotonic() - started, error="no repetition recorded")
                    elif runs[0].verdict is Verdict.INFRA:
                        record = RunRecord(spec=spec, run_id=matrix_run.run_id, verdict="INFRA",
                                           seconds=runs[0].seconds, error=runs[0].title[:300])
                    else:
                        record = record_run(state, folder, catalogue, spec, loaded, runs[0], matrix_run.run_id,
                                            targets)
            state.elapsed_s += time.monotonic() - started
            state.runs.append(record)
            save(state, folder)
            if request.minimize and record.run_id:
                _minimize_new(state, folder, record, progress, stop)
            if on_run is not None:
                on_run(record)
        state.status = "interrupted" if stop.is_set() and state.budget_left() else "complete"
    except BaseException:
        state.status = "interrupted"
        raise
    finally:
        try:
            if shared is not None:
                shared.close()
            save(state, folder)
        finally:
            os.close(lock)
    return state


def _minimize_new(state: CampaignState, folder: Path, record: RunRecord, progress: Progress,
                  stop: threading.Event) -> None:
    """Minimize the findings this run made (not its time budget: minimizing is not exploring)."""
    for key, finding in list(state.findings.items()):
        if stop.is_set():
            return  # a resume does not retry it: `kvrepro minimize` on the run does the same by hand
        if finding.folder is None or finding.first_run != record.spec.index or finding.minimized is not None:
            continue
        progress.stage(f"minimizing {finding.folder}")
        got = minimize_finding(folder, finding, str(record.run_id), on_line=progress.stage)
        state.findings[key] = FindingRecord(**{**finding.__dict__, "minimized": got.note})
        save(state, folder)


def summary(state: CampaignState) -> dict[str, Any]:
    """What `kvrepro explore --json` prints: the state, and the counts a reader wants first."""
    verdicts: dict[str, int] = {}
    for r in state.runs:
        verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
    return {"campaign": state.campaign_id, "status": state.status, "runs": len(state.runs),
            "seconds": round(state.elapsed_s, 1), "verdicts": verdicts, "coverage": len(state.coverage),
            "known": sorted(f.title for f in state.findings.values() if f.status == "known"),
            "new": [f.__dict__ for f in state.new_findings], "state": state.to_json()}
