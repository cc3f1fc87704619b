"""The CI image (kvrepro/data/docker/ci.Dockerfile) builds on the local daemon from local layers
only, and runs the known-defect suite with the kvrepro installed in it, as someone else's CI job
would: `docker run IMAGE suite run --base 0.26.0 --entry offload-boundary-assert`.

Real Docker, real image build, the real vLLM 0.26.0 engine inside the container. The heavy layers
(Debian from debootstrap, torch, vLLM's dependencies) are the docker target's and are reused;
a change to kvrepro's code rebuilds the image's own layer (the wheel and `kvrepro setup`: minutes).
Needs dockerd and those layers (`bash .ci/docker-setup.sh`); fails instead of skipping under CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from test_docker_target import cpu_base, docker_host  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_the_ci_image_builds_and_runs_the_suite(tmp_path, docker_host, cpu_base):
    tag = f"kvrepro/ci:test-{os.getpid()}"
    # `images ci` builds its wheel in the checkout's build/ under a lock of its own (test_install builds one too)
    build = subprocess.run([sys.executable, "-m", "kvrepro.cli", "images", "ci", "--version", "0.26.0", "--tag",
                            tag, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    try:
        assert build.returncode == 0, build.stderr[-3000:]
        built = json.loads(build.stdout)
        assert built["tag"] == tag and built["kvrepro_wheel"].startswith("kvrepro-")
        inspect = subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Entrypoint}}", tag],
                                 capture_output=True, text=True, timeout=120)
        assert json.loads(inspect.stdout) == ["kvrepro"], inspect.stderr

        results = tmp_path / "results"
        results.mkdir()
        run = subprocess.run(["docker", "run", "--rm", "--name", f"kvrepro-test-ci-{os.getpid()}",
                              "-v", f"{results}:/work/results", tag,
                              "suite", "run", "--base", "0.26.0", "--entry", "offload-boundary-assert", "--reps", "1",
                              "--json"], capture_output=True, text=True, timeout=3600)
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        suite = json.loads(run.stdout)
        assert suite["status"] == "complete" and suite["mismatches"] == 0, suite
        assert "site-packages" in suite["catalogue"] or "dist-packages" in suite["catalogue"]  # the shipped one
        (row,) = [r for r in suite["rows"] if r["entry"] == "offload-boundary-assert"]
        assert row["state"] == "PRESENT", row
        assert list(results.glob("suite-*/suite.json"))  # recorded outside the container
    finally:
        # the CLI, not the API client: untagging under load can outlast the client's 20 s timeout
        subprocess.run(["docker", "rmi", tag], capture_output=True, timeout=600)  # absent if the build failed
