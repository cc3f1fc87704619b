"""Engines forked from a frozen zygote heap against an unfrozen one (kvrepro/engine/zygote.py freeze_heap).

The zygote calls gc.freeze() after its preload and each build zygote after importing its vLLM, so
the collections every forked engine process runs (vLLM's freeze_gc_heap at the end of start-up,
automatic gen-2 ones before it) skip the ~630,000 objects they inherited. Both configurations run
side by side in this one run, alternating: ``matrix run -b A --reps R`` (A crashes at request 8,
so a run is mostly its engine's start) with ``KVREPRO_ZYGOTE_GC_FREEZE`` 1 (what kvrepro does)
and 0 (no freeze). Printed per configuration: the median CPU seconds of the whole command with
everything it started (its zygote, build zygote and engines are all reaped below it), the median
wall seconds, the median ``engine_start_s`` of its runs, and the ratios.

    python benchmarks/zygote_gc_freeze.py              # 3 rounds, 3 repetitions each
    python benchmarks/zygote_gc_freeze.py --rounds 5 --reps 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"frozen": "1", "unfrozen": "0"}


def one_command(results: Path, reps: int, freeze: str) -> tuple[float, float, list[float]]:
    """(CPU seconds of the command and all it started, wall seconds, engine start seconds)."""
    env = dict(os.environ, KVREPRO_ZYGOTE_GC_FREEZE=freeze)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-b", "A", "--reps", str(reps),
                           "--jobs", "1", "--json", "--results", str(results)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        raise SystemExit(proc.stderr[-3000:])
    run = json.loads(proc.stdout)
    starts = [r["engine_start_s"] for r in run["builds"]["A"]["runs"] if r.get("engine_start_s") is not None]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, starts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "kvrepro.cli", "setup"], cwd=ROOT, check=True, capture_output=True)
    got: dict[str, dict[str, list[float]]] = {c: {"cpu": [], "wall": [], "start": []} for c in CONFIGS}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.rounds):
            order = list(CONFIGS) if n % 2 == 0 else list(reversed(CONFIGS))
            for config in order:
                cpu, wall, starts = one_command(Path(tmp) / config, args.reps, CONFIGS[config])
                got[config]["cpu"].append(cpu)
                got[config]["wall"].append(wall)
                got[config]["start"].extend(starts)
                print(f"round {n + 1} {config:8}: {cpu:6.1f} CPU s, {wall:6.1f} s wall, engine starts "
                      + ", ".join(f"{s:.1f}" for s in starts), file=sys.stderr, flush=True)
    print(f"matrix run -b A --reps {args.reps}, {args.rounds} rounds each, alternating; load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    med = {c: {k: statistics.median(v) for k, v in d.items()} for c, d in got.items()}
    for c in CONFIGS:
        print(f"{c:8}  CPU {med[c]['cpu']:6.1f} s  wall {med[c]['wall']:6.1f} s  engine start {med[c]['start']:5.2f} s")
    print("unfrozen / frozen: CPU {:.2f}, wall {:.2f}, engine start {:.2f}".format(
        *(med["unfrozen"][k] / med["frozen"][k] for k in ("cpu", "wall", "start"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
