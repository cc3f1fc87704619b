"""Time `kvrepro release check X` from "X is on the index" to the whole report, cold then warm.

Cold: an empty kvrepro home (``--home``, default a new temporary folder): the two wheels and sdists
are downloaded, the runtime env is made, vLLM's tests run for the first time. Warm: the same command
again on that home (everything but the suite, the tests' changed outcomes and the explore campaign
is cached). Prints each stage's seconds side by side, the totals and warm/cold, with the load
average at the start and end of each run (the machine is shared: say so beside the numbers).

    python benchmarks/release_check.py [--release 0.34.0] [--budget 5m] [--home DIR] [--warm-only]

docs/benchmarks.md "Release check" quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(release: str, budget: str, home: Path, results: Path) -> dict:
    env = {**os.environ, "KVREPRO_HOME": str(home)}
    started, before = time.monotonic(), load()
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "release", "check", release, "--budget", budget,
                           "--ci", "--json", "--results", str(results)], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    wall = time.monotonic() - started
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return {"exit": proc.returncode, "wall": wall, "load": (before, load()), "report": report,
            "stderr": proc.stderr[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default="0.34.0")
    parser.add_argument("--budget", default="5m")
    parser.add_argument("--home", type=Path, default=None, help="kvrepro home (default: a new empty folder)")
    parser.add_argument("--warm-only", action="store_true", help="one run on --home as it is")
    args = parser.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="kvrepro-release-check-"))
    results = home / "results"
    runs = {}
    for name in (["warm"] if args.warm_only else ["cold", "warm"]):
        runs[name] = run(args.release, args.budget, home, results)
        r = runs[name]
        print(f"{name}: exit {r['exit']}, {r['wall']:.0f} s wall, load {r['load'][0]} -> {r['load'][1]}",
              file=sys.stderr)
    stages = list(next(iter(runs.values()))["report"].get("stages", {}))
    print(f"{'stage':<10}" + "".join(f"{name:>12}" for name in runs))
    for stage in stages:
        print(f"{stage:<10}" + "".join(f"{r['report']['stages'][stage]['seconds']:>12.0f}" for r in runs.values()))
    print(f"{'total':<10}" + "".join(f"{r['wall']:>12.0f}" for r in runs.values()))
    if "cold" in runs and "warm" in runs and runs["cold"]["wall"]:
        print(f"warm / cold: {runs['warm']['wall'] / runs['cold']['wall']:.2f}")
    return 0 if all(r["exit"] in (0, 1) for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
