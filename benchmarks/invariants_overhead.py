"""What the invariants at quiescent points cost: the probe's checks (kvrepro/classify/invariants.py) on and off.

Two offline engines of the same build (kvrepro/engine/offline.py: the EngineCore `vllm serve` builds,
the real scheduler, KV-cache manager and offloading connector over the sim executor, in-process), one
with the probe's invariants and one with ``KVREPRO_PROBE_INVARIANTS=0``, replay the same recorded trace
alternately, so a machine busy with other work slows both alike. The offline engine sends one request
at a time, so the engine comes to rest after every request and the checks run once per request: the
most a load can make them cost (a concurrent load rests less often). Printed: the median CPU seconds
of the engine process per replay (utime + stime from /proc) and the median wall seconds, on and off,
and the ratios.

    python benchmarks/invariants_overhead.py [--base 0.33.0] [--pairs 5] [--trace RUN/X/0/trace.jsonl]

Without --trace it records one first: `kvrepro matrix run` of matrix.yaml's engine and load on
--base, 80 requests, one build without patches (benchmarks/arcs_overhead.py's helpers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arcs_overhead import _matrix, _record_trace, replay_pairs  # noqa: E402

ENV = "KVREPRO_PROBE_INVARIANTS"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="0.33.0")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=80, help="requests of the recorded trace (no --trace)")
    parser.add_argument("--trace", type=Path)
    args = parser.parse_args()

    from kvrepro.loadgen.trace import read_trace
    from kvrepro.matrix import load_matrix

    with tempfile.TemporaryDirectory(prefix="kvrepro-invariants-") as tmp:
        folder = Path(tmp)
        matrix = _matrix(args.base, folder, args.requests)
        trace = read_trace(args.trace or _record_trace(matrix, folder))
        cpu, wall = replay_pairs(load_matrix(matrix), trace, ENV, {"1": "1", "0": "0"}, args.pairs)
    on_cpu, off_cpu = statistics.median(cpu["1"]), statistics.median(cpu["0"])
    on_wall, off_wall = statistics.median(wall["1"]), statistics.median(wall["0"])
    load = os.getloadavg()[0]
    print(json.dumps({"base": args.base, "requests": len(trace.requests), "pairs": args.pairs, "loadavg": load,
                      "cpu_on": cpu["1"], "cpu_off": cpu["0"], "wall_on": wall["1"], "wall_off": wall["0"]}))
    print(f"invariants; vLLM {args.base}, a {len(trace.requests)}-request trace replayed one request at a time "
          f"(a check after each), {args.pairs} pairs, load average {load:.1f} (2 cores)")
    print(f"  invariants on : {on_cpu:6.2f} CPU s, {on_wall:6.2f} s wall per replay (median)")
    print(f"  invariants off: {off_cpu:6.2f} CPU s, {off_wall:6.2f} s wall per replay (median)")
    print(f"  ratio on/off: CPU {on_cpu / off_cpu:.2f}, wall {on_wall / off_wall:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
