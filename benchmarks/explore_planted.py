"""How good is `kvrepro explore` at finding bugs nobody told it about? Planted bugs (issue 28 item 4).

Each planted bug (benchmarks/planted/planted.yaml: a patch in that folder that puts a known, fixed
defect back into a later release, or a one-line mutation of the scheduler, the KV-cache manager or
the connector) is built on its release and explored three ways on the same budget, each a fresh
campaign with the same seed:

  guided    the full vocabulary, choices steered by coverage, starting from the catalogue's entries
            (the seed corpus, kvrepro/explore/generator.py; a find from a replayed entry or its
            mutation names the entry: a revert of that entry's fix is found by construction)
  unguided  the full vocabulary, uniform choices (`kvrepro explore --unguided`)
  generic   a generic randomised load: the base matrix's engine as it is, only the default load
            profile's own settings, concurrency, max_tokens and the seeds drawn at random
            (generator vocabulary `load`; what a benchmark client with random settings sends;
            `vllm bench serve` itself is not used: its requests-to-crash is in requests_to_crash.py)

A campaign stops at its first run with a failure the row's `expect:` names (a prefix of the judge's
failure key) that executed at least one branch in the planted patch's lines (the campaign's branch
probes): a failure of a run that never ran the planted code is the release's own. So is one the
release as shipped shows too: each such candidate is run again, the same spec and seeds, on the
release without the patch (`rerun_on_release`), and counts only if that run does not fail with the
same key (its seconds are reported apart, `confirm_seconds`, and left out of `seconds`).
Reported per bug and mode: found or not, the run that found it (run 0 is the base matrix as it is,
the same in every mode), requests sent up to and including that run, seconds, the first failure
of any kind, and the first run that executed a branch in the patched lines ("reached": the
campaign's branch probes, kvrepro/engine/branches.py; "never" says the planted code did not run,
which tells "not reached" from "reached and harmless"). A bug not found counts as
budget + 1 runs (a lower bound, shown '>N'). The ratio is unguided (or generic) runs-to-find over
guided's, per bug and on the median. Per bug and oracle (crash, shadow-kv, stall, request-invariant,
and each engine invariant at quiescent points by its name, kvrepro/classify/invariants.py): the first
run that executed the planted lines and failed that oracle, so the table says which oracle sees
which bug (issue 48's leaks, double frees and stranded reservations: `--family`). Each outcome is also printed on stderr as soon as it is known
(`  outcome {...}`), so a benchmark cut short keeps what it measured.

Done-when (issue 28): >= 80% found within 30 minutes each on 2 cores, guided >= 2x faster than
unguided on the median. The full measurement:

    python benchmarks/explore_planted.py --budget 30m                # every bug, 3 modes, 30 min each
    python benchmarks/explore_planted.py --budget 6 --requests 60 --bug revert-48425   # a small one
    python benchmarks/explore_planted.py --budget 6 --json > planted.json

Every run goes through the matrix runner on the sim target (the real vLLM scheduler, KV-cache
manager and connector in the real `vllm serve`; model executor and offload data movement faked:
no GPU here). Campaign folders are kept under --results (default results/, explore-*).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PLANTED = Path(__file__).resolve().parent / "planted"
MODES = ("guided", "unguided", "generic")


@dataclass(frozen=True)
class PlantedBug:
    """One row of planted.yaml."""

    name: str
    patch: str
    base: str
    kind: str  # revert | mutation | clean (a control: a change that must bring no failure, issue 51)
    expect: tuple[str, ...]  # failure-key prefixes that count as finding it
    upstream: str | None = None
    component: str | None = None
    # branch probes (file:arc, as the campaign's coverage names them) whose execution means the
    # planted line ran, for a change with no probe within the target margin (a straight-line
    # statement far below its block's branch): the target arcs alone would say "never reached"
    reach: tuple[str, ...] = ()
    # issue 48's leak-style bugs: leak | double-free | stranded (None: the earlier planted bugs)
    family: str | None = None


def load_planted(folder: Path = PLANTED) -> list[PlantedBug]:
    rows = yaml.safe_load((folder / "planted.yaml").read_text()) or []
    bugs = []
    for row in rows:
        row = dict(row)
        row["expect"] = tuple(row.get("expect") or ())
        row["reach"] = tuple(row.get("reach") or ())
        bugs.append(PlantedBug(**row))
    return bugs


def planted_matrix(bug: PlantedBug, folder: Path, base_matrix: Path = ROOT / "matrix.yaml") -> Path:
    """The base matrix with the planted patch as its only declared patch (copied next to it)."""
    data = yaml.safe_load(base_matrix.read_text())
    (folder / "builds").mkdir(parents=True, exist_ok=True)
    (folder / "builds" / bug.patch).write_bytes((PLANTED / bug.patch).read_bytes())
    data["base"] = bug.base
    data["patches"] = {bug.name: {"file": bug.patch, "upstream": bug.upstream or f"none: planted mutation {bug.patch}"}}
    data["common"] = []
    data["builds"] = {"planted": [bug.name]}
    data["expect"] = {}
    path = folder / "matrix.yaml"
    path.write_text(f"# benchmarks/explore_planted.py: {bug.name} planted on vLLM {bug.base}\n"
                    + yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass
class Outcome:
    bug: str
    mode: str
    found: bool
    runs: int  # runs made (found: up to and including the finding run)
    found_at_run: int | None  # the finding run's index (0 = the base matrix)
    requests: int  # requests sent up to and including the finding run (or all runs)
    seconds: float
    first_failure: str | None  # the first failure key of any kind
    found_key: str | None
    campaign: str
    verdicts: list[str] = field(default_factory=list)
    reached_at_run: int | None = None  # first run that executed an arc in the patched lines (None: none did)
    target_arcs: list[int] = field(default_factory=list)  # per run: arcs in the patched lines
    arcs: list[int] = field(default_factory=list)  # per run: arcs of the code under test
    # the catalogue entry the finding run replayed or descended from (guided's seed corpus); None: drawn
    found_from: str | None = None
    # candidate finds rerun on the release as shipped (same spec, same seeds): "run N: key -> verdict
    # on the release"; a candidate the release fails the same way is the release's own, not counted
    confirmations: list[str] = field(default_factory=list)
    confirm_seconds: float = 0.0  # spent on those reruns: measurement, left out of `seconds`
    # oracle -> the first run, among those that executed the planted lines, in which it failed: crash,
    # shadow-kv (a corruption), stall, request-invariant (the load's), or an engine invariant's name
    # (kvrepro/classify/invariants.py): which oracle sees which bug (issue 48)
    oracles: dict[str, int] = field(default_factory=dict)


def oracle_of(key: str) -> str:
    """The oracle that made a failure key: ``invariant:block-leak`` -> ``block-leak``."""
    from kvrepro.classify.invariants import INVARIANTS

    kind, _, rest = key.partition(":")
    if kind == "invariant":
        return rest if rest in INVARIANTS else "request-invariant"
    return {"corruption": "shadow-kv"}.get(kind, kind)


def rerun_on_release(bug: PlantedBug, spec, matrix: Path, root: Path, requests: int, seed: int, catalogue) -> list[str]:
    """The failure keys (and ``verdict:V``) of ``spec``, the same changes and seeds, run once on
    ``bug.base`` as released: the same matrix without the planted patch (kvrepro.explore.rerun_spec)."""
    from kvrepro.explore import CampaignRequest, rerun_spec

    request = CampaignRequest(base=bug.base, patches=(), seed=seed, guided=False, matrix=str(matrix),
                              requests=requests, minimize=False, corpus=False)
    record = rerun_spec(root, request, spec, catalogue)
    if record is None:
        return []
    return [*(f.key for f in record.failures), f"verdict:{record.verdict}"]


def explore_one(bug: PlantedBug, mode: str, matrix: Path, root: Path, budget: str, requests: int, seed: int,
                catalogue) -> Outcome:
    from kvrepro.explore import CampaignRequest, new_campaign, parse_budget, run_campaign
    from kvrepro.results import store as results

    runs_budget, seconds_budget = parse_budget(budget)
    request = CampaignRequest(base=bug.base, patches=(bug.name,), budget_runs=runs_budget,
                              budget_seconds=seconds_budget, seed=seed, guided=mode == "guided",
                              matrix=str(matrix), requests=requests,
                              vocabulary="load" if mode == "generic" else "all", minimize=False)
    state, folder = new_campaign(root, request)
    stop = threading.Event()
    found: dict[str, object] = {}
    first: list[str] = []
    sent: list[int] = []
    reached_runs: list[int] = []
    confirmations: list[str] = []
    confirm_seconds = [0.0]
    oracles: dict[str, int] = {}

    def on_run(record) -> None:
        from kvrepro.explore.coverage import run_arcs

        arcs = run_arcs(folder / "runs" / record.run_id) if record.run_id and bug.reach else set()
        ran = record.target_arcs > 0 or any(f"arc:{probe}" in arcs for probe in bug.reach)
        if ran:
            reached_runs.append(record.spec.index)
        n = 0
        if record.run_id:
            try:
                reps = results.load_run(folder / "runs", record.run_id).build("explore").runs
                n = reps[0].requests if reps else 0
            except Exception:  # noqa: BLE001 - a run folder we cannot read counts 0 requests
                n = 0
        sent.append(n)
        keys = [f.key for f in record.failures]
        if keys and not first:
            first.append(keys[0])
        for key in keys if ran else ():
            oracles.setdefault(oracle_of(key), record.spec.index)
        hit = next((k for k in keys if any(k.startswith(p) for p in bug.expect)), None)
        if hit is not None and not ran:
            # the run never executed the planted lines: the failure is the release's own (measured:
            # 0.30.0 as shipped corrupts with hash_block_size 8 and 2 MTP tokens), not the planted bug
            print(f"  {bug.name} {mode} run {record.spec.index}: {hit} without reaching the planted lines: "
                  "not counted", file=sys.stderr, flush=True)
            hit = None
        if hit is not None and not found:  # the first counted find ends the campaign; later ones are not rerun
            # differential: the same run on the release as shipped. A stall key names no defect (every
            # stall is "stall"), and 0.31.0 as shipped stalls under recompute-failed-load-stall's load,
            # executing the planted admission code on the way: without this, that stall would count
            rerun_started = time.monotonic()
            there = rerun_on_release(bug, record.spec, matrix, root, requests, seed, catalogue)
            confirm_seconds[0] += time.monotonic() - rerun_started
            own = hit in there
            confirmations.append(f"run {record.spec.index}: {hit} -> {'the same' if own else 'not'} on "
                                 f"{bug.base} as released ({', '.join(there)})")
            print(f"  {bug.name} {mode} {confirmations[-1]}" + (": not counted" if own else ""),
                  file=sys.stderr, flush=True)
            if not own:
                found.update(key=hit, index=record.spec.index, entry=record.spec.seed_entry)
                stop.set()
        print(f"  {bug.name} {mode} run {record.spec.index}: {record.verdict} "
              f"{', '.join(keys) or ''} ({record.seconds:.0f}s, {n} requests, {record.arcs} arcs, "
              f"{record.target_arcs} in the patched lines; {record.spec.describe()})", file=sys.stderr, flush=True)

    started = time.monotonic()
    state = run_campaign(state, folder, catalogue, stop=stop, on_run=on_run)
    reached = reached_runs
    return Outcome(bug=bug.name, mode=mode, found=bool(found), runs=len(state.runs),
                   found_at_run=found.get("index"), requests=sum(sent),
                   seconds=round(time.monotonic() - started - confirm_seconds[0], 1),
                   confirmations=confirmations, confirm_seconds=round(confirm_seconds[0], 1),
                   first_failure=first[0] if first else None, found_key=found.get("key"),
                   campaign=state.campaign_id, verdicts=[r.verdict for r in state.runs],
                   reached_at_run=reached[0] if reached else None, target_arcs=[r.target_arcs for r in state.runs],
                   arcs=[r.arcs for r in state.runs], found_from=found.get("entry"), oracles=oracles)


def runs_to_find(o: Outcome, budget_runs: int | None) -> float:
    """Runs to the finding run (1-based); not found: the runs made + 1 (a lower bound)."""
    if o.found:
        return float(o.found_at_run + 1)
    return float((budget_runs or o.runs) + 1)


def table(outcomes: list[Outcome], budget_runs: int | None) -> list[str]:
    lines = [f"{'planted bug':34} {'mode':9} {'found':6} {'run':>4} {'requests':>8} {'s':>6} {'reached':>7}  "
             "first failure"]
    for o in outcomes:
        run = str(o.found_at_run) if o.found else f">{o.runs - 1}"
        # reached: the first run that executed the patched lines (arcs, kvrepro/engine/arcs.py)
        reached = str(o.reached_at_run) if o.reached_at_run is not None else "never"
        lines.append(f"{o.bug:34} {o.mode:9} {'yes' if o.found else 'no':6} {run:>4} {o.requests:>8} "
                     f"{o.seconds:>6.0f} {reached:>7}  {o.first_failure or '-'}"
                     + (f" (from catalogue entry {o.found_from})" if o.found_from else ""))
    by = {(o.bug, o.mode): o for o in outcomes}
    bugs = list(dict.fromkeys(o.bug for o in outcomes))
    # per bug and oracle: the first run (that ran the planted lines) in which that oracle failed
    seen = sorted({name for o in outcomes for name in o.oracles})
    if seen:
        lines.append("oracles (first run that failed them, among runs that ran the planted lines):")
        lines.append(f"  {'planted bug':34} {'mode':9} " + " ".join(f"{name:>17}" for name in seen))
        for o in outcomes:
            lines.append(f"  {o.bug:34} {o.mode:9} " + " ".join(
                f"{o.oracles[name] if name in o.oracles else '-':>17}" for name in seen))
    for mode in MODES:
        got = [by[(b, mode)] for b in bugs if (b, mode) in by]
        if got:
            lines.append(f"{mode}: found {sum(o.found for o in got)}/{len(got)}")
    for other in ("unguided", "generic"):
        ratios = [runs_to_find(by[(b, other)], budget_runs) / runs_to_find(by[(b, "guided")], budget_runs)
                  for b in bugs if (b, other) in by and (b, "guided") in by]
        if ratios:
            lines.append(f"{other} / guided runs-to-find: " + ", ".join(f"{r:.2f}" for r in ratios)
                         + f"; median {statistics.median(ratios):.2f} (>= 2 is the issue's target for unguided;"
                           " a bug not found counts budget + 1)")
        # seconds: a miss counts the run time it spent (a lower bound for the other mode, an upper one
        # for guided); the reruns on the release as shipped are left out of both
        secs = [by[(b, other)].seconds / max(by[(b, "guided")].seconds, 0.1)
                for b in bugs if (b, other) in by and (b, "guided") in by]
        if secs:
            lines.append(f"{other} / guided seconds-to-find: " + ", ".join(f"{r:.2f}" for r in secs)
                         + f"; median {statistics.median(secs):.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bug", action="append", help="a planted bug's name (repeatable; default: all)")
    parser.add_argument("--mode", action="append", choices=MODES, help="repeatable; default: all three")
    parser.add_argument("--budget", default="6", help="per bug and mode: runs (6) or run time (30m)")
    parser.add_argument("--requests", type=int, default=60, help="request budget of each run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--family", action="append", choices=("leak", "double-free", "stranded", "earlier"),
                        help="only the planted bugs of this family (issue 48's; 'earlier': those before it)")
    args = parser.parse_args(argv)

    from kvrepro.errors import KvreproError
    from kvrepro.explore import parse_budget
    from kvrepro.suite.run import load as load_catalogue

    bugs = load_planted()
    if args.bug:
        unknown = sorted(set(args.bug) - {b.name for b in bugs})
        if unknown:
            print(f"--bug {', '.join(unknown)}: not in {PLANTED / 'planted.yaml'} "
                  f"({', '.join(b.name for b in bugs)})", file=sys.stderr)
            return 2
        bugs = [b for b in bugs if b.name in args.bug]
    if args.family:
        bugs = [b for b in bugs if (b.family or "earlier") in args.family]
    # the controls (kind clean, issue 51) have nothing to find: benchmarks/explore_patch_origin.py runs them
    bugs = [b for b in bugs if b.kind != "clean"]
    budget_runs, _ = parse_budget(args.budget)
    catalogue = load_catalogue()
    load_avg = os.getloadavg()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="kvrepro-planted-") as tmp:
        for bug in bugs:
            matrix = planted_matrix(bug, Path(tmp) / bug.name)
            for mode in args.mode or MODES:
                try:
                    outcomes.append(explore_one(bug, mode, matrix, args.results, args.budget, args.requests,
                                                args.seed, catalogue))
                    # each outcome as soon as it is known: a run cut short still leaves its numbers
                    print("  outcome " + json.dumps(asdict(outcomes[-1])), file=sys.stderr, flush=True)
                except KvreproError as exc:  # this bug cannot be explored (a build that fails): say so, go on
                    print(f"  {bug.name} {mode}: {str(exc).strip().splitlines()[0]}", file=sys.stderr, flush=True)
                    outcomes.append(Outcome(bug.name, mode, False, 0, None, 0, 0.0,
                                            "error: " + str(exc).strip().splitlines()[0][:200], None, "-"))
    load_after = os.getloadavg()
    if args.json:
        print(json.dumps({"budget": args.budget, "requests": args.requests, "seed": args.seed,
                          "loadavg_before": load_avg, "loadavg_after": load_after,
                          "outcomes": [asdict(o) for o in outcomes]}, indent=1))
    else:
        print(f"budget {args.budget} per bug and mode, {args.requests} requests per run, seed {args.seed}; "
              f"load average {load_avg[0]:.1f} before, {load_after[0]:.1f} after (2 cores)")
        print("\n".join(table(outcomes, budget_runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
