"""Wall time of a set of kvrepro's own tests, serially and on pytest-xdist workers, in one run.

Goal (issue 27): the README's test command (`bash scripts/test.sh`) in at most 15 minutes of pytest
on 2 cores. The whole suite takes 30 minutes, so this compares a set of tests instead: by default
the slowest ones a CI log lists (`--durations`), run first with `-n 0` and then with the workers
and distribution scripts/test.sh uses, one after the other. Printed side by side: both wall times,
their ratio, the CPU seconds the tests and everything they waited for used (user + system of
pytest's whole process tree), and the load average around each, since on a shared machine the
ratio only means something when the load was alike.

    python benchmarks/pytest_wallclock.py --log ci.log --slowest 20        # the 20 slowest of a CI log
    python benchmarks/pytest_wallclock.py --workers 3 tests/test_engine.py  # any tests, 3 workers
    python benchmarks/pytest_wallclock.py --dists load,loadgroup tests/test_shadow_kv.py  # two distributions
    python benchmarks/pytest_wallclock.py --zygotes tests/test_matrix_e2e.py     # own zygotes vs shared ones

`--dists load,loadgroup` compares two xdist distributions on the same workers instead of serial
and parallel: `load` is what `loadgroup` degrades to when xdist ignores the groups (pytest 9.2
with pytest-xdist 3.8), so it measures what conftest.py's groups save (a module fixture made once).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATION_LINE = re.compile(r"^\s*[0-9.]+s (?:call|setup|teardown)\s+(\S.*?)\s*$")


def slowest_from_log(log: Path, count: int) -> list[str]:
    """The node ids of the ``count`` slowest tests a pytest `--durations` listing names (each once)."""
    found: list[str] = []
    for line in log.read_text(errors="replace").splitlines():
        match = DURATION_LINE.match(line)
        if match and match.group(1) not in found:
            found.append(match.group(1))
    return found[:count]


def timed_pytest(tests: list[str], *options: str, env: dict[str, str] | None = None) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, *tests],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, CI="1", **(env or {})))
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    return {"wall": wall, "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "load": (load_before, os.getloadavg()[0]), "summary": summary, "code": proc.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="*", help="node ids or files (default: the slowest of --log)")
    parser.add_argument("--log", type=Path, help="a pytest log with a --durations listing")
    parser.add_argument("--slowest", type=int, default=20)
    parser.add_argument("--workers", default="2")
    parser.add_argument("--zygotes", action="store_true",
                        help="compare each command's own engine zygote (KVREPRO_TEST_OWN_ZYGOTES=1) against "
                             "the session's shared ones (tests/conftest.py shares_zygotes), same workers")
    parser.add_argument("--dists", help="two xdist distributions to compare (e.g. load,loadgroup) instead of "
                                        "serial against loadgroup")
    args = parser.parse_args()
    tests = args.tests or (slowest_from_log(args.log, args.slowest) if args.log else [])
    if not tests:
        parser.error("name tests, or a CI log with --log")
    print(f"{len(tests)} tests; CPU cores: {os.cpu_count()}")
    if args.zygotes:
        options = ("-n", args.workers, "--dist", "loadgroup")
        runs = [("own zygote per command", timed_pytest(tests, *options, env={"KVREPRO_TEST_OWN_ZYGOTES": "1"})),
                ("shared zygotes", timed_pytest(tests, *options))]
    elif args.dists:
        first, second = args.dists.split(",")
        runs = [(f"-n {args.workers} --dist {d}", timed_pytest(tests, "-n", args.workers, "--dist", d))
                for d in (first, second)]
    else:
        runs = [("serial (-n 0)", timed_pytest(tests, "-n", "0")),
                (f"-n {args.workers} --dist loadgroup", timed_pytest(tests, "-n", args.workers, "--dist", "loadgroup"))]
    (_, serial), (_, parallel) = runs
    for name, r in runs:
        print(f"{name:28} wall {r['wall']:7.1f} s  cpu {r['cpu']:7.1f} s  load {r['load'][0]:.1f} -> "
              f"{r['load'][1]:.1f}  {r['summary']}")
    print(f"ratio {runs[0][0]} / {runs[1][0]} wall: {serial['wall'] / parallel['wall']:.2f}")
    return 0 if serial["code"] == parallel["code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
