"""Does a campaign on a patch tell the patch's failures from the base's? (issue 51)

Each row of benchmarks/planted/planted.yaml named here (a planted bug, or a control of kind `clean`:
a change that does nothing) is explored as `kvrepro explore --base X --patch P` would: one full
campaign on its release with its patch, to its budget (no stop at a find), every failing run
replayed on the release without the patch and, when the release does not show it, with the patch
again (kvrepro/explore/origin.py). Reported per campaign: runs, run seconds, the verdicts, the
failures introduced by the patch / already in the base / undecided (with their counts), what the
replays cost against their bound, and whether the campaign says what it should: a planted bug's
expected failure (planted.yaml `expect:`) among the patch's, nothing the patch's for a control.

    python benchmarks/explore_patch_origin.py --bug leak-aborted-blocks-0.30 \\
        --bug clean-free-blocks-refactor-0.30 --budget 4m --requests 60 --seed 1
    python benchmarks/explore_patch_origin.py --bug ... --json > origin.json

Releases 0.30.0-0.33.0 carry known stalls (recompute-failed-load-stall; on 0.30.0 also the MTP
async-load deadlock): before issue 51 every stall there counted as that entry. Campaign folders stay
under --results (explore-*).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("explore_planted", Path(__file__).resolve().parent / "explore_planted.py")
planted = importlib.util.module_from_spec(_spec)
sys.modules["explore_planted"] = planted
_spec.loader.exec_module(planted)


def campaign(bug, matrix: Path, root: Path, budget: str, requests: int, seed: int, share: float,
             catalogue) -> dict:
    from kvrepro.explore import CampaignRequest, new_campaign, parse_budget, run_campaign
    from kvrepro.explore import origin

    runs_budget, seconds_budget = parse_budget(budget)
    request = CampaignRequest(base=bug.base, patches=(bug.name,), budget_runs=runs_budget,
                              budget_seconds=seconds_budget, seed=seed, matrix=str(matrix), requests=requests,
                              minimize=False, replay_share=share)
    state, folder = new_campaign(root, request)
    started = time.monotonic()
    load_before = os.getloadavg()[0]

    def on_run(record) -> None:
        print(f"  {bug.name} run {record.spec.index}: {record.verdict} "
              + "; ".join(f"{f.key} [{f.origin or '-'}]" for f in record.failures), file=sys.stderr, flush=True)

    state = run_campaign(state, folder, catalogue, on_run=on_run)
    groups = origin.grouped(state)
    verdicts: dict[str, int] = {}
    for r in state.runs:
        verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
    introduced = [f.key for f in groups[origin.PATCH]]
    says = (not introduced) if bug.kind == "clean" else any(
        k.startswith(p) for k in introduced for p in bug.expect)
    return {"bug": bug.name, "release": bug.base, "kind": bug.kind, "campaign": state.campaign_id,
            "status": state.status, "runs": len(state.runs), "run_seconds": round(state.elapsed_s, 1),
            "wall_seconds": round(time.monotonic() - started, 1), "verdicts": verdicts,
            "introduced": {f.key: origin.counts_text(f) for f in groups[origin.PATCH]},
            "base": {f.key: origin.counts_text(f) + (f", catalogue {f.entry}" if f.entry else "")
                     for f in groups[origin.BASE]},
            "undecided": {f.key: origin.counts_text(f) for f in groups[origin.UNDECIDED]},
            "replays": origin.cost(state), "as_expected": says, "expect": list(bug.expect),
            "loadavg": [round(load_before, 1), round(os.getloadavg()[0], 1)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bug", action="append", required=True, help="a planted.yaml row (repeatable)")
    parser.add_argument("--budget", default="4m", help="per campaign: runs (8) or run time (4m)")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--replay-share", type=float, default=0.5)
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from kvrepro.suite.run import load as load_catalogue

    bugs = {b.name: b for b in planted.load_planted()}
    unknown = [b for b in args.bug if b not in bugs]
    if unknown:
        print(f"--bug {', '.join(unknown)}: not in {planted.PLANTED / 'planted.yaml'}", file=sys.stderr)
        return 2
    catalogue = load_catalogue()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrepro-origin-") as tmp:
        for name in args.bug:
            bug = bugs[name]
            matrix = planted.planted_matrix(bug, Path(tmp) / name)
            rows.append(campaign(bug, matrix, args.results, args.budget, args.requests, args.seed,
                                 args.replay_share, catalogue))
            print("  outcome " + json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"budget": args.budget, "requests": args.requests, "seed": args.seed,
                          "replay_share": args.replay_share, "rows": rows}, indent=1))
        return 0
    print(f"budget {args.budget} per campaign, {args.requests} requests per run, seed {args.seed}, "
          f"replay share {args.replay_share}")
    for r in rows:
        c = r["replays"]
        print(f"{r['bug']} ({r['release']}): {r['runs']} runs, {r['run_seconds']:.0f} s, {r['verdicts']}; "
              f"as expected: {'yes' if r['as_expected'] else 'NO'}; load average {r['loadavg']}")
        for group in ("introduced", "base", "undecided"):
            for key, counts in r[group].items():
                print(f"  {group:10} {key}: {counts}")
        print(f"  replays: {c['runs']} runs, {c['seconds']:.0f} s, {c['failing_runs_replayed']}/{c['failing_runs']} "
              f"failing runs, {c['failures_served']} failures judged; share of run time {c['share_of_run_time']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
