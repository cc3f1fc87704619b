"""The first engine on a machine with the runtime env's byte code linked into the engines' byte-code
folder (`kvrepro.builds.runtime.seed_byte_code`, what kvrepro does now) against the same start with
that folder empty (what every fresh machine, a CI job's above all, had before).

Engines run with PYTHONPYCACHEPREFIX (kvrepro.paths.pycache_prefix), so Python ignores the
__pycache__ folders pip filled in the runtime env and compiled torch, transformers & co. again on
the first start. Each round empties the folder and runs `kvrepro matrix run --build D --reps 1`
with a 40-request load twice, interleaved: "compiled" with seeding turned off (its marker put in place
first), "linked" with it on. Printed per configuration: the median CPU seconds the machine spent
(all cores, from /proc/stat: the engine's zygote is not kvrepro's waited-for child, so rusage
would miss it; run it on a quiet machine) and the median wall time, and their ratios.

The real folder is moved aside for the benchmark and put back after it, whatever happens.

    python benchmarks/first_start_bytecode.py              # 2 rounds
    python benchmarks/first_start_bytecode.py --rounds 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrepro import paths  # noqa: E402
from kvrepro.builds import prepare_runtime  # noqa: E402


def busy_seconds() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def one_start(matrix: Path, results: Path, seeded: bool, runtime_key: str) -> tuple[float, float]:
    prefix = paths.pycache_prefix()
    shutil.rmtree(prefix, ignore_errors=True)
    if not seeded:  # the marker says "done": the command leaves the folder empty, as before
        (prefix / ".seeded").mkdir(parents=True)
        (prefix / ".seeded" / runtime_key).write_text("0\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cpu, wall = busy_seconds(), time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(matrix), "--build", "D",
                           "--reps", "1", "--results", str(results), "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    cpu, wall = busy_seconds() - cpu, time.monotonic() - wall
    if proc.returncode not in (0, 1):
        raise SystemExit(f"matrix run failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from kvrepro.spec.matrix import load_matrix

    import yaml

    runtime = prepare_runtime(load_matrix(ROOT / "matrix.yaml").matrix.base)
    prefix = paths.pycache_prefix()
    saved = Path(tempfile.mkdtemp(prefix="pycache-saved-", dir=prefix.parent))
    kept = prefix.exists()
    if kept:
        os.replace(prefix, saved / "pycache")
    measured: dict[str, list[tuple[float, float]]] = {"compiled": [], "linked": []}
    try:
        with tempfile.TemporaryDirectory() as work:
            data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
            data["runs"]["requests"] = 40  # the start is what is measured, not the load
            matrix = Path(work) / "matrix.yaml"
            matrix.write_text(yaml.safe_dump(data, sort_keys=False))
            (Path(work) / "builds").symlink_to(ROOT / "builds")
            for round_ in range(args.rounds):
                for name, seeded in (("compiled", False), ("linked", True)):
                    cpu, wall = one_start(matrix, Path(work) / f"r{round_}-{name}", seeded, runtime.key)
                    measured[name].append((cpu, wall))
                    print(f"round {round_ + 1} {name}: {cpu:.1f} CPU s, {wall:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(prefix, ignore_errors=True)
        if kept:
            os.replace(saved / "pycache", prefix)
        shutil.rmtree(saved, ignore_errors=True)
    summary = {name: {"cpu_s": round(statistics.median(c for c, _ in rows), 1),
                      "wall_s": round(statistics.median(w for _, w in rows), 1)} for name, rows in measured.items()}
    summary["ratio_cpu"] = round(summary["compiled"]["cpu_s"] / summary["linked"]["cpu_s"], 2)
    summary["ratio_wall"] = round(summary["compiled"]["wall_s"] / summary["linked"]["wall_s"], 2)
    summary["rounds"] = args.rounds
    summary["load_average"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(summary))
        return
    print("| first start | CPU s (machine) | wall s |\n|---|---|---|")
    for name in ("compiled", "linked"):
        print(f"| {name} | {summary[name]['cpu_s']} | {summary[name]['wall_s']} |")
    print(f"| ratio | {summary['ratio_cpu']} | {summary['ratio_wall']} |")


if __name__ == "__main__":
    main()
