"""What the README and docs/ say they measured, generated from the records of the runs that measured it.

Every measured sentence and table of README.md and docs/*.md that this script knows is a
*generated span*: ``<!--gen:NAME ARGS-->text<!--/gen-->`` inside a line or paragraph, or
``<!--gen-block:NAME ARGS-->`` followed (after blank lines) by the table or fenced block it
generates. Its text is made from a small record under docs/records/, which the measuring
subcommand writes from the recorded run (results/...). tests/test_docs.py renders every span
again and fails when a page and its record disagree, and checks the catalogue (defects/) against
the suite record: a changed number is one command, not a hand edit.

    python scripts/measured.py matrix [--name default] [--from results/RUN]   # kvrepro matrix run (A-E) -> docs/records/matrix-NAME.json
    python scripts/measured.py releases [--reps 2] [--from results/RUN]       # the default load on every release -> docs/records/releases.json
    python scripts/measured.py suite [--reps 1] [--stack-reps 2] [--release X ...] [--entry NAME ...] [--no-stacks]
                                     [--from results/suite-ID ...]
                                                                              # the catalogue on every release and on every stack it names
    python scripts/measured.py render [--check]                              # rewrite (or check) every generated span

Each measuring subcommand records, then renders. ``suite --release 0.34.0`` runs the catalogue on
that release alone and merges its cells into docs/records/suite.json (a new release is one command);
``--from`` records runs made before (later ones replace earlier cells of the same entry and build).
``matrix --name gpu-mode -- -m examples/X.yaml`` records another matrix beside the default one;
``<!--gen-block:matrix-table default gpu-mode-->`` then shows both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECORDS = ROOT / "docs" / "records"
README = ROOT / "README.md"
RESULTS = ROOT / "results"
SPAN = re.compile(r"<!--gen:(?P<name>[a-z0-9-]+)(?P<args>[^>]*?)-->(?P<body>.*?)<!--/gen-->", re.S)
BLOCK = re.compile(r"<!--gen-block:(?P<name>[a-z0-9-]+)(?P<args>[^>]*?)-->")
SHORT = {"PRESENT": "PRESENT", "ABSENT": "absent", "UNREACHED": "UNREACHED", "OTHER": "other", "INFRA": "INFRA",
         "NOT TESTABLE": "n/t", "MASKED": "masked"}


def pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def version_key(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("."))


# --- records -----------------------------------------------------------------------------------

def read_record(name: str) -> dict[str, Any]:
    path = RECORDS / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"{path.relative_to(ROOT)}: no such record; make it with `python scripts/measured.py "
                         f"{name.split('-')[0]}`")
    return json.loads(path.read_text())


def write_record(name: str, record: dict[str, Any]) -> Path:
    RECORDS.mkdir(parents=True, exist_ok=True)
    path = RECORDS / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    print(f"recorded {path.relative_to(ROOT)}", file=sys.stderr)
    return path


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def date_of(run_id: str) -> str:
    """`20261204-174536-6719` or `suite-20261204-...` -> `2026-12-04` (run ids are UTC times)."""
    m = re.search(r"(20\d\d)(\d\d)(\d\d)-\d{6}", run_id)
    return f"{m[1]}-{m[2]}-{m[3]}" if m else "unknown"


def load_text() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


def _failure_json(f: Any) -> dict[str, Any] | None:
    if f is None:
        return None
    return {"kind": f.kind, "request": f.request, "ended": f.ended, "exact": f.exact,
            "crash_request": f.crash_request, "defect": f.defect}


def _failures(items: list[dict[str, Any] | None]) -> list[Any]:
    from kvrepro.report.failures import FirstFailure

    return [FirstFailure(**f) for f in items if f is not None]


def build_json(b: Any) -> dict[str, Any]:
    """One build of a recorded matrix run, as the docs need it."""
    from kvrepro.report.failures import first_failure

    runs = list(b.runs)
    return {
        "name": b.build_name, "base": b.base, "patches": list(b.patches), "expect": b.expect,
        "labels": [r.label for r in runs],
        "first_failures": [_failure_json(first_failure(r)) for r in runs],
        "kv_check": [r.kv_check for r in runs], "kv_violations": [r.kv_violations for r in runs],
        "kv_defects": sorted({d for r in runs for d in r.kv_defects}),
        "trigger_count": [r.trigger_count for r in runs], "state_count": [r.state_count for r in runs],
        "requests": [r.requests for r in runs], "offload_load_jobs": [r.offload_load_jobs for r in runs],
        "title": next((r.title for r in runs if r.title), ""),
        "seconds": round(sum(r.seconds for r in runs), 1),
    }


# the parts of a matrix that decide what its runs measure: a record names its run's digest of them, and
# tests/test_docs.py compares it with today's matrix.yaml (the default changed: measure again)
MATRIX_KEYS = ("base", "patches", "common", "builds", "engine", "load", "runs", "target_signature")
RELEASES_KEYS = ("engine", "load")  # the release sweep runs the default engine and load, no patches


def matrix_digest(data: dict[str, Any], keys: tuple[str, ...]) -> str:
    """A short hash of ``keys`` of a matrix; of ``patches:`` only those a build or ``common:`` uses (a
    patch declared for the suite changes no run of the matrix)."""
    import hashlib

    chosen = {k: data.get(k) for k in keys}
    if isinstance(chosen.get("patches"), dict):
        used = set(data.get("common") or []) | {p for stack in (data.get("builds") or {}).values() for p in stack or []}
        chosen["patches"] = {name: ref for name, ref in chosen["patches"].items() if name in used}
    return hashlib.sha256(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()[:16]


def record_matrix_run(run_ref: str, name: str, command: str, measured_load: str | None,
                      at: str | None = None, keys: tuple[str, ...] = MATRIX_KEYS) -> dict[str, Any]:
    from kvrepro.report.expectations import mismatches
    from kvrepro.report.render import proved
    from kvrepro.results import store

    import yaml

    run = store.load_run(RESULTS, run_ref)
    finished = [r for b in run.builds for r in b.runs]
    used = yaml.safe_load((run.path / "matrix.yaml").read_text()) or {}
    seconds = (run.info.finished - run.info.started) if run.info.finished and run.info.started else None
    return {
        "record": "matrix", "name": name, "run_id": run.run_id, "date": date_of(run.run_id), "status": run.status,
        "command": command, "kvrepro": at or commit(), "base": run.info.base_text, "target": run.info.target,
        "seconds": round(seconds) if seconds else None, "load_average": measured_load,
        "matrix_digest": matrix_digest(used, keys), "scheduling": scheduling_of(run.path),
        "runs": len(finished), "mismatches": len(mismatches(run)),
        "builds": [build_json(b) for b in run.builds], "proved": proved(run),
    }


def scheduling_of(folder: Path) -> str:
    """``async`` or ``sync``: the scheduling mode a recorded run's engines ran (a matrix run or a suite
    run). The sim's geometry line in each engine.log ends ``async_scheduling=on|off``
    (kvrepro/engine/executor.py); runs made before the mode existed have none and were synchronous."""
    for log in sorted(folder.rglob("engine.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "kvrepro-sim: geometry" in line and "async_scheduling=" in line:
                return "async" if line.rstrip().endswith("async_scheduling=on") else "sync"
    return "sync"


def record_suite_runs(folders: list[Path], previous: dict[str, Any] | None, commands: list[str],
                      measured_load: str | None, at: str | None = None,
                      only: list[str] | None = None) -> dict[str, Any]:
    """The rows of ``folders`` (measured states, before the catalogue's masking is applied), merged over
    ``previous``: a later row replaces an earlier one of the same entry and build; ``only``: the rows of
    these entries alone (a run's other rows stay out of the record)."""
    from kvrepro.suite.judge import MASKED_NOTE
    from kvrepro.suite.run import load, load_suite

    catalogue = load()
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    runs = list((previous or {}).get("suites", []))
    for row in (previous or {}).get("rows", []):
        rows[(row["entry"], row["build"])] = row
    for folder, command in zip(folders, commands):
        suite = load_suite(folder, catalogue, RESULTS)
        reps = 0
        for r in suite.rows:
            if only and r.entry not in only:
                continue
            # the evidence as measured: without the words today's catalogue added to a MASKED row
            detail = r.detail.partition(MASKED_NOTE)[2] or r.detail if r.state == "MASKED" else r.detail
            rows[(r.entry, r.build)] = {"entry": r.entry, "build": r.build, "state": r.measured or r.state,
                                        "ended_by": r.ended_by, "reps": r.reps, "detail": detail,
                                        "suite": suite.suite_id}
            reps += r.reps
        runs = [s for s in runs if s["suite_id"] != suite.suite_id]
        runs.append({"suite_id": suite.suite_id, "date": date_of(suite.suite_id), "status": suite.status,
                     # a run recorded for some entries only: its wall time is not theirs
                     "command": command or suite.command,
                     "seconds": round(suite.seconds) if suite.seconds and not only else None,
                     "engine_runs": reps, "kvrepro": at or commit(), "load_average": measured_load,
                     "scheduling": scheduling_of(suite.path)})
    from kvrepro.suite.catalogue import parse_build_key

    def order(key: tuple[str, str]) -> tuple[Any, ...]:
        release, patches = parse_build_key(key[1])
        return (key[0], len(patches), patches, version_key(release))

    return {"record": "suite", "suites": runs, "rows": [rows[k] for k in sorted(rows, key=order)]}


# --- measuring ---------------------------------------------------------------------------------

def kvrepro(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def suite_plan(releases: list[str], stacks: bool,
               only: list[str] | None = None) -> list[tuple[tuple[str, ...], list[str], list[str]]]:
    """(patch stack, bases, entries) of each suite run: every release for every testable entry, then
    each stack a catalogue entry names (present_in, fixed_in, masked_in) on the releases it names;
    ``only``: these entries alone (a new entry is one command)."""
    from kvrepro.suite.catalogue import named_builds, parse_build_key
    from kvrepro.suite.run import load

    catalogue = load()
    testable = [e.name for e in catalogue.select(only) if e.testable]
    plan: list[tuple[tuple[str, ...], list[str], list[str]]] = [((), releases, testable)] if releases else []
    if stacks:
        by_stack: dict[tuple[str, ...], tuple[list[str], list[str]]] = {}
        for e in catalogue.select(only):
            for key in named_builds(e) if e.testable else ():
                release, patches = parse_build_key(key)
                if not patches:
                    continue
                bases, entries = by_stack.setdefault(patches, ([], []))
                if release not in bases:
                    bases.append(release)
                if e.name not in entries:
                    entries.append(e.name)
        plan += [(stack, sorted(bases, key=version_key), entries) for stack, (bases, entries) in by_stack.items()]
    return plan


def run_suite_plan(plan: list[tuple[tuple[str, ...], list[str], list[str]]], reps: int, stack_reps: int,
                   jobs: int | None) -> tuple[list[Path], list[str]]:
    folders, commands = [], []
    for stack, bases, entries in plan:
        args = ["suite", "run", "--json", "--ci", "--reps", str(stack_reps if stack else reps)]
        for b in bases:
            args += ["--base", b]
        for p in stack:
            args += ["--patch", p]
        if stack or len(entries) < 4:
            for e in entries:
                args += ["--entry", e]
        if jobs:
            args += ["--jobs", str(jobs)]
        print(f"running: kvrepro {' '.join(args)}", file=sys.stderr)
        proc = kvrepro(*args)
        if not proc.stdout.strip():
            raise SystemExit(f"kvrepro suite run exited {proc.returncode} without a result")
        out = json.loads(proc.stdout)
        folders.append(Path(out["path"]))
        commands.append("kvrepro " + " ".join(a for a in args if a not in ("--json", "--ci")))
    return folders, commands


def suite_record_name(name: str | None) -> str:
    """``suite`` (the catalogue's record, tests/test_docs.py judges it) or ``suite-NAME`` (another mode's)."""
    return "suite" if name in (None, "", "suite") else f"suite-{name}"


def cmd_suite(args: argparse.Namespace) -> None:
    from kvrepro.versions import SUPPORTED_RELEASES

    merging = args.release or args.recorded or args.entry
    record_name = suite_record_name(args.name)
    previous = read_record(record_name) if (RECORDS / f"{record_name}.json").is_file() and merging else None
    if args.recorded:
        folders = [Path(f) for f in args.recorded]
        record = record_suite_runs(folders, previous, [""] * len(folders), args.load_average, args.at, args.entry)
    else:
        releases = args.release or list(SUPPORTED_RELEASES)
        started = time.monotonic()
        plan = suite_plan(releases, args.stacks and not args.release, args.entry)
        folders, commands = run_suite_plan(plan, args.reps, args.stack_reps, args.jobs)
        print(f"measured in {time.monotonic() - started:.0f} s", file=sys.stderr)
        record = record_suite_runs(folders, previous, commands, load_text())
    write_record(record_name, record)
    render(check=False)


def cmd_matrix(args: argparse.Namespace) -> None:
    if args.recorded:
        record = record_matrix_run(args.recorded, args.name, "kvrepro matrix run", args.load_average, args.at)
    else:
        extra = list(args.matrix_args)
        proc = kvrepro("matrix", "run", "--json", "--ci", *extra)
        if not proc.stdout.strip():
            raise SystemExit(f"kvrepro matrix run exited {proc.returncode} without a result")
        out = json.loads(proc.stdout)
        record = record_matrix_run(out["path"], args.name, " ".join(["kvrepro matrix run", *extra]), load_text())
    write_record(f"matrix-{args.name}", record)
    render(check=False)


def cmd_releases(args: argparse.Namespace) -> None:
    if args.recorded:
        run_ref = args.recorded
        measured_load = args.load_average
    else:
        cmd = [sys.executable, str(ROOT / "scripts" / "release_sweep.py"), "--reps", str(args.reps), "--json"]
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        if not proc.stdout.strip():
            raise SystemExit(f"release_sweep.py exited {proc.returncode} without a result")
        run_ref = json.loads(proc.stdout)["run_id"]
        measured_load = load_text()
    record = record_matrix_run(run_ref, "releases", "python scripts/release_sweep.py", measured_load,
                               args.at if args.recorded else None, RELEASES_KEYS)
    record["record"] = "releases"
    write_record("releases", record)
    render(check=False)


# --- rendering ---------------------------------------------------------------------------------

def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _range(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _releases_text(releases: list[str], all_releases: list[str]) -> str:
    """`0.25.1 and 0.26.0`, `0.27.0 to 0.33.0` (three or more consecutive releases)."""
    idx = [all_releases.index(r) for r in releases]
    if len(releases) >= 3 and idx == list(range(idx[0], idx[0] + len(idx))):
        return f"{releases[0]} to {releases[-1]}"
    return _and(releases)


def _story(build: dict[str, Any]) -> tuple[str, dict[str, list[int]]]:
    """What a build's runs did, as a class (same words for the same kind of outcome) and its numbers."""
    failures = _failures(build["first_failures"])
    labels = set(build["labels"])
    wrong = [f.request for f in failures if f.kind == "wrong KV read"]
    crash = [f.crash_request for f in failures if f.crash_request is not None]
    n = len(failures)
    if labels == {"CRASH(target)"} and len(wrong) == n:
        return "wrong-then-target", {"wrong": wrong, "crash": crash}
    if labels == {"CRASH(target)"} and not wrong:
        return "target", {"crash": crash}
    if labels == {"CORRUPT"}:
        return "corrupt", {"wrong": wrong}
    if labels <= {"UNREACHED", "SURVIVED"} and all(c == "ok" for c in build["kv_check"]):
        return "clean-" + "-".join(sorted(labels)).lower(), {}
    return "mixed:" + " ".join(build["labels"]), {}


def _story_text(kind: str, numbers: dict[str, list[int]], runs: str) -> str:
    if kind == "wrong-then-target":
        return (f"read wrong KV from request {_range(numbers['wrong'])} and then crash on the target assertion at "
                f"request {_range(numbers['crash'])} ({runs})")
    if kind == "target":
        return f"crash on the target assertion at request {_range(numbers['crash'])} ({runs})"
    if kind == "corrupt":
        return f"read wrong KV from request {_range(numbers['wrong'])} without crashing ({runs})"
    if kind == "clean-unreached":
        return f"never reach the bug's state and read every KV right (UNREACHED, {runs})"
    if kind.startswith("clean-"):
        return f"neither crash nor read wrong KV ({runs})"
    return f"end {kind.split(':', 1)[1]}"


def case_releases(args: list[str]) -> str:
    """The case paragraph's sentence: what the default load does on each release, grouped."""
    record = read_record("releases")
    builds = sorted(record["builds"], key=lambda b: version_key(b["base"]))
    all_releases = [b["base"] for b in builds]
    groups: list[tuple[str, list[str], dict[str, list[int]], list[int]]] = []
    for b in builds:
        kind, numbers = _story(b)
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(b["base"])
            for k, v in numbers.items():
                groups[-1][2].setdefault(k, []).extend(v)
            groups[-1][3].append(len(b["labels"]))
        else:
            groups.append((kind, [b["base"]], {k: list(v) for k, v in numbers.items()}, [len(b["labels"])]))
    parts = []
    for kind, releases, numbers, counts in groups:
        each = " each" if len(releases) > 1 else ""
        runs = f"{counts[0]} of {counts[0]} runs{each}" if len(set(counts)) == 1 else "every run"
        verb = _story_text(kind, numbers, runs)
        parts.append(f"{_releases_text(releases, all_releases)} {verb}")
    return "; ".join(parts)


def default_load(args: list[str]) -> str:
    """The list item's claim: where the plain releases that crash first fail on the default load."""
    record = read_record("releases")
    crashing = [b for b in sorted(record["builds"], key=lambda b: version_key(b["base"]))
                if _story(b)[0] in ("wrong-then-target", "target")]
    if not crashing:
        return "no release crashes on it"
    failures = [f for b in crashing for f in _failures(b["first_failures"])]
    crash = [f.crash_request for f in failures if f.crash_request is not None]
    wrong = [f.request for f in failures if f.kind == "wrong KV read"]
    text = f"the plain release crashes at request {_range(crash)} on {_and([b['base'] for b in crashing])}"
    if len(wrong) == len(failures):
        text += f", after its first wrong KV read at request {_range(wrong)}"
    return text


def releases_source(args: list[str]) -> str:
    """Where the releases' record comes from; ``short``: the command, run and date only."""
    r = read_record("releases")
    head = f"`python scripts/measured.py releases`, run `{r['run_id']}`, {r['date']}, {_scheduling(r)}"
    if "short" in args:
        return head
    reps = sorted({len(b["labels"]) for b in r["builds"]})
    load = f", load average {r['load_average']}" if r.get("load_average") else ""
    return (f"{head}, kvrepro at {r['kvrepro']}, {'/'.join(map(str, reps))} repetitions a release, each ended "
            f"once its verdict was settled{load}")


def releases_table(args: list[str]) -> str:
    r = read_record("releases")
    lines = ["| release | verdicts | first failure (request) | trigger count | bug state | KV check (violations) "
             "| requests | offload loads |", "|---|---|---|---:|---:|---|---:|---:|"]
    from kvrepro.report.failures import build_text

    for b in sorted(r["builds"], key=lambda b: version_key(b["base"])):
        defects = f" (`{'`, `'.join(b['kv_defects'])}`)" if b["kv_defects"] else ""
        lines.append(" | ".join([
            f"| {b['base']}", _labels(b["labels"]) + defects, build_text(_failures(b["first_failures"])),
            " / ".join(map(str, b["trigger_count"])), " / ".join(map(str, b["state_count"])),
            " / ".join(f"{c} ({v})" for c, v in zip(b["kv_check"], b["kv_violations"])),
            " / ".join(map(str, b["requests"])),
            " / ".join("?" if x is None else str(x) for x in b["offload_load_jobs"]) + " |"]))
    return "\n".join(lines)


def _labels(labels: list[str]) -> str:
    if len(set(labels)) == 1:
        return (f"{len(labels)}x " if len(labels) > 1 else "") + labels[0]
    return " ".join(labels)


def matrix_table(args: list[str]) -> str:
    """The default matrix's table: build, patches, expect:, and per record what was measured."""
    from kvrepro.report.failures import build_text

    names = args or ["default"]
    records = [read_record(f"matrix-{n}") for n in names]
    first = records[0]
    head = "| build | patches | `expect:` | " + " | ".join(
        "measured" + (f" ({n})" if len(names) > 1 else "") for n in names) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(names)]
    stacks = [b["patches"] for b in first["builds"]]
    shared = [p for i, p in enumerate(stacks[0]) if all(len(s) > i and s[i] == p for s in stacks)]
    shared = shared[:next((i for i, p in enumerate(stacks[0]) if any(len(s) <= i or s[i] != p for s in stacks)),
                          len(stacks[0]))]
    for b in first["builds"]:
        cells = []
        for rec in records:
            other = next((x for x in rec["builds"] if x["name"] == b["name"]), None)
            if other is None:
                cells.append("-")
                continue
            failures = _failures(other["first_failures"])
            text = f"`{_labels(other['labels'])}`: {build_text(failures)}"
            if not any(f.failed for f in failures) and failures and all(c == "ok" for c in other["kv_check"]):
                text += ", KV check ok"
            cells.append(text)
        common = b["patches"][len(shared):]
        lines.append(f"| {b['name']} | " + (", ".join(f"`{p}`" for p in common) or "-") + f" | "
                     f"`{(b['expect'] or '-').replace('|', chr(92) + '|')}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def matrix_proved(args: list[str]) -> str:
    record = read_record(f"matrix-{(args or ['default'])[0]}")
    out = ["```", "What this matrix proved:"]
    for claim in record["proved"]:
        out += textwrap.wrap(claim.replace("`", ""), width=100, initial_indent="  ", subsequent_indent="    ",
                             break_on_hyphens=False, break_long_words=False)
    return "\n".join(out + ["```"])


def matrix_source(args: list[str]) -> str:
    r = read_record(f"matrix-{(args or ['default'])[0]}")
    wall = f", {r['seconds'] // 60} min {r['seconds'] % 60} s" if r.get("seconds") else ""
    load = f" at load average {r['load_average']}" if r.get("load_average") else ""
    agree = (f"all {r['runs']} runs as `expect:` says" if not r["mismatches"]
             else f"{r['mismatches']} of {r['runs']} runs differ from `expect:`")
    return (f"run `{r['run_id']}`, {r['date']}, vLLM {r['base']}, {_scheduling(r)}, kvrepro at {r['kvrepro']}; regenerate with "
            f"`python scripts/measured.py matrix`; {agree}{wall}{load}")


def _scheduling(record: dict[str, Any]) -> str:
    return {"async": "asynchronous scheduling", "sync": "synchronous scheduling"}.get(record.get("scheduling"),
                                                                                      "scheduling not recorded")


def _judged_rows(name: str = "suite") -> list[tuple[dict[str, Any], str, str | None, bool | None]]:
    """Each recorded suite row with the row the current catalogue makes of it: (row, shown, expected, matches)."""
    from kvrepro.suite.catalogue import expected_state, parse_build_key
    from kvrepro.suite.judge import agrees, others_of, reconcile
    from kvrepro.suite.run import load

    catalogue = load()
    known = {e.name: e for e in catalogue.entries}
    out = []
    for row in read_record(name)["rows"]:
        entry = known.get(row["entry"])
        if entry is None:
            continue
        release, patches = parse_build_key(row["build"])
        expected = expected_state(entry, release, patches)
        shown = reconcile(row["state"], row.get("ended_by"), entry.signature, expected, others_of(catalogue, entry))
        out.append((row, shown, expected, agrees(shown, expected)))
    return out


def release_table(args: list[str]) -> str:
    """Every testable entry on every release measured (rows without patches), as the catalogue judges them.
    ``args``: the record's name (``async``: docs/records/suite-async.json). Each column names the scheduling
    mode most of its cells ran in; a row measured in the other mode says so after its name."""
    record_name = suite_record_name(args[0] if args else None)
    modes = {s["suite_id"]: s.get("scheduling") for s in read_record(record_name)["suites"]}
    judged = [j for j in _judged_rows(record_name) if "+" not in j[0]["build"]]
    releases = sorted({j[0]["build"] for j in judged}, key=version_key)
    entries: dict[str, dict[str, tuple[str, str | None, bool | None]]] = {}
    column: dict[str, list[str]] = {}
    for row, shown, expected, matches in judged:
        entries.setdefault(row["entry"], {})[row["build"]] = (shown, expected, matches)
        if modes.get(row["suite"]):
            column.setdefault(row["build"], []).append(modes[row["suite"]])
    mode = {r: max(set(m), key=m.count) for r, m in column.items()}
    row_mode = {}
    for row, *_ in judged:
        own = modes.get(row["suite"])
        if own and mode.get(row["build"]) not in (None, own):
            row_mode[row["entry"]] = own
    lines = ["| entry | " + " | ".join(f"{r} {mode[r]}" if r in mode else r for r in releases) + " |",
             "|---|" + "---|" * len(releases)]
    for entry, cells in entries.items():
        if all(c[0] == "NOT TESTABLE" for c in cells.values()) and len(cells) == len(releases):
            continue  # not testable anywhere: listed under the table by its reason
        shown = []
        for release in releases:
            state, expected, matches = cells.get(release, ("", None, None))
            mark = "!" if matches is False else (" -" if expected is None and state else "")
            shown.append(SHORT.get(state, state) + mark)
        other = f" ({row_mode[entry]})" if entry in row_mode else ""
        lines.append(f"| `{entry}`{other} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def catalogue_table(args: list[str]) -> str:
    """Every recorded row on a patch stack, as the catalogue judges it (docs/suite.md)."""
    lines = ["| entry | build | measured | catalogue | row |", "|---|---|---|---|---|"]
    for row, shown, expected, matches in _judged_rows():
        if "+" not in row["build"]:
            continue
        mark = "" if matches is None else (" (agrees)" if matches else " (**differs**)")
        lines.append(f"| `{row['entry']}` | `{row['build']}` | {row['detail'][:110].replace('|', '/')} | "
                     f"{expected or '-'} | {shown}{mark} |")
    return "\n".join(lines)


def suite_source(args: list[str]) -> str:
    """Where a suite record comes from; ``args``: the record's name (``async``)."""
    record_name = suite_record_name(args[0] if args else None)
    record = read_record(record_name)
    suites = sorted(record["suites"], key=lambda s: s["suite_id"])
    seconds = sum(s["seconds"] or 0 for s in suites)
    runs = sum(s["engine_runs"] for s in suites)
    timed = sum(s["engine_runs"] for s in suites if s.get("seconds"))
    dates = sorted({s["date"] for s in suites})
    per = f", {seconds / timed:.1f} s an engine run" if timed and seconds else ""
    extra = f" (and {runs - timed} taken from runs made for other entries)" if runs > timed else ""
    loads = list(dict.fromkeys(s["load_average"] for s in suites if s.get("load_average")))
    load = f", load average {', '.join(loads)}" if loads else ""
    judged = _judged_rows(record_name)
    agree = sum(1 for j in judged if j[3] is True)
    differ = sum(1 for j in judged if j[3] is False)
    verdict = (f"every one of the {agree} cells with a claim agrees with the catalogue" if not differ
               else f"{differ} of {agree + differ} cells with a claim differ from the catalogue")
    command = "`python scripts/measured.py suite" + (f" --name {args[0]}" if record_name != "suite" else "") + "`"
    counts = {m: sum(1 for s in suites if s.get("scheduling") == m) for m in ("sync", "async")}
    scheduling = ", ".join(f"{n} {'synchronous' if m == 'sync' else 'asynchronous'}" for m, n in counts.items() if n)
    ids = (f"`{suites[0]['suite_id']}`" if len(suites) == 1
           else f"`{suites[0]['suite_id']}` ... `{suites[-1]['suite_id']}`")
    return (f"{command}: {len(suites)} suite run{'s' if len(suites) > 1 else ''} ({ids}; scheduling: {scheduling}), "
            f"{_and(dates)}, "
            f"{seconds:,} s for {timed} engine runs{per}{extra}{load}; {verdict}")


RENDERERS: dict[str, Callable[[list[str]], str]] = {
    "case-releases": case_releases, "default-load": default_load, "releases-source": releases_source,
    "releases-table": releases_table, "matrix-table": matrix_table, "matrix-proved": matrix_proved,
    "matrix-source": matrix_source, "release-table": release_table, "catalogue-table": catalogue_table,
    "suite-source": suite_source,
}


def _block_end(lines: list[str], start: int) -> int:
    """The index after the table or fenced block that starts at ``start``."""
    if lines[start].lstrip().startswith("```"):
        end = start + 1
        while end < len(lines) and not lines[end].lstrip().startswith("```"):
            end += 1
        return end + 1
    end = start
    while end < len(lines) and lines[end].lstrip().startswith("|"):
        end += 1
    return end


def render_text(text: str, where: str = "") -> str:
    """``text`` with every generated span and block made again from its record."""
    def span(m: re.Match) -> str:
        name = m["name"]
        if name not in RENDERERS:
            raise SystemExit(f"{where}: <!--gen:{name}-->: no such generator; known: {', '.join(RENDERERS)}")
        return f"<!--gen:{name}{m['args']}-->{RENDERERS[name](m['args'].split())}<!--/gen-->"

    text = SPAN.sub(span, text)
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = BLOCK.search(lines[i])
        if m is None:
            i += 1
            continue
        name = m["name"]
        if name not in RENDERERS:
            raise SystemExit(f"{where}:{i + 1}: <!--gen-block:{name}-->: no such generator")
        start = i + 1
        while start < len(lines) and not lines[start].strip():
            start += 1
        if start == len(lines) or not (lines[start].lstrip().startswith(("|", "```"))):
            raise SystemExit(f"{where}:{i + 1}: <!--gen-block:{name}--> is not followed by a table or a fenced block")
        end = _block_end(lines, start)
        new = RENDERERS[name](m["args"].split()).split("\n")
        lines[start:end] = new
        i = start + len(new)
    return "\n".join(lines)


def render(check: bool) -> list[str]:
    """Rewrite every page's generated spans (``check``: only say which pages differ)."""
    drifted = []
    for page in pages():
        text = page.read_text()
        if "<!--gen" not in text:
            continue
        new = render_text(text, str(page.relative_to(ROOT)))
        if new != text:
            drifted.append(str(page.relative_to(ROOT)))
            if not check:
                page.write_text(new)
                print(f"rendered {page.relative_to(ROOT)}", file=sys.stderr)
    return drifted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("suite", help="the catalogue on every release and stack it names -> docs/records/suite.json")
    p.add_argument("--reps", type=int, default=1, help="repetitions of each release cell (an entry's "
                   "path.absent_after raises it)")
    p.add_argument("--stack-reps", type=int, default=2, help="repetitions of each cell on a stack the catalogue names")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--release", action="append", help="only this release (merged into the record); repeatable")
    p.add_argument("--no-stacks", dest="stacks", action="store_false", help="leave out the catalogue's patch stacks")
    p.add_argument("--entry", action="append", help="only this entry, on every release and its stacks (merged into "
                   "the record); repeatable")
    p.add_argument("--from", dest="recorded", action="append", help="record this suite run folder instead of running "
                   "(with --entry: only those entries' rows)")
    p.add_argument("--name", default=None, help="another record beside the catalogue's: docs/records/suite-NAME.json "
                   "(e.g. async, the release table in the other scheduling mode)")
    p.set_defaults(run=cmd_suite)
    p = sub.add_parser("matrix", help="kvrepro matrix run -> docs/records/matrix-NAME.json")
    p.add_argument("--name", default="default")
    p.add_argument("--from", dest="recorded", help="record this run (results/RUN or its id) instead of running")
    p.add_argument("matrix_args", nargs="*", help="after --: more `kvrepro matrix run` options (-m FILE ...)")
    p.set_defaults(run=cmd_matrix)
    p = sub.add_parser("releases", help="the default load on every release -> docs/records/releases.json")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--from", dest="recorded", help="record this release_sweep.py run instead of running")
    p.set_defaults(run=cmd_releases)
    p = sub.add_parser("render", help="rewrite every generated span from the records")
    p.add_argument("--check", action="store_true", help="only list the pages that differ (exit 1)")
    for name, p in sub.choices.items():
        if name != "render":
            p.add_argument("--load-average", help="with --from: the load average seen while it ran (1/5 min)")
            p.add_argument("--at", help="with --from: the kvrepro commit it ran (default: HEAD)")
    args = ap.parse_args()
    if args.command == "render":
        drifted = render(args.check)
        if args.check and drifted:
            print("differ from their records: " + ", ".join(drifted) + "; run `python scripts/measured.py render`",
                  file=sys.stderr)
            return 1
        return 0
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
