"""Wall time of the default matrix (A-E x 3 repetitions) with the env cached, and of setup from scratch.

Goal: the cached matrix in 45 s or less on 2 cores, with each run ending once its verdict is
settled (docs/statistics.md, "Sequential stopping per run"). The same matrix is also run with
`--full-load` (every run sends runs.requests) in this one run: both wall times, their ratio and
both verdict lists are printed side by side, and the verdicts must be the same. Also printed: the median time from starting
one engine (vLLM's own `vllm serve`, forked from the zygote) to its first healthy `/health`. Both are measured in this one run and printed
side by side with their ratio to the goal, so a change in speed shows up as a change in ratio.
One line per mode says where the wall time went (from the run records' file times): before the
first run, the runs, after the last; and the shares of engine start, load and tail inside runs.

    python benchmarks/matrix_wallclock.py            # cached matrix + cold setup (downloads ~300 MB)
    python benchmarks/matrix_wallclock.py --no-cold  # cached matrix only
    python benchmarks/matrix_wallclock.py --no-cold --build-zygotes  # and the settled matrix once more with
        # KVREPRO_BUILD_ZYGOTES=0 (each engine imports vLLM itself; kvrepro/engine/zygote.py), run first

With ``--build-zygotes`` each matrix's CPU seconds (kvrepro and every process it waited for) are
printed too: the load of other work on the machine moves wall times, not these.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_MATRIX_S = 45.0


def kvrepro(*args: str, env: dict[str, str] | None = None) -> tuple[float, subprocess.CompletedProcess]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    return time.monotonic() - start, proc


def phases(results: Path, started: float, ended: float) -> str:
    """Where a matrix's wall time went, from its run records (file times, so a loaded machine
    shifts every phase alike): before the first run (CLI, builds, the zygote's preload), the runs,
    after the last (the report); and of the time inside runs, the shares of engine start (to a
    healthy /health), load and tail (last counts, stop, verdict, files)."""
    runs = []
    for verdict_path in results.glob("*/*/[0-9]*/verdict.json"):
        record = json.loads(verdict_path.read_text())
        begun = (verdict_path.parent / "manifest.json").stat().st_mtime
        load_s = (record.get("load") or {}).get("seconds") or 0.0
        runs.append((begun, verdict_path.stat().st_mtime, record.get("engine_start_s") or 0.0, load_s))
    if not runs:
        return "no run records"
    first, last = min(r[0] for r in runs), max(r[1] for r in runs)
    inside = sum(end - begun for begun, end, _, _ in runs)
    start = sum(r[2] for r in runs)
    load = sum(r[3] for r in runs)
    edges = sorted([(r[0], 1) for r in runs] + [(r[1], -1) for r in runs], key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return (f"before runs {first - started:5.1f} s, runs {last - first:5.1f} s, after {ended - last:4.1f} s; "
            f"inside runs: start {start / inside:.0%}, load {load / inside:.0%}, tail {1 - (start + load) / inside:.0%}"
            f" of {inside:.1f} s; at most {peak} runs in flight")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-cold", action="store_true", help="skip the from-scratch setup measurement")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--build-zygotes", action="store_true",
                        help="also run the settled matrix without build zygotes (KVREPRO_BUILD_ZYGOTES=0), first")
    args = parser.parse_args()

    setup_s, proc = kvrepro("setup")  # makes sure the cache is warm before timing the matrix
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return 1
    measured = {}
    breakdown = {}
    cpu = {}
    modes = [("settled", (), {}), ("full-load", ("--full-load",), {})]
    if args.build_zygotes:
        modes.insert(0, ("no-build-zygotes", (), {"KVREPRO_BUILD_ZYGOTES": "0"}))
    for mode, extra, variables in modes:
        with tempfile.TemporaryDirectory() as tmp:
            started = time.time()
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            seconds, proc = kvrepro("matrix", "run", "--json", "--reps", str(args.reps), "--results", tmp, *extra,
                                    env=dict(os.environ, **variables) if variables else None)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[mode] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            breakdown[mode] = phases(Path(tmp), started, time.time())
        if proc.returncode not in (0, 1):
            print(proc.stderr, file=sys.stderr)
            return 1
        measured[mode] = (seconds, json.loads(proc.stdout))
    matrix_s, run = measured["settled"]
    full_s, full_run = measured["full-load"]
    runs = [r for b in run["builds"].values() for r in b["runs"]]
    engine_s = sum(r["seconds"] for r in runs)
    full_engine_s = sum(r["seconds"] for b in full_run["builds"].values() for r in b["runs"])
    starts = sorted(r["engine_start_s"] for r in runs if r.get("engine_start_s") is not None)
    median_start = starts[len(starts) // 2] if starts else float("nan")
    verdicts = {n: " ".join(r["label"] for r in b["runs"]) for n, b in run["builds"].items()}
    full_verdicts = {n: " ".join(r["label"] for r in b["runs"]) for n, b in full_run["builds"].items()}
    # the defects each CORRUPT run named: a run settled at its first named corruption may name fewer
    defects = {n: sorted({d for r in b["runs"] for d in r["kv_defects"]}) for n, b in run["builds"].items()}
    full_defects = {n: sorted({d for r in b["runs"] for d in r["kv_defects"]}) for n, b in full_run["builds"].items()}

    cold_s = None
    if not args.no_cold:
        with tempfile.TemporaryDirectory() as home:
            env = dict(os.environ, KVREPRO_HOME=home)
            cold_s, proc = kvrepro("setup", env=env)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1

    print(f"matrix A-E x {args.reps} (env cached): {matrix_s:7.1f} s   goal {GOAL_MATRIX_S:.0f} s   "
          f"ratio {matrix_s / GOAL_MATRIX_S:.2f}   ({len(runs)} runs, {engine_s:.1f} s inside runs)")
    print(f"same with --full-load:             {full_s:7.1f} s   settled/full-load {matrix_s / full_s:.2f}   "
          f"({full_engine_s:.1f} s inside runs, ratio {engine_s / full_engine_s:.2f})")
    for mode, text in breakdown.items():
        print(f"  phases, {mode + ':':<11} {text}")
    print(f"engine start to healthy, median:   {median_start:7.1f} s   ratio to matrix {median_start / matrix_s:.2f}"
          f"   (min {starts[0] if starts else float('nan'):.1f} s, max {starts[-1] if starts else float('nan'):.1f} s)")
    if args.build_zygotes:
        off_s, off_run = measured["no-build-zygotes"]
        off_runs = [r for b in off_run["builds"].values() for r in b["runs"]]
        off_starts = sorted(r["engine_start_s"] for r in off_runs if r.get("engine_start_s") is not None)
        off_median = off_starts[len(off_starts) // 2] if off_starts else float("nan")
        off_verdicts = {n: " ".join(r["label"] for r in b["runs"]) for n, b in off_run["builds"].items()}
        off_same = all(sorted(verdicts[n].split()) == sorted(off_verdicts.get(n, "").split()) for n in verdicts)
        print(f"build zygotes off (run first):     {off_s:7.1f} s   on/off {matrix_s / off_s:.2f}   CPU "
              f"{cpu['no-build-zygotes']:.1f} s -> {cpu['settled']:.1f} s (on/off {cpu['settled'] / cpu['no-build-zygotes']:.2f})")
        print(f"  engine start median off -> on:   {off_median:7.1f} s -> {median_start:.1f} s   "
              f"verdicts {'the same' if off_same else 'DIFFER'}: "
              + "; ".join(f"{n} {v}" for n, v in off_verdicts.items()))
        same_all = off_same
    else:
        same_all = True
    print(f"setup, cache warm:                 {setup_s:7.1f} s   ratio to matrix {setup_s / matrix_s:.2f}")
    if cold_s is not None:
        print(f"setup from scratch:                {cold_s:7.1f} s   ratio to matrix {cold_s / matrix_s:.2f}")
    same = all(sorted(verdicts[n].split()) == sorted(full_verdicts.get(n, "").split()) for n in verdicts)
    print(f"verdicts (settled | full-load): {'the same' if same else 'DIFFER'}")
    for name, v in verdicts.items():
        stopped = " ".join(f"{r['requests']}:{r.get('stopped_because') or '?'}" for r in run["builds"][name]["runs"])
        print(f"  {name}: {v:<60} | {full_verdicts.get(name, '-')}   requests:stopped {stopped}")
        if defects[name] or full_defects.get(name):
            print(f"     defects named: {', '.join(defects[name]) or '-'} | {', '.join(full_defects.get(name, [])) or '-'}")
    return 0 if same and same_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
