"""Engine start with vLLM's model-info cache kept per base release, against one folder shared by
every release (what kvrepro did before ``kvrepro.deploy.sim.vllm_cache_root``).

vLLM keeps ``$VLLM_CACHE_ROOT/modelinfos/<model class>.json`` keyed by the hash of the model's
module file. With one folder for all releases, every engine of a release other than the last one
started finds the hash of another release's file and inspects the model classes again, each in a
subprocess that imports torch and vLLM. A suite or a release table alternates releases all the time.

Both configurations run side by side in this one run, alternating two releases (build A, one
repetition, a short load): "per base" keeps each release's folder (what kvrepro does now);
"shared" empties the release's folder before each start, which is exactly what the shared folder
cost on a release switch (the cached entry was another release's, so vLLM inspected again).
Printed: the median engine start (seconds to a healthy ``/health``) of each, and their ratio.

    python benchmarks/engine_start_cache.py                    # 0.26.0 and 0.30.0, 2 rounds
    python benchmarks/engine_start_cache.py --base 0.25.1 --base 0.33.0 --rounds 3
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrepro import paths  # noqa: E402


def short_matrix(folder: Path) -> Path:
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data["builds"], data["common"] = {"A": []}, []  # the release as released: no patch to port
    data["runs"].update(repetitions=1, requests=30, start_timeout_s=600)
    data.pop("expect", None)
    (folder / "matrix.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (folder / "builds").symlink_to(ROOT / "builds")
    return folder / "matrix.yaml"


def engine_start(matrix: Path, base: str, results: Path) -> float:
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(matrix), "--base", base,
                           "--results", str(results), "--json"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"kvrepro matrix run --base {base} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    (run,) = [r for build in json.loads(proc.stdout)["builds"].values() for r in build["runs"]]
    return float(run["engine_start_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", action="append", help="a release (give two or more; default 0.26.0 and 0.30.0)")
    parser.add_argument("--rounds", type=int, default=2, help="how often each configuration walks the releases")
    args = parser.parse_args()
    bases = args.base or ["0.26.0", "0.30.0"]
    with tempfile.TemporaryDirectory(prefix="kvrepro-bench-") as tmp:
        matrix = short_matrix(Path(tmp))
        for base in bases:  # warm: every release's folder filled once, overlays and pycache made
            engine_start(matrix, base, Path(tmp) / "results")
        starts: dict[str, list[float]] = {"per base": [], "shared": []}
        for _ in range(args.rounds):
            for base in bases:
                for config in ("per base", "shared"):
                    if config == "shared":
                        shutil.rmtree(paths.home() / "vllm-cache" / base / "modelinfos", ignore_errors=True)
                    seconds = engine_start(matrix, base, Path(tmp) / "results")
                    starts[config].append(seconds)
                    print(f"{base:8} {config:9} engine start {seconds:6.1f} s", flush=True)
    per_base, shared = (statistics.median(starts[c]) for c in ("per base", "shared"))
    print(f"\nengine start, median of {len(starts['shared'])} per configuration, releases {', '.join(bases)}:")
    print(f"  model-info cache per base release  {per_base:6.1f} s")
    print(f"  one folder shared by releases      {shared:6.1f} s")
    print(f"  ratio shared / per base            {shared / per_base:6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
