"""Docker target: time to assemble the default matrix's images, cold vs cached, side by side.

Assembly = find the base image, (cold only) export its vLLM sources in a throwaway container,
apply the build's patches on the host and `docker build` FROM the base with only the patched
files and the probe. "cold": no image and no exported sources exist (a fresh KVREPRO_HOME, the
builds' kvrepro/vllm tags removed); "warm": sources exported, images removed; "cached": every
image already exists and is reused. Goal: cached <= 15 s for A-D.

    python benchmarks/image_assembly.py                          # on kvrepro/vllm-openai-cpu:v<base>
    python benchmarks/image_assembly.py --base-image IMAGE --matrix matrix.yaml

Needs a Docker daemon and the base image (`kvrepro images base-cpu` makes the CPU one).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GOAL_CACHED_S = 15.0


def main() -> int:
    from kvrepro.errors import KvreproError

    try:
        return _main()
    except KvreproError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrix", type=Path, default=ROOT / "matrix.yaml")
    parser.add_argument("--base-image", default=None, help="default: kvrepro/vllm-openai-cpu:v<base>")
    args = parser.parse_args()

    import docker.errors

    from kvrepro.deploy.docker import DockerTarget
    from kvrepro.deploy.docker.basecpu import default_tag
    from kvrepro.spec.matrix import LoadedMatrix, load_matrix

    loaded = load_matrix(args.matrix)
    base_image = args.base_image or default_tag(loaded.matrix.base)
    matrix = loaded.matrix.model_copy(update={"base_image": base_image})
    loaded = LoadedMatrix(matrix, loaded.path, loaded.text)
    plans = loaded.plans()

    def assemble_all(label: str) -> tuple[float, dict[str, tuple[float, bool, str | None]]]:
        target = DockerTarget(loaded)
        per: dict[str, tuple[float, bool, str | None]] = {}
        start = time.monotonic()
        try:
            for plan in plans:
                t = time.monotonic()
                artifact = target.prepare(plan)
                per[plan.name] = (time.monotonic() - t, artifact.reused, artifact.error or artifact.ref)
                if not artifact.ok:
                    raise SystemExit(f"{label}: build {plan.name} failed: {artifact.error}")
        finally:
            target.close()
        return time.monotonic() - start, per

    def remove_images(tags: list[str]) -> None:
        target = DockerTarget(loaded)
        try:
            host = target.host(target.node_specs()[0])
            for tag in tags:
                try:
                    host.client.images.remove(tag, force=True)
                except docker.errors.ImageNotFound:
                    pass
        finally:
            target.close()

    previous = os.environ.get("KVREPRO_HOME")
    try:
        with tempfile.TemporaryDirectory(prefix="kvrepro-bench-") as scratch:
            # Each phase's KVREPRO_HOME decides whether the base's exported sources exist.
            os.environ["KVREPRO_HOME"] = str(Path(scratch) / "learn")
            _, first = assemble_all("learn")  # learn the tags, then make the images absent
            tags = [ref for _, _, ref in first.values() if ref]
            remove_images(tags)
            os.environ["KVREPRO_HOME"] = str(Path(scratch) / "measure")  # nothing exported yet
            cold_s, cold = assemble_all("cold")
            remove_images(tags)
            warm_s, warm = assemble_all("warm")
            cached_s, cached = assemble_all("cached")
    finally:
        if previous is None:
            os.environ.pop("KVREPRO_HOME", None)
        else:
            os.environ["KVREPRO_HOME"] = previous

    print(f"image assembly on {base_image} (vLLM {matrix.base}), builds {', '.join(p.name for p in plans)}")
    print(f"{'build':<8}{'cold s':>10}{'warm s':>10}{'cached s':>10}  reused  image")
    for plan in plans:
        c, w, k = cold[plan.name], warm[plan.name], cached[plan.name]
        print(f"{plan.name:<8}{c[0]:>10.2f}{w[0]:>10.2f}{k[0]:>10.2f}  {'yes' if k[1] else 'no':<6}  {k[2]}")
    print(f"{'total':<8}{cold_s:>10.2f}{warm_s:>10.2f}{cached_s:>10.2f}")
    verdict = "met" if cached_s <= GOAL_CACHED_S else "MISSED"
    print(f"cached total {cached_s:.2f} s vs goal {GOAL_CACHED_S:.0f} s: {verdict} (ratio {cached_s / GOAL_CACHED_S:.3f}); "
          f"cold/cached {cold_s / max(cached_s, 1e-9):.0f}x")
    return 0 if cached_s <= GOAL_CACHED_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
