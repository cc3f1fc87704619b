"""`kvrepro results list` over many runs: reading every run (before) against the index (after).

Makes N synthetic runs (default 500; each the default matrix's shape: builds A-D x 3
repetitions, a verdict.json, manifest.json and build.json as `matrix run` writes them) in a
temporary results folder, then times, side by side in one run, best of ``--repeat``:

* ``full scan``: ``KVREPRO_RESULTS_INDEX=0`` (every run.json and verdict.json parsed, as before);
* ``index, cold``: the first indexed listing (no results/.index.json yet: it reads every run and
  writes the index);
* ``index, warm``: the listing with the index in place (only stats);
* ``index, 1 run added / 1 deleted by hand``: the warm listing after the folder changed.

Each is the whole command (``python -m kvrepro.cli results list --json``, start-up included) and
the listing alone (``runindex.rows`` in this process). Every listing's rows are checked to be
identical to the full scan's. Goal (issue 16): 500 runs in under 1 s.

    python benchmarks/results_list.py [--runs 500] [--repeat 3] [--baseline ../main]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrepro import lifetime
from kvrepro.results import store as results, index as runindex  # noqa: E402
from kvrepro.deploy.records import BuildRecord, RunManifest
from kvrepro.records import RESULTS_SCHEMA, LoadSummary, Outcome, RunResult, Verdict

GOAL_S = 1.0
BUILDS = ("A", "B", "C", "D")
VERDICTS = {"A": (Verdict.CRASH, Outcome.TARGET), "B": (Verdict.CORRUPT, Outcome.NONE),
            "C": (Verdict.CRASH, Outcome.TARGET), "D": (Verdict.CORRUPT, Outcome.NONE)}


def make_run(root: Path, number: int, reps: int = 3) -> str:
    run_id = f"20260101-{number // 3600:02d}{number // 60 % 60:02d}{number % 60:02d}-{number:04x}"
    folder = results.RunFolder(root=root, run_id=run_id)
    folder.path.mkdir(parents=True)
    results.write_atomic(folder.path / "matrix.yaml", "base: '0.26.0'\n")
    folder.update(schema=RESULTS_SCHEMA, run_id=run_id, status="complete", started=time.time(), finished=time.time(),
                  owner=lifetime.owner(), matrix="matrix.yaml", target="sim", base="0.26.0", bases=["0.26.0"],
                  repetitions=reps, build_order=list(BUILDS),
                  builds={b: {"patches": ["pr-49146"], "base": "0.26.0", "build": b} for b in BUILDS},
                  expect={"A": "CRASH(target)", "B": "CORRUPT", "C": "CRASH(target)", "D": "CORRUPT"},
                  kvrepro_version="0.1.0")
    for build in BUILDS:
        results.write_json(folder.build_dir(build) / "build.json",
                           BuildRecord(ok=True, ref=f"/cache/overlays/{build}", error=None, reused=True,
                                       manifest={"base": "0.26.0", "patches": ["pr-49146"]}))
        verdict, outcome = VERDICTS[build]
        for rep in range(reps):
            rep_dir = folder.rep_dir(build, rep)
            results.write_json(rep_dir / "manifest.json", RunManifest(
                build=build, rep=rep, base="0.26.0", target="sim", patches=(), artifact=None,
                engine_args=("--block-size", "16"), sim_seed=rep, load_seed=rep, load={"profile": "partial-prefix"},
                runs={"requests": 600}, kvrepro_version="0.1.0"))
            results.write_json(rep_dir / "verdict.json", RunResult(
                build=build, rep=rep, verdict=verdict, outcome=outcome, title="AssertionError in update_state_after_alloc",
                trigger_count=11, external_hit_calls=30, requests=75, seconds=3.2, state_count=1,
                run_dir=str(rep_dir), base="0.26.0",
                load=LoadSummary(requests_sent=75, requests_ok=74, requests_failed=1, seconds=2.1,
                                 stopped_because="engine_died", first_failed_index=74)))
    return run_id


CPU: dict[str, float] = {}


def cli_list(root: Path, index: bool, checkout: Path = ROOT) -> tuple[float, list]:
    """Wall seconds of the whole command; its CPU seconds (user + sys) go to CPU["last"]: on a
    machine shared with other work the wall time is mostly waiting for a core."""
    env = dict(os.environ, KVREPRO_RESULTS_INDEX="1" if index else "0")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "results", "list", "--json", "--results", str(root)],
                          cwd=checkout, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU["last"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    return seconds, json.loads(proc.stdout)


def in_process(root: Path, index: bool) -> tuple[float, list]:
    started = time.perf_counter()
    rows = runindex.rows(root, use_index=index)
    return time.perf_counter() - started, rows


def best(fn, repeat: int, reset=None) -> tuple[float, list, float]:
    """Best wall time of ``repeat`` calls, the rows, and the CPU seconds of that best call."""
    runs, rows = [], None
    for _ in range(repeat):
        if reset is not None:
            reset()
        CPU["last"] = float("nan")
        seconds, rows = fn()
        runs.append((seconds, CPU["last"]))
    wall, cpu = min(runs)
    return wall, rows, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another kvrepro checkout (e.g. main before the index) to time on the same runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvrepro-bench-list-") as tmp:
        root = Path(tmp) / "results"
        started = time.perf_counter()
        ids = [make_run(root, i) for i in range(args.runs)]
        print(f"{args.runs} synthetic runs (4 builds x 3 repetitions each) made in {time.perf_counter() - started:.1f} s")
        index_file = root / runindex.INDEX_FILE

        def drop_index() -> None:
            index_file.unlink(missing_ok=True)

        rows_table = []
        if args.baseline is not None:
            base_s, base_rows, base_cpu = best(lambda: cli_list(root, False, args.baseline.resolve()), args.repeat)
            rows_table.append((f"{args.baseline.name} (full scan)", base_s, base_cpu, float("nan"), None))
        for label, index, reset in (("full scan, this branch", False, None), ("index, cold", True, drop_index),
                                    ("index, warm (after)", True, None)):
            cli_s, cli_rows, cli_cpu = best(lambda: cli_list(root, index), args.repeat, reset)
            proc_s, proc_rows, _ = best(lambda: in_process(root, index), args.repeat, reset)
            assert proc_rows == cli_rows
            rows_table.append((label, cli_s, cli_cpu, proc_s, cli_rows))
        ours = [r for r in rows_table if r[4] is not None]
        assert all(r[4] == ours[0][4] for r in ours), "the index lists other rows than the full scan"
        if args.baseline is not None:
            assert base_rows == ours[0][4], "the baseline lists other rows"

        make_run(root, args.runs + 1)  # one more run
        shutil.rmtree(root / ids[0])  # one deleted by hand
        changed_cli, changed_rows = cli_list(root, True)
        changed_cpu = CPU["last"]
        assert changed_rows == cli_list(root, False)[1], "after add/delete the index lists other rows"
        CPU["last"] = changed_cpu
        assert len(changed_rows) == args.runs and changed_rows[0]["run_id"] == ids[1]
        rows_table.append(("index, 1 added + 1 deleted", changed_cli, CPU["last"], float("nan"), changed_rows))

    print(f"results list over {args.runs} runs (best of {args.repeat}; 'command' = python -m kvrepro.cli results "
          f"list --json, start-up included; 'listing' = the rows alone, in process)")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'':30s} {'command':>9s} {'its CPU':>9s} {'listing':>9s}")
    for label, cli_s, cli_cpu, proc_s, _ in rows_table:
        listing = "" if proc_s != proc_s else f"{proc_s:8.3f}s"
        print(f"{label:30s} {cli_s:8.3f}s {cli_cpu:8.3f}s {listing:>9s}")
    before = rows_table[0]
    warm_row = next(r for r in rows_table if r[0].startswith("index, warm"))
    warm, warm_cpu = warm_row[1], warm_row[2]
    print(f"speed-up of the command, {before[0]} / warm index: {before[1] / warm:.1f}x wall, "
          f"{before[2] / warm_cpu:.1f}x CPU; goal < {GOAL_S:.0f} s: "
          + ("met" if warm < GOAL_S else f"NOT met in wall time ({warm:.2f} s)")
          + f", {'met' if warm_cpu < GOAL_S else 'NOT met'} in CPU time ({warm_cpu:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
