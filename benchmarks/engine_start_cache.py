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

``--target docker`` measures the docker target's counterpart: "volume" mounts the release's
``kvrepro-vllm-cache-<release>`` volume (what kvrepro does now), "none" sets
``docker.vllm_cache: null``, so the container starts with an empty cache as every container did
before. It needs the CPU base image of each release (``kvrepro images base-cpu --version X``).

    python benchmarks/engine_start_cache.py                    # 0.26.0 and 0.30.0, 2 rounds
    python benchmarks/engine_start_cache.py --base 0.25.1 --base 0.33.0 --rounds 3
    python benchmarks/engine_start_cache.py --target docker    # 0.26.0, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrepro import paths  # noqa: E402


def short_matrix(folder: Path, target: str = "sim", vllm_cache: bool = True) -> Path:
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data["builds"], data["common"] = {"A": []}, []  # the release as released: no patch to port
    data["runs"].update(repetitions=1, requests=30, start_timeout_s=600)
    data.pop("expect", None)
    if target == "docker":
        data["target"] = "docker"
        data.setdefault("docker", {})["vllm_cache"] = "kvrepro-vllm-cache" if vllm_cache else None
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "matrix.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (folder / "builds").symlink_to(ROOT / "builds")
    return folder / "matrix.yaml"


def docker_base_image(base: str) -> list[str]:
    from kvrepro.deploy.docker.basecpu import default_tag

    return ["--base-image", default_tag(base)]


def engine_start(matrix: Path, base: str, results: Path, extra: list[str]) -> float:
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(matrix), "--base", base,
                           "--results", str(results), "--json", *extra], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"kvrepro matrix run --base {base} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    (run,) = [r for build in json.loads(proc.stdout)["builds"].values() for r in build["runs"]]
    return float(run["engine_start_s"])


@dataclass(frozen=True)
class Config:
    """One side of the comparison: its matrix, and what to do before each of its engine starts."""

    label: str
    matrix: Path
    before: Callable[[str], None] = lambda base: None


def side_by_side(title: str, configs: tuple[Config, Config], bases: list[str], rounds: int, results: Path,
                 extra: Callable[[str], list[str]]) -> None:
    """Walk the releases ``rounds`` times, both configurations in turn; print each start and the ratio."""
    kept, dropped = configs
    for base in bases:  # warm: images or overlays made, every release's cache filled once
        engine_start(kept.matrix, base, results, extra(base))
    starts: dict[str, list[float]] = {c.label: [] for c in configs}
    for _ in range(rounds):
        for base in bases:
            for config in configs:
                config.before(base)
                seconds = engine_start(config.matrix, base, results, extra(base))
                starts[config.label].append(seconds)
                print(f"{base:8} {config.label:34} engine start {seconds:6.1f} s", flush=True)
    medians = {label: statistics.median(values) for label, values in starts.items()}
    print(f"\n{title}, median of {rounds * len(bases)} per configuration, releases {', '.join(bases)}:")
    for config in configs:
        print(f"  {config.label:34} {medians[config.label]:6.1f} s")
    print(f"  {'ratio':34} {medians[dropped.label] / medians[kept.label]:6.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", action="append", help="a release (default: sim 0.26.0 and 0.30.0; docker 0.26.0)")
    parser.add_argument("--rounds", type=int, help="how often each configuration walks the releases "
                                                   "(default: sim 2; docker 3)")
    parser.add_argument("--target", choices=("sim", "docker"), default="sim")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvrepro-bench-") as tmp:
        folder = Path(tmp)
        if args.target == "docker":
            configs = (Config("vLLM cache volume per release", short_matrix(folder / "volume", "docker", True)),
                       Config("no volume (an empty cache)", short_matrix(folder / "none", "docker", False)))
            side_by_side("docker engine start", configs, args.base or ["0.26.0"], args.rounds or 3,
                         folder / "results", docker_base_image)
            return 0
        matrix = short_matrix(folder / "sim")

        def forget(base: str) -> None:  # what the shared folder cost on a release switch
            shutil.rmtree(paths.home() / "vllm-cache" / base / "modelinfos", ignore_errors=True)

        configs = (Config("model-info cache per base release", matrix), Config("one folder shared by releases",
                                                                               matrix, forget))
        side_by_side("engine start", configs, args.base or ["0.26.0", "0.30.0"], args.rounds or 2,
                     folder / "results", lambda base: [])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
