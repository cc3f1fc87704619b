"""First engine of each slot with the zygote's kept lesson, against without it.

The engine zygote (kvrepro/engine/zygote.py) preloads what vLLM's dependencies need; what the
first engine it forks imports beyond that is reported back and preloaded for later forks. Before
the lesson was kept (``~/.cache/kvrepro/zygote/<runtime>.preload``), the first engine of every
slot was forked before any engine had reported, so it imported those modules itself.

Both configurations run side by side in this one run, alternating: build A with two repetitions
on two slots (two first-of-slot engines per matrix run; A crashes at request 8, so the run is
mostly the engine start). "kept" leaves the lesson in place (what kvrepro does now); "none" moves
it aside for the run (what every zygote started with before). Printed: the median seconds from
start to a healthy ``/health`` of the first-of-slot engines of each, and their ratio.

    python benchmarks/zygote_lesson.py            # 2 rounds
    python benchmarks/zygote_lesson.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lesson_files() -> list[Path]:
    from kvrepro import paths

    return sorted((paths.home() / "zygote").glob("*.preload"))


def first_of_slot_starts(results: Path) -> list[float]:
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-b", "A", "--reps", "2",
                           "--jobs", "2", "--json", "--results", str(results)], cwd=ROOT, capture_output=True,
                          text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(proc.stderr[-3000:])
    run = json.loads(proc.stdout)
    return [r["engine_start_s"] for r in run["builds"]["A"]["runs"] if r.get("engine_start_s") is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "kvrepro.cli", "setup"], cwd=ROOT, check=True, capture_output=True)
    starts: dict[str, list[float]] = {"kept": [], "none": []}
    with tempfile.TemporaryDirectory() as tmp:
        aside = Path(tmp) / "aside"
        aside.mkdir()
        for n in range(args.rounds):
            for config in ("kept", "none"):
                moved = []
                if config == "none":
                    for f in lesson_files():
                        shutil.move(str(f), aside / f.name)
                        moved.append(f)
                try:
                    starts[config] += first_of_slot_starts(Path(tmp) / f"{config}-{n}")
                finally:
                    for f in moved:  # the lesson as it was (the run wrote a new one: replaced)
                        shutil.move(str(aside / f.name), f)
    kept, none = statistics.median(starts["kept"]), statistics.median(starts["none"])
    print(f"first engine of a slot, lesson kept:  {kept:6.1f} s median of {len(starts['kept'])}  "
          f"({', '.join(f'{s:.1f}' for s in starts['kept'])})")
    print(f"first engine of a slot, no lesson:    {none:6.1f} s median of {len(starts['none'])}  "
          f"({', '.join(f'{s:.1f}' for s in starts['none'])})")
    print(f"ratio kept/none: {kept / none:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
