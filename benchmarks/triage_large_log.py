"""`kvrepro triage` on gigabyte logs: time and peak memory, a 1 GB log and a 100 MB one side by side.

Writes two logs built like a production one (tests/data/triage/seed-0.26-dp4-offload-mtp.log's
start-up lines, then access lines of four DP engines' API server with a stats line per engine every
50 lines, then the seed's crash at the very end), triages each in a fresh process and prints its
wall time, its CPU time (user + system of the triage process and the grep it runs) and peak RSS
(ru_maxrss). Goals: the 1 GB log in at most 10 s, and memory flat: peak RSS of the 1 GB run at most
1.2x the 100 MB run's. The machine is shared: when others load it (the load average is printed),
wall time measures the queue for a core; the CPU time is what two idle cores would need at most
(grep and Python run side by side), so the goal is judged on it and the wall time is printed too.

    python benchmarks/triage_large_log.py [--gb 1.0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "tests" / "data" / "triage" / "seed-0.26-dp4-offload-mtp.log"
GOAL_SECONDS = 10.0
GOAL_RSS_RATIO = 1.2
CHILD = """
import sys, time
from pathlib import Path
from kvrepro.suite.run import load
from kvrepro.triage import triage_file
cat = load()
t0 = time.perf_counter()
found = triage_file(Path(sys.argv[1]), cat)
took = time.perf_counter() - t0
assert found.best is not None and found.best.entry == "offload-boundary-assert", found.best
print(f"{took:.3f} {found.lines}")
"""


def write_log(path: Path, size: int) -> None:
    seed = SEED.read_text().splitlines(keepends=True)
    head, tail = seed[:18], seed[18:]
    lines = []
    for i in range(2000):
        if i % 50 == 49:
            e = (i // 50) % 4
            lines.append(f"2026-08-19T07:{i % 60:02d}:{i % 60:02d}.000000Z (APIServer pid=1) INFO 08-19 07:{i % 60:02d}:"
                         f"{i % 60:02d} [loggers.py:259] Engine {e:03d}: Avg prompt throughput: 41022.{i % 10} tokens/s, "
                         f"Avg generation throughput: 1702.{i % 7} tokens/s, Running: {40 + i % 20} reqs, Waiting: 0 "
                         "reqs, GPU KV cache usage: 70.1%, Prefix cache hit rate: 37.2%, External prefix cache hit "
                         "rate: 11.8%\n")
        else:
            lines.append(f"2026-08-19T07:{i % 60:02d}:{i % 60:02d}.{i:06d}Z (APIServer pid=1) INFO:     10.0.{i % 8}."
                         f"{i % 250}:{40000 + i} - \"POST /v1/chat/completions HTTP/1.1\" 200 OK\n")
    chunk = "".join(lines).encode()
    with open(path, "wb") as fh:
        fh.write("".join(head).encode())
        written = 0
        while written < size:
            fh.write(chunk)
            written += len(chunk)
        fh.write("".join(tail).encode())


def triage_once(path: Path) -> tuple[float, int, float, float]:
    """(wall seconds inside triage, lines, peak RSS in MB, CPU seconds of the whole child) from a
    fresh process (its CPU time includes start-up and imports: an upper bound for triage's)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    took, lines = proc.stdout.split()
    return float(took), int(lines), max(after.ru_maxrss, before.ru_maxrss) / 1024, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="size of the large log (default 1.0 GB)")
    parser.add_argument("--keep", type=Path, help="write the logs here and keep them")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="kvrepro-triage-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {"small": int(args.gb * 1e8), "large": int(args.gb * 1e9)}
    rows = {}
    try:
        for name, size in sizes.items():
            path = folder / f"{name}.log"
            if not path.exists():
                t0 = time.perf_counter()
                write_log(path, size)
                print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s",
                      flush=True)
        # the small one first: ru_maxrss of children is a running maximum
        for name in ("small", "large"):
            path = folder / f"{name}.log"
            took, lines, rss, cpu = triage_once(path)
            rows[name] = (path.stat().st_size, took, lines, rss, cpu)
    finally:
        if args.keep is None:
            for p in folder.glob("*.log"):
                p.unlink()
            folder.rmdir()
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    print(f"{'log':<8}{'size':>10}{'lines':>14}{'wall s':>9}{'CPU s':>8}{'peak RSS':>11}")
    for name, (size, took, lines, rss, cpu) in rows.items():
        print(f"{name:<8}{size / 1e9:>8.2f}GB{lines:>14,}{took:>9.2f}{cpu:>8.2f}{rss:>9.0f}MB")
    (_, t_small, _, r_small, c_small), (_, t_large, _, r_large, c_large) = rows["small"], rows["large"]
    print(f"large/small: wall {t_large / t_small:.2f}, CPU {c_large / c_small:.2f} (10x the bytes); "
          f"peak RSS {r_large / r_small:.2f} (goal <= {GOAL_RSS_RATIO})")
    ok = c_large <= GOAL_SECONDS * args.gb and r_large <= GOAL_RSS_RATIO * r_small
    print(f"goal: {args.gb:g} GB in <= {GOAL_SECONDS * args.gb:.0f} CPU s (wall {t_large:.1f} s) and flat memory: "
          f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
