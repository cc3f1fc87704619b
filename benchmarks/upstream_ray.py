"""`kvrepro builds test`: one build's pytest job here and as a Ray task, side by side in one run.

Why: issue 31 (Build 4) asks that the check run on the sim and Ray targets. This script times one
build's job (its cached result forgotten before each run, the release's baseline cached) locally,
then with ``--target ray`` on a real one-node Ray cluster on this machine's loopback
(kvrepro.deploy.ray.localcluster, ``--cpus`` logical CPUs) with the node's cache cold and warm,
and checks that every outcome equals the local run's. The machine may be shared: the load
average is printed with every time. Prints one JSON object last.

    python benchmarks/upstream_ray.py [--build A] [--only tests/v1/core/test_encoder_cache_manager.py] [--cpus 2]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrepro.builds.upstream_tests import cache_dir  # noqa: E402
from kvrepro.deploy.ray.localcluster import LocalCluster  # noqa: E402


def _outcomes(build: dict) -> list[tuple]:
    return [(o["nodeid"], o["outcome"], o["message"], o["line"]) for o in build["outcomes"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="A")
    parser.add_argument("--only", default="tests/v1/core/test_encoder_cache_manager.py")
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="upstream-ray-"))
    cmd = [sys.executable, "-m", "kvrepro.cli", "builds", "test", "--build", args.build, "--only", args.only,
           "--all", "--later", "0.27.0", "--json", "--jobs", str(args.cpus), "--results", str(scratch / "results")]

    def timed(name: str, extra: list[str], env: dict[str, str] | None = None, key: str | None = None) -> dict:
        if key:
            (cache_dir() / "results" / f"{key}.json").unlink(missing_ok=True)
        load = os.getloadavg()[0]
        started = time.monotonic()
        proc = subprocess.run(cmd + extra, capture_output=True, text=True, cwd=ROOT, env=env)
        wall = round(time.monotonic() - started, 1)
        if proc.returncode not in (0, 1):
            sys.exit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        build = json.loads(proc.stdout)["builds"][0]
        row = {"run": name, "wall_s": wall, "job_s": build["seconds"], "cached": build["cached"],
               "tests": len(build["outcomes"]), "load": round(load, 1), "build": build}
        print(f"{name:28} wall {wall:6.1f} s  job {build['seconds']:6.1f} s  cached {build['cached']}  "
              f"load {load:.1f}", flush=True)
        return row

    warm = timed("local (cache warm-up)", [])  # the baseline and the build's key
    key = warm["build"]["key"]
    rows = [timed("local", [], key=key)]
    os.environ["KVREPRO_RAY_NODE_CACHE"] = str(scratch / "node-cache")
    cluster = LocalCluster(nodes=1, cpus_per_node=args.cpus).start()
    try:
        env = dict(os.environ, RAY_ADDRESS=cluster.address)
        rows.append(timed("ray (node cache cold)", ["--target", "ray"], env, key))
        rows.append(timed("ray (node cache warm)", ["--target", "ray"], env, key))
    finally:
        left = cluster.stop()
    same = all(_outcomes(r["build"]) == _outcomes(rows[0]["build"]) for r in rows)
    print(f"outcomes equal: {same}; ray/local job time: "
          f"{rows[1]['job_s'] / rows[0]['job_s']:.2f} (cold), {rows[2]['job_s'] / rows[0]['job_s']:.2f} (warm)")
    print(json.dumps({"rows": [{k: v for k, v in r.items() if k != "build"} for r in rows], "outcomes_equal": same,
                      "cluster_left": sorted(left)}))


if __name__ == "__main__":
    main()
