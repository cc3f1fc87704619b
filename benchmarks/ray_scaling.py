"""The default matrix on the `ray` target over 1, 2 and 3 local nodes, against the `sim` target.

For each node count N it starts a real Ray cluster on this machine (kvrepro.deploy.ray.localcluster:
one raylet per node on 127.0.0.11..., every address loopback; ``--num-cpus`` per node fixed, so
the runs in flight per node are fixed and only the number of nodes changes), runs the default
matrix (builds A-E x 3 unless told otherwise) on ``target: ray`` and times the whole command.
The same matrix runs once on ``target: sim`` (this machine, its default ``--jobs``); every
verdict of every ray run must equal sim's. With ``--bisect`` a bisection (``bisect releases
--bad 0.26.0 --good 0.27.0 --calibrate 1 --requests 60``) runs on sim and on the 3-node cluster
and their answers are compared. Prints one table.

    python benchmarks/ray_scaling.py [--nodes 1 2 3] [--cpus-per-node 1] [--builds A B C D E] [--reps 3]
                                     [--requests N] [--bisect]

What a one-machine measurement can show: that runs spread over nodes, that the scheduler keeps
every node busy, the per-run overhead of Ray (task submission, bundle unpack, the returned files)
and that verdicts do not depend on where a run ran. What it cannot show: speed-up. All "nodes"
share the same cores, so more nodes mean more engines competing for the same CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrepro.deploy.ray.localcluster import LocalCluster  # noqa: E402


def matrix(folder: Path, target: str, address: str, builds: list[str], reps: int, requests: int | None) -> Path:
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data["builds"] = {k: v for k, v in data["builds"].items() if k in builds}
    data["expect"] = {k: v for k, v in data["expect"].items() if k in builds}
    data["runs"].update(repetitions=reps, start_timeout_s=400)
    if requests:
        data["runs"]["requests"] = requests
    data["target"] = target
    if address:
        data["ray"] = {"address": address}
    if not (folder / "builds").exists():
        (folder / "builds").symlink_to(ROOT / "builds")
    path = folder / f"matrix-{target}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def kvrepro(args: list[str], cwd: Path) -> tuple[float, dict, int]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", *args, "--json"], cwd=cwd, capture_output=True,
                          text=True)
    took = time.monotonic() - started
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        sys.exit(f"kvrepro {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return took, out, proc.returncode


def verdicts(run: dict) -> dict[str, list[str]]:
    return {b: sorted(f"{r['verdict']}:{r['outcome']}:{','.join(sorted(r['kv_defects']))}" for r in info["runs"])
            for b, info in run["builds"].items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--cpus-per-node", type=int, default=1)
    parser.add_argument("--builds", nargs="+", default=["A", "B", "C", "D", "E"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=None, help="override runs.requests")
    parser.add_argument("--bisect", action="store_true", help="also compare a bisection on sim and on 3 nodes")
    args = parser.parse_args()
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    work = Path(tempfile.mkdtemp(prefix="kvrepro-ray-bench-"))
    rows = []
    sim_took, sim_run, _ = kvrepro(["matrix", "run", "-m", str(matrix(work, "sim", "", args.builds, args.reps,
                                                                        args.requests)),
                                    "--results", str(work / "sim"), "--ci"], work)
    sim = verdicts(sim_run)
    rows.append(("sim (this machine, default --jobs)", f"{sim_took:.0f}", "-", "-"))
    bisect_rows = []
    for n in args.nodes:
        with LocalCluster(nodes=n, cpus_per_node=args.cpus_per_node) as cluster:
            m = matrix(work, "ray", cluster.address, args.builds, args.reps, args.requests)
            took, run, _ = kvrepro(["matrix", "run", "-m", str(m), "--results", str(work / f"ray{n}"), "--ci"], work)
            spread = Counter(r["node"]["address"] for info in run["builds"].values() for r in info["runs"] if r["node"])
            same = "yes" if verdicts(run) == sim else f"NO: {verdicts(run)}"
            rows.append((f"ray, {n} node(s) x {args.cpus_per_node} CPU", f"{took:.0f}",
                         " ".join(f"{a}:{c}" for a, c in sorted(spread.items())), same))
            if args.bisect and n == max(args.nodes):
                for target in ("sim", "ray"):
                    m = matrix(work, target, cluster.address, args.builds, args.reps, args.requests)
                    t, b, _ = kvrepro(["bisect", "releases", "-m", str(m), "--bad", "0.26.0", "--good", "0.27.0",
                                       "--calibrate", "1", "--requests", "60", "--results", str(work / f"b-{target}")],
                                      work)
                    bisect_rows.append((target, b.get("answer"), b.get("confidence"), f"{t:.0f}"))
    runs = len(args.builds) * args.reps
    load = os.getloadavg()[0]
    print(f"default matrix, builds {' '.join(args.builds)} x {args.reps} ({runs} runs); "
          f"load average (1 min) at the end: {load:.1f} on {os.cpu_count()} cores")
    print(f"{'target':<36} {'wall s':>7}  {'runs per node':<44} same verdicts as sim")
    for row in rows:
        print(f"{row[0]:<36} {row[1]:>7}  {row[2]:<44} {row[3]}")
    for target, answer, confidence, t in bisect_rows:
        print(f"bisect releases --bad 0.26.0 --good 0.27.0 on {target}: answer {answer}, confidence {confidence}, {t} s")
    if bisect_rows and len({r[1] for r in bisect_rows}) != 1:
        print("bisection answers DIFFER")
        return 1
    return 0 if all(r[3] in ("-", "yes") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
