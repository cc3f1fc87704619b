"""`kvrepro explore --target ray` (issue 28 item 3): a campaign's runs as Ray tasks, several at once,
interrupted and resumed.

Real parts: a Ray cluster of two raylets on this machine (`ray start`, each node on its own
loopback address 127.0.0.11-12, one logical CPU each), vLLM 0.26.0's own `vllm serve` with the
GPU-free plugin on the nodes (only the model executor and the offload data movement are faked, as
everywhere in kvrepro), kvrepro's CLI in a subprocess, a real SIGINT. Faked: the remote hosts (the
nodes are loopback addresses of this one machine); the nodes advertise no GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, local_ray_cluster, require
from kvrepro.explore.campaign import campaign_corpus, next_spec
from kvrepro.explore.coverage import credit
from kvrepro.explore.state import CampaignState
from kvrepro.suite.run import load as load_catalogue

try:
    import ray  # noqa: F401

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.exclusive]

# two runs at once, one on each node (few requests: the whole test suite has 15 minutes); without the
# seed corpus, whose replays run at the entries' concurrency (2-8), which no two engines repeat to the step
CAMPAIGN = ("--base", "0.26.0", "--budget", "2", "--requests", "40", "--seed", "1", "--jobs", "2",
            "--no-minimize", "--no-corpus", "--ci", "--json")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **extra)
    if "RAY_ADDRESS" not in extra:
        env.pop("RAY_ADDRESS", None)
    return env


def _kvrepro(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", "explore", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env=env)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, runtime_python):
    """Two raylets on 127.0.0.11-12, one logical CPU each; torn down (every process of it killed
    by pid, none by name) and checked to have left nothing."""
    require(HAVE_RAY, "ray is not installed (pip install 'kvrepro[ray]')")
    with local_ray_cluster(tmp_path_factory, nodes=2) as c:
        yield c


def _engines_below(cluster) -> set[int]:
    from kvrepro.deploy.ray.localcluster import _cmdline, descendants

    raylets = {p for p in (cluster.raylet_pid(ip) for ip in cluster.addresses) if p}
    assert len(raylets) == 2
    return {p for p in descendants(raylets) if any("kvrepro.engine" in a for a in _cmdline(p))}


def _outcomes(state: CampaignState) -> list[tuple]:
    """Per run: its spec, verdict and failure keys (a title without its counts, which may differ
    with the engines' timing)."""
    return [(r.spec, r.verdict, sorted((f.key, f.status) for f in r.failures)) for r in state.runs]


@pytest.mark.parametrize("args, env, says", [
    (["--target", "nope"], {}, "--target nope: not a target; known: docker, ray, sim"),
    (["--target", "ray"], {}, "target ray: no cluster address; set ray.address in matrix.yaml or RAY_ADDRESS"),
])
def test_a_bad_target_or_no_cluster_is_one_line_exit_2_and_writes_nothing(tmp_path, args, env, says):
    root = tmp_path / "results"
    proc = _kvrepro("--base", "0.26.0", "--budget", "1", *args, "--results", str(root), env=_env(**env))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert not root.exists()


def test_a_campaign_on_ray_interrupted_and_resumed_makes_the_runs_and_verdicts_of_sim(tmp_path, cluster):
    """The same seed and --jobs on sim (two local engines at once) and on the cluster (Ray tasks on
    the nodes): a SIGINT once an engine runs on a node cancels every task (exit 130, no engine left
    under any raylet), explore.json keeps the pending specs; --resume runs them and ends with the
    runs, verdicts and failure keys of the sim campaign. (A single-node engine holds no placement
    group; the Ray target's removal of them on SIGTERM is test_ray_target.py's.)"""
    sim = _kvrepro(*CAMPAIGN, "--results", str(tmp_path / "sim"), env=_env())
    assert sim.returncode == 0, sim.stderr[-3000:]
    on_sim = CampaignState.from_json(json.loads(sim.stdout)["state"])
    assert len(on_sim.runs) == 2 and on_sim.request.jobs == 2
    # made ahead for a larger budget, by the jobs-2 rule: run 2 from what run 0 left (run 0 changes
    # no knob: no credit), run 3 from what runs 0 and 1 left (run 1's knobs credited with its points)
    run0, run1 = on_sim.runs
    assert run1.new_features and [p.index for p in on_sim.pending] == [2, 3]
    assert on_sim.request.corpus is False and campaign_corpus(on_sim.request, load_catalogue()) == ()
    corpus = ()
    after0 = dataclasses.replace(on_sim, runs=[run0], weights=credit({}, run0.spec.keys(), run0.points))
    after1 = dataclasses.replace(on_sim, runs=[run0, run1], weights=credit(after0.weights, run1.spec.keys(), run1.points))
    for pending, state in zip(on_sim.pending, (after0, after1)):
        assert pending == next_spec(state, pending.index, "partial-prefix", corpus)
        assert pending.seed_entry is None  # drawn by the guided rule, not replayed

    root = tmp_path / "ray"
    env = _env(RAY_ADDRESS=cluster.address)
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "kvrepro.cli", "explore", *CAMPAIGN, "--target", "ray",
                                 "--results", str(root)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                env=env)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not _engines_below(cluster) and proc.poll() is None:
            time.sleep(0.5)
        assert _engines_below(cluster), f"no engine started on a node; kvrepro: {proc.poll()}, {log.read_text()[-3000:]}"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()
    deadline = time.monotonic() + 10
    while _engines_below(cluster) and time.monotonic() < deadline:  # a killed engine's pid may linger a moment
        time.sleep(0.5)
    assert not _engines_below(cluster), "an engine survived the cancel"
    folder = next(root.glob("explore-*"))
    stopped = CampaignState.from_json(json.loads((folder / "explore.json").read_text()))
    assert stopped.status == "interrupted" and stopped.request.target == "ray" and len(stopped.runs) < 2
    assert [p.index for p in stopped.pending][:1] == [len(stopped.runs)]

    resumed = _kvrepro("--resume", folder.name, "--results", str(root), "--ci", "--json", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    on_ray = CampaignState.from_json(json.loads(resumed.stdout)["state"])
    assert on_ray.status == "complete" and on_ray.runs[:len(stopped.runs)] == stopped.runs
    assert _outcomes(on_ray) == _outcomes(on_sim)
    nodes = set()
    for r in on_ray.runs:
        verdict = json.loads(next((folder / "runs" / str(r.run_id)).glob("*/*/verdict.json")).read_text())
        nodes.add(verdict["by_target"]["ray"]["node"]["address"])
    # one logical CPU per node: the two runs in flight at once ran on the two nodes
    assert len(nodes) == 2 and all(a.startswith("127.0.0.") for a in nodes), nodes
