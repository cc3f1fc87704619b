"""Requests until the first target crash on build A, over N seeds, for each load side by side.

Every load runs against the same GPU-free engine (vLLM's own `vllm serve` on the sim target, the
shipped matrix's engine section), one run per seed, through `kvrepro matrix run` -- the path
every run takes. A run that does not crash within the budget counts as the budget (a lower bound).

Printed: per load the requests-to-crash of each seed, the median, how many seeds crashed, and the
ratio of each load's median to the default profile's (>1: the default needs fewer requests).

    python benchmarks/requests_to_crash.py                 # 10 seeds, our profiles
    python benchmarks/requests_to_crash.py --seeds 5 --budget 1000

Not measured here yet (issue 11): `vllm bench serve` (prefix-repetition, random-with-prefix) and
guidellm (synthetic prefixes, single- and multi-turn) against the same engine; they need a text
tokenizer the tools' words map onto and a per-request count of what was sent before the crash.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> the load: section (the shipped matrix's engine, builds and patches are kept)
LOADS: dict[str, dict] = {
    "partial-prefix (default)": None,  # the shipped matrix's load: as it is
    "shared_prefix (previous default)": {"profile": "shared_prefix", "concurrency": 4, "documents": 6,
                                         "document_tokens": 400, "suffix_tokens": [0, 39], "max_tokens": 8},
    "shared_prefix sequential": {"profile": "shared_prefix", "concurrency": 1, "documents": 6,
                                 "document_tokens": 400, "suffix_tokens": [0, 39], "max_tokens": 8},
    "multi-turn": {"profile": "multi-turn", "concurrency": 1, "max_tokens": 8},
}


def run(name: str, load: dict | None, seeds: int, budget: int, workdir: Path) -> list[int | None]:
    matrix = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    if load is not None:
        matrix["load"] = {**load, "seed": 0}
    matrix["runs"] = {**matrix.get("runs", {}), "requests": budget, "duration_s": None, "repetitions": seeds}
    matrix["expect"] = {}
    folder = workdir / "".join(c if c.isalnum() else "-" for c in name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "builds").symlink_to(ROOT / "builds")
    path = folder / "matrix.yaml"
    path.write_text(yaml.safe_dump(matrix, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(path), "-b", "A",
                           "--results", str(folder / "results"), "--json"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        sys.exit(f"{name}: kvrepro matrix run exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    from kvrepro import results

    recorded = results.load_run(folder / "results", "latest").build("A")
    return [r.requests if r.label == "CRASH(target)" else None for r in sorted(recorded.runs, key=lambda r: r.rep)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--budget", type=int, default=600, help="requests per run (the matrix's default)")
    parser.add_argument("--only", action="append", help="run only loads whose name starts with this")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="kvrepro-bench-") as tmp:
        for name, load in LOADS.items():
            if args.only and not any(name.startswith(o) for o in args.only):
                continue
            print(f"running {name} ...", file=sys.stderr, flush=True)
            rows[name] = run(name, load, args.seeds, args.budget, Path(tmp))
            print(f"  {name}: {rows[name]}", file=sys.stderr, flush=True)
    medians = {n: statistics.median([v if v is not None else args.budget for v in vals]) for n, vals in rows.items()}
    base = medians.get("partial-prefix (default)")
    print(f"requests until the first target crash on build A ({args.seeds} seeds, budget {args.budget}; "
          f"'-' = no crash within the budget)")
    print(f"{'load':34} {'median':>7} {'crashed':>8} {'x default':>9}  per seed")
    for name, vals in rows.items():
        crashed = sum(v is not None for v in vals)
        ratio = f"{medians[name] / base:.2f}" if base else "-"
        print(f"{name:34} {medians[name]:>7} {crashed:>5}/{len(vals):<2} {ratio:>9}  "
              + " ".join(str(v) if v is not None else "-" for v in vals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
