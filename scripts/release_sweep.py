"""Run one no-patch build on every supported vLLM release and print the verdict table.

Why: a release without a working GPU-free engine cannot be validated or bisected; this is the
check behind the release table of docs/engine.md and step 2 of the porting checklist in
``kvrepro/versions.py``. It writes a throwaway matrix (the default matrix's engine and load, no
patches, one build, ``base:`` listing the releases) and runs it with ``kvrepro matrix run``
(the base axis), then prints verdict, trigger count and requests per release, and the disk that
wheels, extracted trees, overlays and runtime envs (with their layers) take.

    python scripts/release_sweep.py                      # all releases in kvrepro/versions.py
    python scripts/release_sweep.py --release 0.30.0     # one (repeatable)
    python scripts/release_sweep.py --reps 3 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvrepro import paths, versions  # noqa: E402


def du(path: Path) -> int:
    """Bytes under ``path``, hard links counted once (overlays share files with the pristine trees)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for item in path.rglob("*") if path.exists() else ():
        try:
            st = item.lstat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        total += st.st_blocks * 512
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="append", help="release to run (default: all supported)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--results", default=str(ROOT / "results"))
    parser.add_argument("--jobs", type=int, default=None, help="engines at once (default: one per core)")
    parser.add_argument("--start-timeout", type=float, default=300.0,
                        help="runs.start_timeout_s: a release's first engine start also warms its zygote")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    releases = args.release or list(versions.SUPPORTED_RELEASES)

    default = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    matrix = {
        "base": releases,
        "target": "sim",
        "builds": {"plain": []},
        "engine": default.get("engine", {}),
        "load": default.get("load", {}),
        "runs": {**default.get("runs", {}), "repetitions": args.reps, "requests": args.requests,
                 "start_timeout_s": args.start_timeout},
    }
    with tempfile.TemporaryDirectory(prefix="kvrepro-sweep-") as tmp:
        matrix_path = Path(tmp) / "matrix.yaml"
        matrix_path.write_text(yaml.safe_dump(matrix, sort_keys=False))
        cmd = [sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(matrix_path),
               "--results", args.results, "--json"] + (["--jobs", str(args.jobs)] if args.jobs else [])
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if not proc.stdout.strip():
        print(f"kvrepro matrix run exited {proc.returncode} without a result", file=sys.stderr)
        return proc.returncode or 1
    run = json.loads(proc.stdout)
    rows = []
    for name, build in run["builds"].items():
        for r in build["runs"]:
            kv_violations = None
            if r.get("run_dir") and (Path(r["run_dir"]) / "verdict.json").is_file():
                kv_violations = json.loads((Path(r["run_dir"]) / "verdict.json").read_text()).get("kv_violations")
            rows.append({"release": r.get("base") or build.get("base"), "verdict": r["verdict"],
                         "outcome": r["outcome"], "trigger_count": r["trigger_count"],
                         "state_count": r.get("state_count"), "state_groups": r.get("state_groups"),
                         "kv_check": r.get("kv_check"), "kv_violations": kv_violations,
                         "requests": r["requests"], "offload_load_jobs": r.get("offload_load_jobs"),
                         "seconds": r["seconds"], "title": r["title"]})
    home = paths.home()
    runtimes = paths.runtimes_dir()
    disk = {
        "wheels": du(paths.wheels_dir()),
        "pristine_trees": du(paths.overlays_dir() / "pristine"),
        "runtime_envs": sum(du(d) for d in runtimes.iterdir() if d.is_dir() and d.name != "layers")
        if runtimes.is_dir() else 0,
        "runtime_layers": du(runtimes / "layers"),
        "envs": sorted(d.name for d in runtimes.iterdir() if d.is_dir() and d.name != "layers")
        if runtimes.is_dir() else [],
        "layers": sorted(d.name for d in (runtimes / "layers").iterdir() if d.is_dir())
        if (runtimes / "layers").is_dir() else [],
    }
    if args.json:
        print(json.dumps({"run_id": run["run_id"], "rows": rows, "disk": disk, "home": str(home)}, indent=2))
        return 0
    print(f"run {run['run_id']} ({run['path']})")
    print(f"{'release':<9} {'verdict':<15} {'trigger':>7} {'state':>6} {'kv':>8} {'viol.':>6} {'requests':>8} "
          f"{'loads':>6} {'seconds':>8}  title")
    for row in rows:
        verdict = row["verdict"] + (f"({row['outcome'].replace('_crash', '')})" if row["verdict"] == "CRASH" else "")
        loads = "?" if row["offload_load_jobs"] is None else row["offload_load_jobs"]
        print(f"{row['release']:<9} {verdict:<15} {row['trigger_count']:>7} {row['state_count'] or 0:>6} "
              f"{row['kv_check'] or '-':>8} {row['kv_violations'] if row['kv_violations'] is not None else '-':>6} "
              f"{row['requests']:>8} {loads:>6} {row['seconds']:>8.1f}  {row['title'][:70]}")
    gib = 1024 ** 3
    print(f"disk under {home}: wheels {disk['wheels'] / gib:.1f} GiB, extracted trees "
          f"{disk['pristine_trees'] / gib:.1f} GiB, {len(disk['envs'])} runtime env(s) "
          f"{disk['runtime_envs'] / gib:.1f} GiB + {len(disk['layers'])} layer(s) {disk['runtime_layers'] / gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
