"""What explore's feedback costs: the engine's arc recorder (kvrepro/engine/arcs.py) on and off, side by side.

Two offline engines of the same build (kvrepro/engine/offline.py: the EngineCore `vllm serve` builds,
the real scheduler, KV-cache manager and offloading connector over the sim executor, in-process),
one with ``KVREPRO_SIM_ARCS=1`` and one with ``=0``, replay the same recorded trace alternately, so a
machine busy with other work slows both alike. Each replay is a fresh EngineCore (a fresh recorder:
every arc is new once, as in a campaign's run). Printed: the median CPU seconds of the engine process
per replay (utime + stime from /proc, what the recorder adds; less sensitive to other load than wall
time) and the median wall seconds the replay took, each on and off, and the ratios.

    python benchmarks/arcs_overhead.py [--recorder instrument|settrace] [--base 0.30.0] [--pairs 5]
                                       [--trace RUN/X/0/trace.jsonl]

Without --trace it records one first: `kvrepro matrix run` of matrix.yaml's engine and load on
--base, 80 requests, one build without patches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _matrix(base: str, folder: Path, requests: int) -> Path:
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data.update(base=base, common=[], builds={"X": []}, expect={}, patches={})
    data.pop("target_signature", None)
    data["runs"].update(repetitions=1, requests=requests)
    path = folder / "matrix.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _record_trace(matrix: Path, folder: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(matrix), "--full-load",
                           "--json", "--results", str(folder / "results")], cwd=ROOT, capture_output=True, text=True)
    if not proc.stdout:
        raise SystemExit(proc.stderr[-2000:])
    found = sorted((folder / "results").rglob("trace.jsonl"))
    if not found:
        raise SystemExit("the run recorded no trace.jsonl")
    return found[0]


def replay_pairs(loaded, trace, env: str, values: dict[str, str], pairs: int) -> tuple[dict, dict]:
    """One offline engine per ``values`` entry (label -> the value of the environment variable ``env``
    it starts with), each replaying ``trace`` in turn, ``pairs`` times: per label, the engine
    process's CPU seconds and the wall seconds of each replay. The engines must do the same (requests
    done), or the measurement is void."""
    from kvrepro.minimize.shrink import OfflineEngine

    engines = {}
    try:
        for label, value in values.items():
            os.environ[env] = value  # the offline engine's environment is kvrepro's
            engines[label] = OfflineEngine(loaded, "X", 0)
        os.environ.pop(env, None)
        cpu: dict[str, list[float]] = {label: [] for label in values}
        wall: dict[str, list[float]] = {label: [] for label in values}
        done: dict[str, list[int]] = {label: [] for label in values}
        for _ in range(pairs):
            for label, engine in engines.items():
                before, started = _cpu_seconds(engine.proc.pid), time.monotonic()
                result = engine.run(trace.requests)
                wall[label].append(time.monotonic() - started)
                cpu[label].append(_cpu_seconds(engine.proc.pid) - before)
                done[label].append(result.requests_done)
    finally:
        os.environ.pop(env, None)
        for engine in engines.values():
            engine.close()
    if len({tuple(d) for d in done.values()}) > 1:  # what is measured must not change what the engine does
        raise SystemExit(f"requests done differ: {done}")
    return cpu, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="0.30.0")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=80, help="requests of the recorded trace (no --trace)")
    parser.add_argument("--trace", type=Path)
    parser.add_argument("--recorder", choices=("instrument", "settrace"), default="instrument",
                        help="instrument: branch probes compiled in (KVREPRO_SIM_ARCS=instrument, explore's); "
                             "settrace: sys.settrace arcs (KVREPRO_SIM_ARCS=1)")
    args = parser.parse_args()

    from kvrepro.loadgen.trace import read_trace
    from kvrepro.matrix import load_matrix

    with tempfile.TemporaryDirectory(prefix="kvrepro-arcs-") as tmp:
        folder = Path(tmp)
        matrix = _matrix(args.base, folder, args.requests)
        trace = read_trace(args.trace or _record_trace(matrix, folder))
        on = "instrument" if args.recorder == "instrument" else "1"
        cpu, wall = replay_pairs(load_matrix(matrix), trace, "KVREPRO_SIM_ARCS", {"1": on, "0": "0"}, args.pairs)
    on_cpu, off_cpu = statistics.median(cpu["1"]), statistics.median(cpu["0"])
    on_wall, off_wall = statistics.median(wall["1"]), statistics.median(wall["0"])
    load = os.getloadavg()[0]
    print(json.dumps({"recorder": args.recorder, "base": args.base, "requests": len(trace.requests), "pairs": args.pairs, "loadavg": load,
                      "cpu_on": cpu["1"], "cpu_off": cpu["0"], "wall_on": wall["1"], "wall_off": wall["0"]}))
    print(f"recorder {args.recorder}; vLLM {args.base}, a {len(trace.requests)}-request trace, {args.pairs} pairs, load average {load:.1f} "
          f"(2 cores)")
    print(f"  arcs on : {on_cpu:6.2f} CPU s, {on_wall:6.2f} s wall per replay (median)")
    print(f"  arcs off: {off_cpu:6.2f} CPU s, {off_wall:6.2f} s wall per replay (median)")
    print(f"  ratio on/off: CPU {on_cpu / off_cpu:.2f}, wall {on_wall / off_wall:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
