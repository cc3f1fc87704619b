"""CPU seconds of short kvrepro commands, this checkout against an earlier commit, side by side.

Why: the test suite runs the real CLI as a subprocess several hundred times (exit codes, one-line
errors, signals), and a developer runs `kvrepro suite list` or a mistyped `matrix run` by hand;
each pays the imports of the modules it reaches and whatever work its first lines do. Measured
2026-12-03: scipy.stats imported at module level (1.5 CPU s) and the catalogue parsing the
default matrix 36 times made `suite list` cost ~4 CPU s.

The earlier commit (``--before``, default: HEAD~1) is checked out into a temporary git worktree
and run with this checkout's venv (``PYTHONPATH`` puts its ``kvrepro`` first); both sides run
each command in turn, ``--rounds`` times, interleaved, so a busy or slow host weighs on both
alike. Printed per command: the mean CPU seconds (user + system, of the command and its
children) of each side and their ratio. The worktree is removed at the end.

The one command that runs an engine, ``matrix run --build A --reps 1`` (build A crashes at request
8), forks it from a shared engine zygote (``KVREPRO_SHARED_ZYGOTES``, started by the first round
and stopped at the end, its CPU not counted): what is measured is the command's own work, e.g.
its report (2026-12-04: scipy.stats and matplotlib imported and a survival figure of one run
drawn, about 3 of its 4.3 CPU s, before the report drew curves only from two runs of a build).

    python benchmarks/cli_start.py --before d30c319
    python benchmarks/cli_start.py --before d30c319 --rounds 12 --json
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = (
    ("suite list", ["suite", "list"]),
    ("matrix run --base 9.9.9 (bad input)", ["matrix", "run", "--base", "9.9.9", "--ci"]),
    # both sides list the same folder (this checkout's results/): each checkout's own folder made the
    # row compare an empty worktree's listing with a full one (2026-12-05: ratio 0.76 from that alone)
    ("results list", ["results", "list", "--results", "{here_results}"]),
    ("--help", ["--help"]),
    ("matrix run --build A --reps 1", ["matrix", "run", "--build", "A", "--reps", "1", "--json",
                                         "--results", "{results}"]),
)


def cpu_seconds(checkout: Path, args: list[str], scratch: Path) -> float:
    """CPU seconds (user + system) of one ``python -m kvrepro.cli ARGS`` run in ``checkout``; its
    runs go to ``scratch``/results and its engines fork from the zygotes in ``scratch``/zygotes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, PYTHONPATH=str(checkout), KVREPRO_SHARED_ZYGOTES=str(scratch / "zygotes"))
    args = [a.replace("{results}", str(scratch / "results")).replace("{here_results}", str(ROOT / "results"))
            for a in args]
    subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=checkout, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="HEAD~1", help="the earlier commit (default HEAD~1)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrepro-cli-start-") as tmp:
        worktree = Path(tmp) / "before"
        (Path(tmp) / "zygotes").mkdir()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(worktree), args.before],
                       check=True)
        try:
            for label, command in COMMANDS:
                sides: dict[str, list[float]] = {"before": [], "after": []}
                for _ in range(args.rounds):
                    sides["before"].append(cpu_seconds(worktree, command, Path(tmp)))
                    sides["after"].append(cpu_seconds(ROOT, command, Path(tmp)))
                before, after = statistics.mean(sides["before"]), statistics.mean(sides["after"])
                rows.append({"command": label, "before_cpu_s": round(before, 3), "after_cpu_s": round(after, 3),
                             "ratio": round(before / after, 2) if after else None, "rounds": args.rounds})
        finally:
            from kvrepro.deploy.sim import stop_shared_zygotes

            stop_shared_zygotes(Path(tmp) / "zygotes")
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"before": args.before, "load_average": round(load, 2), "rows": rows}, indent=2))
        return 0
    print(f"before = {args.before}, after = this checkout; mean CPU s over {args.rounds} interleaved rounds "
          f"(load average {load:.1f})")
    print(f"{'command':40} {'before':>8} {'after':>8} {'ratio':>6}")
    for row in rows:
        print(f"{row['command']:40} {row['before_cpu_s']:8.2f} {row['after_cpu_s']:8.2f} {row['ratio']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
