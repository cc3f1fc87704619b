"""``kvrepro release check X``: the release-day pipeline in one command.

What a vLLM release manager or a platform team runs when a release lands, in this order (each stage
timed; a later stage runs even when an earlier one found something, so the report is whole):

1. **fetch** -- the wheel and the sdist of ``X`` and of the release before it (the package index, or
   ``KVREPRO_INDEX_URL``);
2. **port** -- the static reading of ``X`` against the release it is compared with
   (:func:`kvrepro.release.porting.read_release`); an unported ``X`` runs with the newest entry's
   settings, and a suite row that ends INFRA is reduced to the porting step it needs;
3. **suite** -- every catalogue entry on ``X`` with the previous release beside it (one suite run,
   two builds, the same load);
4. **tests** -- ``X``'s own CPU-runnable unit tests (tests/v1/core, tests/v1/kv_connector/unit) with the
   upstream tests of the catalogue's fixes (the default matrix's patches), and the same on the
   previous release (``kvrepro builds test``'s machinery, cached per tree);
5. **explore** -- a campaign of the given budget on ``X``;
6. **changes** (:mod:`.changes`): entries newly present or fixed, rows that differ from the
   catalogue, new findings, tests that changed outcome; with ``--repo`` (a vLLM git checkout) each
   changed crash or corruption verdict is bisected to the commit (``kvrepro bisect commits``).

The report is one folder (``results/release-X-<stamp>/``: release.json, report.md, junit.xml when
asked); the exit code is :func:`exit_code`'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from .. import paths, versions
from ..errors import BadInputError, KvreproError
from . import changes as change_report
from . import porting
from .port import check_release, compared_release

STAGES = ("fetch", "port", "suite", "tests", "explore", "bisect")
REPORT_JSON, REPORT_MD, JUNIT = "release.json", "report.md", "junit.xml"


@dataclass
class Stage:
    name: str
    status: str = "pending"  # pending | ok | found | failed | skipped | interrupted
    seconds: float = 0.0
    summary: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReleaseCheck:
    release: str
    previous: str | None
    unported: bool
    folder: Path
    started: float
    stages: dict[str, Stage] = field(default_factory=lambda: {name: Stage(name) for name in STAGES})
    changes: change_report.Changes | None = None
    status: str = "running"
    seconds: float = 0.0
    command: str = ""

    def as_json(self) -> dict[str, Any]:
        from ..records import to_jsonable

        return {"release": self.release, "previous": self.previous, "unported": self.unported,
                "label": versions.label(self.release), "status": self.status, "seconds": round(self.seconds, 1),
                "folder": str(self.folder), "command": self.command,
                "stages": {n: {**to_jsonable(s.detail), "status": s.status, "seconds": round(s.seconds, 1),
                               "summary": s.summary} for n, s in self.stages.items()},
                "changes": to_jsonable(self.changes) if self.changes else None}


def check_options(release: str, budget: str, repo: Path | None, junit: Path | None) -> None:
    """Bad input before anything is fetched (exit 2)."""
    from ..explore import parse_budget

    check_release(release)
    if compared_release(release) is None:
        raise BadInputError(f"release {release}: the oldest release kvrepro knows has no previous one to compare with")
    try:
        parse_budget(budget)
    except (ValueError, KvreproError) as exc:
        raise BadInputError(f"--budget {budget}: {exc}") from None
    if repo is not None and not (repo / ".git").exists():
        raise BadInputError(f"--repo {repo}: not a git checkout (no .git); give a clone of vLLM's repository")
    if junit is not None:
        from ..report.outputs import check_junit

        check_junit(junit)


def _timed(check: ReleaseCheck, name: str, work: Callable[[Stage], None], say: Callable[[str], None],
           stop: threading.Event) -> None:
    stage = check.stages[name]
    if stop.is_set():
        stage.status = "interrupted"
        return
    say(f"[{name}] started")
    started = time.monotonic()
    try:
        work(stage)
        if stage.status == "pending":
            stage.status = "ok"
    except KvreproError as exc:
        stage.status, stage.summary = "failed", str(exc).splitlines()[0][:300]
    finally:
        stage.seconds = time.monotonic() - started
        if stop.is_set() and stage.status in ("pending", "ok"):
            stage.status = "interrupted"
    say(f"[{name}] {stage.status} in {stage.seconds:.0f} s" + (f": {stage.summary}" if stage.summary else ""))
    _save(check)


def _save(check: ReleaseCheck) -> None:
    from ..results.store import write_atomic

    write_atomic(check.folder / REPORT_JSON, json.dumps(check.as_json(), indent=2) + "\n")


def _fetch(check: ReleaseCheck, say: Callable[[str], None]) -> Callable[[Stage], None]:
    def work(stage: Stage) -> None:
        from ..builds import pristine_tree, prepare_runtime
        from ..builds.sdist import fetch_sdist

        for release in (check.release, check.previous):
            t = time.monotonic()
            wheel, tree, digest = pristine_tree(release, say)
            sdist, sdist_digest = fetch_sdist(release)
            stage.detail.setdefault("files", {})[release] = {
                "wheel": wheel.name, "wheel_sha256": digest, "sdist": sdist.name, "sdist_sha256": sdist_digest,
                "tree": str(tree), "seconds": round(time.monotonic() - t, 1)}
        t = time.monotonic()
        for release in (check.release, check.previous):
            prepare_runtime(release, say)
        stage.detail["runtime_seconds"] = round(time.monotonic() - t, 1)
        stage.summary = f"wheels and sdists of {check.release} and {check.previous}"
    return work


def _port(check: ReleaseCheck) -> Callable[[Stage], None]:
    def work(stage: Stage) -> None:
        files = check.stages["fetch"].detail.get("files", {})
        if check.release not in files:
            stage.status, stage.summary = "skipped", "no wheel"
            return
        reading = porting.read_release(check.release, Path(files[check.release]["tree"]), check.previous,
                                       Path(files[check.previous]["tree"]) if check.previous in files else None)
        stage.detail["read"] = [vars(f) for f in reading.findings]
        stage.detail["signatures"] = reading.signatures
        steps = sorted({f.step for f in reading.findings})
        stage.summary = (f"{len(reading.findings)} thing(s) read that a run may need ({', '.join(steps)})"
                         if reading.findings else "nothing the table lacks")
        if check.unported:
            stage.summary = versions.unported_note(check.release) + "; " + stage.summary
    return work


def _suite(check: ReleaseCheck, results_root: Path, jobs: int | None, reps: int | None, catalogue_dir: Path | None,
           progress_for: Callable[[int], Any], stop: threading.Event) -> Callable[[Stage], None]:
    def work(stage: Stage) -> None:
        from ..suite.run import check_entries, load as load_catalogue, parse_builds, run_suite

        catalogue = load_catalogue(catalogue_dir)
        entries = list(catalogue.entries)
        builds = parse_builds([check.previous, check.release], [])
        matrices = check_entries(entries, builds)
        total = sum(len(m.matrix.bases) * m.matrix.runs.count(reps) for m in matrices.values())
        command = f"kvrepro suite run --base {check.previous} --base {check.release}"
        progress = progress_for(total)
        from ..report import terminal

        with terminal.live(progress):
            suite = run_suite(catalogue, entries, builds, results_root, reps, jobs, progress, stop, command)
        rows = [r for r in suite.rows]
        stage.detail.update(suite_id=suite.suite_id, path=str(suite.path), suite_status=suite.status,
                            rows=[{"entry": r.entry, "build": r.build, "state": r.state, "expected": r.expected,
                                   "matches": r.matches, "detail": r.detail, "run_dirs": list(r.run_dirs)}
                                  for r in rows])
        # a row that ended INFRA on X: the porting step it needs, from its engine log
        settings = versions.settings_for(check.release)
        needs = []
        for r in rows:
            if r.build == check.release and r.state == "INFRA":
                for run_dir in r.run_dirs:
                    log = Path(run_dir) / "engine.log"
                    if log.is_file() and (found := porting.diagnose(log.read_text(errors="replace"), settings)):
                        needs.append({"entry": r.entry, **vars(found)})
                        break
        stage.detail["needs"] = needs
        mism = [r for r in rows if r.matches is False]
        stage.summary = (f"{suite.suite_id}: {len(rows)} rows, {len(mism)} differ from the catalogue, "
                         f"{sum(r.state == 'INFRA' for r in rows)} INFRA")
        if mism or needs:
            stage.status = "found"
    return work


def _tests_matrix(release: str):
    """The default matrix with one unpatched build on ``release`` and every patch declared (whose
    upstream tests, the catalogue's fixes', run on the release itself)."""
    from ..matrix import parse_matrix

    path = paths.shipped_matrix()
    data = yaml.safe_load(path.read_text()) or {}
    data.update(base=release, common=[], builds={"release": []}, expect={})
    text = yaml.safe_dump(data, sort_keys=False)
    loaded = parse_matrix(text, path, data=data)
    loaded.own_text = False
    return loaded


def _tests(check: ReleaseCheck, results_root: Path, test_jobs: int, only: list[str], say: Callable[[str], None]
           ) -> Callable[[Stage], None]:
    def work(stage: Stage) -> None:
        from ..builds import prepare_runtime, upstream_tests
        from ..report.upstream_tests import write

        runs = {}
        for release in (check.previous, check.release):
            loaded = _tests_matrix(release)
            plans = loaded.plans()
            patches = [loaded.patch_ref(name) for name in loaded.matrix.patches]
            runtime = prepare_runtime(release, say)
            t = time.monotonic()
            run = upstream_tests.check_builds(plans, patches, runtime, workers=test_jobs, only=list(only),
                                              later_releases=(), command=f"kvrepro release check {check.release}",
                                              impact=True, on_line=say)
            folder = write(run, results_root)
            runs[release] = run
            stage.detail.setdefault("runs", {})[release] = {
                "folder": str(folder), "seconds": round(time.monotonic() - t, 1),
                "passed": sum(o.outcome == "passed" for o in run.release.outcomes),
                "failed": sum(o.outcome in ("failed", "error") for o in run.release.outcomes),
                "patch_tests": {o.nodeid: o.outcome for o in run.release.outcomes if o.patch}}
        changed = change_report.test_changes(runs[check.previous], runs[check.release])
        stage.detail["changed"] = [vars(c) for c in changed.changed]
        stage.detail["added"], stage.detail["removed"] = changed.added, changed.removed
        stage.summary = (f"{len(changed.changed)} test(s) changed outcome, {changed.added} new, "
                         f"{changed.removed} gone")
        if any(c.regression for c in changed.changed):
            stage.status = "found"
    return work


def _explore(check: ReleaseCheck, results_root: Path, budget: str, seed: int, catalogue_dir: Path | None,
             progress_for: Callable[[int], Any], stop: threading.Event, say: Callable[[str], None]
             ) -> Callable[[Stage], None]:
    def work(stage: Stage) -> None:
        from ..explore import CampaignRequest, new_campaign, parse_budget, run_campaign, summary
        from ..explore.campaign import open_target
        from ..report import terminal
        from ..suite.run import load as load_catalogue

        runs, seconds = parse_budget(budget)
        request = CampaignRequest(base=check.release, budget_runs=runs, budget_seconds=seconds, seed=seed,
                                  catalogue=str((catalogue_dir or paths.default_catalogue()).resolve()))
        shared = open_target(request)
        try:
            cat = load_catalogue(catalogue_dir)
            state, folder = new_campaign(results_root, request)
            say(f"campaign {state.campaign_id}: {folder}")
            progress = progress_for(runs or 0)
            with terminal.live(progress):
                state = run_campaign(state, folder, cat, progress, stop, target=shared)
        finally:
            shared.close()
        found = summary(state)
        stage.detail.update(campaign=state.campaign_id, path=str(folder), runs=found["runs"],
                            verdicts=found["verdicts"], known=found["known"],
                            new=[{"title": f["title"], "folder": f.get("folder", "")} for f in found["new"]])
        stage.summary = f"{state.campaign_id}: {found['runs']} runs, {len(found['new'])} new finding(s)"
        if found["new"]:
            stage.status = "found"
    return work


def _bisect(check: ReleaseCheck, repo: Path | None, results_root: Path, say: Callable[[str], None]
            ) -> Callable[[Stage], None]:
    def work(stage: Stage) -> None:
        changed = check.changes.changed_entries if check.changes else []
        if not changed:
            stage.status, stage.summary = "skipped", "no verdict changed"
            return
        if repo is None:
            stage.status, stage.summary = "skipped", (f"{len(changed)} verdict(s) changed; give --repo (a vLLM git "
                                                      "checkout) to bisect them to the commit")
            return
        stage.detail["bisections"] = [bisect_change(c, check, repo, results_root, say) for c in changed]
        stage.summary = "; ".join(f"{b['entry']}: {b['result']}" for b in stage.detail["bisections"])
    return work


def bisect_change(change: "change_report.EntryChange", check: ReleaseCheck, repo: Path, results_root: Path,
                  say: Callable[[str], None]) -> dict[str, Any]:
    """``kvrepro bisect commits`` between the two release tags for one changed entry: the commit where
    its crash or corruption came in or went away. Stalls are skips in kvrepro's bisection
    (kvrepro/bisect/rules.py): a changed stall is reported, not bisected."""
    from ..suite.run import SuiteBuild, entry_matrix, load as load_catalogue

    if change.kind == "stall":
        return {"entry": change.entry, "result": "not bisected: a stall is a skip in kvrepro's bisection rule"}
    entry = next(e for e in load_catalogue(None).entries if e.name == change.entry)
    loaded = entry_matrix(entry, [SuiteBuild(check.release)])
    data = yaml.safe_load(loaded.text) if getattr(loaded, "text", None) else None
    if data is None:
        return {"entry": change.entry, "result": "not bisected: the entry's matrix has no text"}
    data.pop("patches", None)  # no patch: every commit as it is
    matrix = check.folder / f"bisect-{change.entry}.yaml"
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    old, new = f"v{check.previous}", f"v{check.release}"
    bad, good = (new, old) if change.after == "PRESENT" else (old, new)
    cmd = [sys.executable, "-m", "kvrepro.cli", "bisect", "commits", "--repo", str(repo), "--bad", bad,
           "--good", good, "--matrix", str(matrix), "--results", str(results_root), "--json"]
    say(f"bisecting {change.entry} between {good} (good) and {bad} (bad)")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        found = json.loads(proc.stdout)
    except ValueError:
        return {"entry": change.entry, "result": f"bisect exited {proc.returncode}: "
                f"{(proc.stderr.strip().splitlines() or ['no output'])[-1][:200]}", "command": " ".join(cmd)}
    first = found.get("first_bad") or found.get("result") or found.get("verdict")
    return {"entry": change.entry, "result": f"first changed commit: {first}", "bisect": found.get("bisect_id"),
            "command": " ".join(cmd)}


def run_check(release: str, *, budget: str, seed: int = 0, repo: Path | None = None, jobs: int | None = None,
              reps: int | None = None, test_jobs: int = 2, only: list[str] | None = None,
              catalogue_dir: Path | None = None, results_root: Path, skip: tuple[str, ...] = (),
              progress_for: Callable[[int], Any], stop: threading.Event, say: Callable[[str], None],
              command: str = "") -> ReleaseCheck:
    """The pipeline (module docstring); returns the check, recorded in its folder."""
    previous = compared_release(release)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    folder = results_root / f"release-{release}-{stamp}"
    folder.mkdir(parents=True, exist_ok=False)
    check = ReleaseCheck(release, previous, versions.is_unported(release), folder, time.time(), command=command)
    if check.unported:
        say(versions.unported_note(release))
    _save(check)
    work = {
        "fetch": _fetch(check, say),
        "port": _port(check),
        "suite": _suite(check, results_root, jobs, reps, catalogue_dir, progress_for, stop),
        "tests": _tests(check, results_root, test_jobs, list(only or []), say),
        "explore": _explore(check, results_root, budget, seed, catalogue_dir, progress_for, stop, say),
    }
    for name, job in work.items():
        if name in skip:
            check.stages[name].status, check.stages[name].summary = "skipped", "--skip " + name
            continue
        if name != "fetch" and check.stages["fetch"].status == "failed":
            check.stages[name].status, check.stages[name].summary = "skipped", "the wheels could not be had"
            continue
        _timed(check, name, job, say, stop)
    check.changes = change_report.collect(check)
    if "bisect" in skip:
        check.stages["bisect"].status = "skipped"
    else:
        _timed(check, "bisect", _bisect(check, repo, results_root, say), say, stop)
    check.seconds = time.time() - check.started
    check.status = "interrupted" if stop.is_set() else "complete"
    _save(check)
    (folder / REPORT_MD).write_text(change_report.markdown(check))
    return check


def exit_code(check: ReleaseCheck) -> int:
    """130 interrupted; 1 something needs a person (a suite row differs from the catalogue, a porting
    step, a new explore finding, a release test that passed on the previous release fails on X); 3 a
    stage could not run (a wheel, an environment, INFRA rows with no porting step named); else 0."""
    if check.status == "interrupted":
        return 130
    if any(s.status == "found" for s in check.stages.values()):
        return 1
    if any(s.status == "failed" for s in check.stages.values()):
        return 3
    rows = check.stages["suite"].detail.get("rows", [])
    if any(r["state"] == "INFRA" for r in rows):
        return 3
    return 0
