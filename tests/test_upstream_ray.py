"""`kvrepro builds test --target ray`: a build's vLLM tests as a Ray task (issue 31, Build 4).

Real parts: Ray (a raylet started with `ray start` on its own loopback address, 127.0.0.11, one
logical CPU), vLLM 0.26.0's own tests from its real sdist, build A's real overlay (sent as its
sha256 bundle, unpacked by the node), pytest with kvrepro's plugin on the node. Faked: nothing;
the "cluster" is one node on this machine (no remote host here), with a node cache of its own
(KVREPRO_RAY_NODE_CACHE), so the node makes the overlay and the test tree from the bundles.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, require

try:
    import ray  # noqa: F401

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.exclusive]

ONE_FILE = "tests/v1/core/test_encoder_cache_manager.py"  # small, CPU-only, none of CI's other handfuls


def _outcomes(build: dict) -> list[tuple]:
    """What a test's result is, wherever it ran (its seconds differ from run to run)."""
    return [(o["nodeid"], o["outcome"], o["message"], o["line"], o["not_run"], o["patch"]) for o in build["outcomes"]]


def test_a_build_job_runs_as_a_ray_task_with_the_local_result_and_cache_key(tmp_path, runtime_python):
    require(HAVE_RAY, "ray is not installed (pip install 'kvrepro[ray]')")
    from kvrepro.builds.upstream_tests import cache_dir
    from kvrepro.deploy.ray.localcluster import LocalCluster

    base_cmd = [sys.executable, "-m", "kvrepro.cli", "builds", "test", "--build", "A", "--only", ONE_FILE, "--all",
                "--later", "0.27.0", "--json", "--results", str(tmp_path / "results")]
    local = subprocess.run(base_cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert local.returncode == 0, local.stderr[-3000:]
    local_a = json.loads(local.stdout)["builds"][0]
    assert local_a["build"] == "A" and local_a["ran"] > 0 and local_a["key"]
    # the build's result is sent to Ray only when not cached: forget it (its key is unchanged below)
    (cache_dir() / "results" / f"{local_a['key']}.json").unlink(missing_ok=True)

    env = dict(os.environ, KVREPRO_RAY_NODE_CACHE=str(tmp_path / "node-cache"))
    cluster = LocalCluster(nodes=1, cpus_per_node=1)
    os.environ["KVREPRO_RAY_NODE_CACHE"] = env["KVREPRO_RAY_NODE_CACHE"]  # inherited by the raylet's workers
    try:
        cluster.start()
        env["RAY_ADDRESS"] = cluster.address
        on_ray = subprocess.run([*base_cmd, "--target", "ray"], capture_output=True, text=True, cwd=ROOT,
                                timeout=1800, env=env)
        again = subprocess.run([*base_cmd, "--target", "ray"], capture_output=True, text=True, cwd=ROOT,
                               timeout=900, env=env)
    finally:
        os.environ.pop("KVREPRO_RAY_NODE_CACHE", None)
        left = cluster.stop()
        assert not left, f"processes of the test cluster still alive: {left}"
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    ray_run = json.loads(on_ray.stdout)
    ray_a = ray_run["builds"][0]
    assert ray_run["command"].endswith("--target ray")
    assert not ray_a["cached"] and ray_a["key"] == local_a["key"]
    assert _outcomes(ray_a) == _outcomes(local_a)
    assert (ray_a["passed"], ray_a["failed"]) == (local_a["passed"], local_a["failed"])
    # the job ran in a worker of the cluster's node, which made the build and the tests from the bundles
    said = " ".join(on_ray.stderr.split())  # rich wraps long lines on stderr
    ran = re.search(r"build A: (\d+) tests ran on Ray node ([0-9a-f]{16,}) \((127\.0\.0\.11)\)", said)
    assert ran and int(ran.group(1)) == len(local_a["outcomes"]), on_ray.stderr[-3000:]
    node_dir = tmp_path / "node-cache" / ran.group(2)[:16]
    assert list((node_dir / "overlays").glob("*/.kvrepro-complete")), "the node did not unpack the build's bundle"
    assert list((node_dir / "test-trees").glob("*/tests/v1/core/test_encoder_cache_manager.py"))
    # a cached build is not sent again
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["builds"][0]["cached"]
    assert "ran on Ray node" not in again.stderr
