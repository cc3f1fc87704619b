"""What the shadow KV costs: the same runs with it on and off, side by side.

Runs build D (the build that serves the whole budget) with ``KVREPRO_SIM_SHADOW_KV=1`` and ``=0``,
alternating so that a machine busy with other work slows both alike, and prints the median engine
seconds per run of each and their ratio (goal: at most 1.25, i.e. the check adds a quarter).

    python benchmarks/shadow_overhead.py [--build D] [--pairs 3] [--requests 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GOAL_RATIO = 1.25


def run_once(matrix: Path, build: str, shadow: bool, results: Path) -> float:
    env = dict(os.environ, KVREPRO_SIM_SHADOW_KV="1" if shadow else "0")
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(matrix), "--build", build,
                           "--reps", "1", "--json", "--results", str(results)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if not proc.stdout:
        raise SystemExit(proc.stderr[-2000:])
    run = json.loads(proc.stdout)["builds"][build]["runs"][0]
    expected = "off" if not shadow else ("ok", "corrupt")
    assert run["kv_check"] in expected, run
    return float(run["seconds"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default="D")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        spec = yaml.safe_load((ROOT / "matrix.yaml").read_text())
        spec["runs"]["requests"] = args.requests
        spec["expect"] = {}
        (folder / "matrix.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        os.symlink(ROOT / "builds", folder / "builds")
        on, off = [], []
        for _ in range(args.pairs):
            on.append(run_once(folder / "matrix.yaml", args.build, True, folder / "r"))
            off.append(run_once(folder / "matrix.yaml", args.build, False, folder / "r"))
    with_s, without_s = statistics.median(on), statistics.median(off)
    ratio = with_s / without_s
    print(f"build {args.build}, {args.requests} requests, {args.pairs} pairs")
    print(f"  shadow KV on : {with_s:7.1f} s per run (median of {on})")
    print(f"  shadow KV off: {without_s:7.1f} s per run (median of {off})")
    print(f"  ratio on/off : {ratio:.2f}  (goal <= {GOAL_RATIO:.2f}: {ratio / GOAL_RATIO:.2f} of budget)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
