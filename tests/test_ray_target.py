"""The `ray` target on a real multi-node Ray cluster on this machine (issue 19).

Real parts: Ray (one raylet per node, started with `ray start`, each node on its own loopback
address 127.0.0.11-13), vLLM's own `vllm serve` of each build with the GPU-free plugin (only the
model executor and the offload data movement are faked, as everywhere in kvrepro), real signals,
real processes. Faked: nothing of Ray; the nodes advertise no GPUs (``--num-cpus 1`` each: one
GPU-free engine per node at a time). The matrix is the default one shrunk to builds A and E,
one repetition and a small request budget (2 cores on this machine).
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from conftest import ROOT, local_ray_cluster, require
from test_docker_target import cpu_base, docker_host  # noqa: F401 (fixtures: the local dockerd, the CPU base)

try:
    import ray  # noqa: F401

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.exclusive]


def _kvrepro(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _matrix(folder: Path, target: str, address: str, requests: int = 60, reps: int = 1,
            builds: tuple[str, ...] = ("A", "E"), **ray_settings: object) -> Path:
    """The default matrix, builds A and E only (or ``builds``), on ``target`` (more ``ray:`` settings
    as keywords)."""
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data["builds"] = {k: v for k, v in data["builds"].items() if k in builds}
    data["expect"] = {k: v for k, v in data["expect"].items() if k in builds}
    data["runs"].update(requests=requests, repetitions=reps, start_timeout_s=400)
    data["target"] = target
    data["ray"] = {"address": address, **ray_settings}
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "builds").exists():
        (folder / "builds").symlink_to(ROOT / "builds")
    path = folder / f"matrix-{target}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, overlays):
    """Three raylets on 127.0.0.11-13, one logical CPU each; torn down (every process of it killed
    by pid, none by name) and checked to have left nothing."""
    require(HAVE_RAY, "ray is not installed (pip install 'kvrepro[ray]')")
    with local_ray_cluster(tmp_path_factory, nodes=3) as c:
        yield c


def _node_addresses(address: str) -> list[str]:
    code = ("import json, ray; ray.init(address=%r, _node_ip_address=%r, log_to_driver=False, logging_level='ERROR');"
            "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
            % (address, address.rpartition(":")[0]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _placement_groups(address: str) -> list[dict]:
    """Every placement group the cluster knows (removed ones too: state REMOVED), from a driver of its own."""
    code = ("import json, ray; ray.init(address=%r, _node_ip_address=%r, log_to_driver=False, logging_level='ERROR');"
            "from ray.util import placement_group_table;"
            "print(json.dumps([{'name': g['name'], 'state': g['state'], 'strategy': g['strategy']}"
            " for g in placement_group_table().values()]))" % (address, address.rpartition(":")[0]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _engine_window(run_dir: Path) -> tuple[float, float]:
    """(when the run's engine logged its first line, when its last request ended), epoch seconds.
    vLLM's log lines carry local time to the second (``INFO 12-01 18:47:33 ...``), cut down to
    the second: the start is never later than the engine's."""
    import datetime

    stamp = next(line.split()[1:3] for line in (run_dir / "engine.log").read_text().splitlines()
                 if len(line.split()) > 2 and line.split()[0] in ("INFO", "WARNING", "DEBUG", "ERROR"))
    year = datetime.datetime.now().year
    start = datetime.datetime.strptime(f"{year}-{stamp[0]} {stamp[1]}", "%Y-%m-%d %H:%M:%S").timestamp()
    requests = [json.loads(line) for line in (run_dir / "load.jsonl").read_text().splitlines() if line.strip()]
    end = max(r["started_at"] + (r["latency_s"] or 0) for r in requests)
    return start, end


def _engines_below(pids: set[int]) -> set[int]:
    from kvrepro.deploy.ray.localcluster import _cmdline, descendants

    return {p for p in descendants(pids) if any("kvrepro.engine" in a for a in _cmdline(p))}


def _started(matrix: Path, tmp_path: Path, log: Path) -> subprocess.Popen:
    """`kvrepro matrix run --ci` in the background, its stderr in ``log``."""
    with log.open("w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(matrix), "--results",
                                 str(tmp_path / "r"), "--ci"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr)


def _terminated(proc: subprocess.Popen, log: Path, then: Callable[[], None] = lambda: None) -> None:
    """SIGTERM to kvrepro: it exits 130 within 120 s and prints no traceback (killed if it hangs);
    ``then`` is checked the moment it exited (what must be gone by then), before a 3 s settle."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    then()
    time.sleep(3)


def test_without_ray_the_target_says_how_to_install_it(tmp_path):
    """Missing extra, simulated: the child python gets a meta-path finder that refuses `ray`
    (as an environment without the extra would), then runs kvrepro's CLI."""
    matrix = _matrix(tmp_path, "ray", "127.0.0.1:1")
    code = ("import sys\n"
            "class NoRay:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'ray' or name.startswith('ray.'):\n"
            "            raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n"
            "sys.meta_path.insert(0, NoRay())\n"
            "from kvrepro.cli import main\n"
            "sys.argv = ['kvrepro'] + sys.argv[1:]\n"
            "main()\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, "matrix", "run", "-m", str(matrix), "--results",
                           str(tmp_path / "r"), "--ci"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'kvrepro[ray]'" in lines[0], proc.stderr
    assert time.monotonic() - started < 60


def test_an_unreachable_cluster_is_a_named_infra_at_once(tmp_path):
    require(HAVE_RAY, "ray is not installed (pip install 'kvrepro[ray]')")
    matrix = _matrix(tmp_path, "ray", "127.0.0.1:1")  # nothing listens on port 1
    started = time.monotonic()
    proc = _kvrepro("matrix", "run", "-m", str(matrix), "--results", str(tmp_path / "r"), "--ci", cwd=tmp_path,
                    timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "INFRA: ray cluster unreachable at 127.0.0.1:1 (Connection refused" in proc.stderr, proc.stderr
    assert took < 30, took  # not Ray's own minute of retries


def test_matrix_on_ray_gives_the_sim_verdicts_spread_over_loopback_nodes(tmp_path, cluster):
    addresses = _node_addresses(cluster.address)
    assert len(addresses) == 3
    assert all(ipaddress.ip_address(a) in ipaddress.ip_network("127.0.0.0/8") for a in addresses), addresses

    verdicts = {}
    runs = {}
    for target in ("sim", "ray"):
        matrix = _matrix(tmp_path, target, cluster.address)
        proc = _kvrepro("matrix", "run", "-m", str(matrix), "--results", str(tmp_path / target), "--json", "--ci",
                        cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = json.loads(proc.stdout)
        runs[target] = run
        verdicts[target] = {b: [(r["verdict"], r["outcome"], sorted(r["kv_defects"])) for r in info["runs"]]
                            for b, info in run["builds"].items()}
    assert verdicts["ray"] == verdicts["sim"], verdicts

    nodes = set()
    for b, info in runs["ray"]["builds"].items():
        for r in info["runs"]:
            run_dir = Path(r["run_dir"])
            assert run_dir.is_relative_to(tmp_path / "ray"), run_dir  # the driver's folder, not the node's
            for name in ("engine.log", "load.jsonl", "trace.jsonl", "metrics.txt", "manifest.json", "verdict.json"):
                assert (run_dir / name).is_file(), (b, name)
            verdict = json.loads((run_dir / "verdict.json").read_text())
            manifest = json.loads((run_dir / "manifest.json").read_text())
            assert verdict["by_target"]["ray"]["node"] == manifest["by_target"]["ray"]["node"] and manifest["target"] == "ray"
            assert ipaddress.ip_address(verdict["by_target"]["ray"]["node"]["address"]).is_loopback
            nodes.add(verdict["by_target"]["ray"]["node"]["node_id"])
    assert len(nodes) > 1, "both runs ran on one node"  # one CPU per node: two runs cannot share one
    report = (Path(runs["ray"]["path"]) / "report.md").read_text()
    assert "| node |" in report and "127.0.0.1" in report
    # each build was unpacked on its node from its bundle (content-addressed), not rebuilt
    cache = Path(os.environ["KVREPRO_RAY_NODE_CACHE"])
    unpacked = list(cache.glob("*/overlays/*/.kvrepro-complete"))
    assert len(unpacked) >= 2 and all(len(p.parent.name) == 32 for p in unpacked)


def test_ctrl_c_and_sigterm_cancel_every_task_and_leave_no_engine(tmp_path, cluster):
    raylets = {p for p in (cluster.raylet_pid(ip) for ip in cluster.addresses) if p}
    assert len(raylets) == 3
    matrix = _matrix(tmp_path, "ray", cluster.address, requests=600)
    log = tmp_path / "stderr.txt"
    proc = _started(matrix, tmp_path, log)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not _engines_below(raylets) and proc.poll() is None:
            time.sleep(0.5)
        seen = _engines_below(raylets)
        assert seen, f"no engine started on any node; kvrepro: {proc.poll()}, {log.read_text()[-3000:]}"
    except BaseException:
        proc.kill()
        raise
    _terminated(proc, log)
    assert not _engines_below(raylets), "an engine survived the cancel"
    assert not [p for p in seen if Path(f"/proc/{p}").exists()]
    run = json.loads(next((tmp_path / "r").glob("*/run.json")).read_text())
    assert run["status"] == "interrupted"


def test_a_build_bundle_is_content_addressed_and_unpacks_to_the_same_overlay(tmp_path, monkeypatch, overlays):
    """No Ray needed: build E's overlay packed (only what is not the pristine tree), unpacked on a
    "node" with its own cache, is file for file the overlay; the pristine tree is not written
    through its hard links; a second unpack reuses it; damaged bytes are refused."""
    import hashlib

    from kvrepro.builds import pristine_tree
    from kvrepro.deploy.ray.bundle import pack, unpack, unpacked
    from kvrepro.errors import InfraError

    monkeypatch.setenv("KVREPRO_RAY_NODE_CACHE", str(tmp_path / "nodes"))
    overlay = overlays["E"]
    _, pristine, _ = pristine_tree("0.26.0")
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (pristine / "vllm" / "v1" / "core").rglob("*.py")}
    ref, data = pack(overlay, "0.26.0")
    assert ref == pack(overlay, "0.26.0")[0]  # deterministic: same build, same sha256
    assert ref.size < 2_000_000  # the patched files, not the 157 MB tree
    with pytest.raises(InfraError, match="damaged"):
        unpack(ref, data[:-1] + b"x", "node-a")
    assert unpacked(ref, "node-a") is None
    dest = unpack(ref, data, "node-a")
    assert unpacked(ref, "node-a") == dest and unpack(ref, data, "node-a") == dest
    assert unpacked(ref, "node-b") is None  # every node unpacks its own
    ours = {p.relative_to(overlay).as_posix(): p for p in overlay.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    theirs = {p.relative_to(dest).as_posix(): p for p in dest.rglob("*") if p.is_file() and "__pycache__" not in p.parts
              and p.name != ".kvrepro-complete"}
    assert set(ours) == set(theirs)
    assert all(ours[k].read_bytes() == theirs[k].read_bytes() for k in ours)
    assert before == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in before}


def test_ray_settings_are_checked_with_file_line_and_field(tmp_path):
    """`ray:` belongs to the ray target (deploy/ray/settings.py) and is checked without Ray installed."""
    from kvrepro.errors import SpecError
    from kvrepro.matrix import load_matrix

    for bad, message in [({"address": "nohost"}, "ray.address: 'nohost': give host:port"),
                         ({"max_retries": -1}, "ray.max_retries: Input should be greater than or equal to 0"),
                         ({"bogus": 1}, "ray.bogus: unknown field; allowed here: address"),
                         ({"nodes_per_engine": 0}, "ray.nodes_per_engine: Input should be greater than or equal to 1"),
                         ({"engine": "k8s"}, "ray.engine: Input should be 'sim' or 'docker'")]:
        data = yaml.safe_load(_matrix(tmp_path, "ray", "127.0.0.1:1").read_text())
        data["ray"] = bad
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        with pytest.raises(SpecError) as info:
            load_matrix(path)
        assert message in str(info.value) and "bad.yaml:" in str(info.value), str(info.value)
    from kvrepro.deploy.ray.settings import DEFAULT_MAX_RETRIES, ray_settings

    assert ray_settings(load_matrix(_matrix(tmp_path, "ray", "127.0.0.1:1")).matrix).max_retries == DEFAULT_MAX_RETRIES == 2


def test_engine_docker_with_docker_hosts_is_one_line(tmp_path):
    """ray.engine docker uses each node's own daemon: a hosts: list (the docker target's) is refused
    in one line, exit 2, before any cluster is asked (the address here answers nothing)."""
    require(HAVE_RAY, "ray is not installed (pip install 'kvrepro[ray]')")
    matrix = _matrix(tmp_path, "ray", "127.0.0.1:1", engine="docker")
    data = yaml.safe_load(matrix.read_text())
    data["hosts"] = [{"name": "gpu-0", "docker": "tcp://10.0.0.5:2375"}]
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = _kvrepro("matrix", "run", "-m", str(matrix), "--results", str(tmp_path / "r"), "--ci", cwd=tmp_path,
                    timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "ray.engine docker: every node runs its engine in its own Docker daemon; remove hosts:" in lines[0]


def test_an_engine_wider_than_the_cluster_is_one_line_at_once(tmp_path, cluster):
    """ray.nodes_per_engine 4 on three nodes can never be placed: one line naming the field, exit 2,
    before anything is built or queued (not a run waiting in Ray's queue forever)."""
    matrix = _matrix(tmp_path, "ray", cluster.address, builds=("A",), nodes_per_engine=4)
    started = time.monotonic()
    proc = _kvrepro("matrix", "run", "-m", str(matrix), "--results", str(tmp_path / "r"), "--ci", cwd=tmp_path,
                    timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "ray.nodes_per_engine 4: the cluster at" in lines[0], proc.stderr
    assert "3 alive node(s) with 1 CPU" in lines[0] and "Traceback" not in proc.stderr
    assert time.monotonic() - started < 60


def test_a_two_node_docker_engine_holds_a_placement_group_and_its_image_is_made_once(
        tmp_path, cluster, docker_host, cpu_base):
    """ray.engine docker with ray.nodes_per_engine 2, on three nodes of one CPU each.

    Placement: each run holds a STRICT_SPREAD placement group of two one-CPU bundles, so only one
    such engine fits at a time and the other run waits (queued) for a group; each record names
    both nodes of its group (the engine's first), the engines did not overlap, and every group is
    removed afterwards. Image: each node makes sure the build's image (content-addressed tag) is in
    its own daemon and runs the engine there as a container, with the docker target's own code.
    Here all three nodes share this machine's one dockerd (so they share its images and its
    lock). Build A gets the decoy patch (a docstring reworded: no behaviour changes) with a header
    line unique to this test, so its image's tag is new: the first run makes it, the second reuses
    it. Both give build A's verdict (the one sim gives, test above) and no container of theirs is
    left. The test removes the image it made (no other image is touched). (One test for both: each
    engine start here costs 30-80 s of the CI's time.)"""
    import hashlib
    import uuid

    from kvrepro.deploy.docker import labels as L

    folder = tmp_path / "m"
    (folder / "builds").mkdir(parents=True)
    for path in (ROOT / "builds").iterdir():
        (folder / "builds" / path.name).symlink_to(path)
    patch = f"# Test token: {uuid.uuid4().hex} (a new image tag for this test only)\n".encode() \
        + (ROOT / "builds" / "decoy-docstring.patch").read_bytes()
    (folder / "builds" / "decoy-once.patch").write_bytes(patch)
    raylets = {p for p in (cluster.raylet_pid(ip) for ip in cluster.addresses) if p}
    matrix = _matrix(folder, "ray", cluster.address, requests=60, reps=2, builds=("A",), engine="docker",
                     nodes_per_engine=2)
    data = yaml.safe_load(matrix.read_text())
    data["base_image"] = cpu_base
    data["patches"]["decoy-once"] = dict(data["patches"]["decoy-docstring"], file="decoy-once.patch",
                                         sha256=hashlib.sha256(patch).hexdigest())
    data["builds"]["A"] = ["decoy-once"]
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    tags: set[str] = set()
    try:
        proc = _kvrepro("matrix", "run", "-m", str(matrix), "--results", str(tmp_path / "r"), "--json", "--ci",
                        cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = [r for info in json.loads(proc.stdout)["builds"].values() for r in info["runs"]]
        assert [r["label"] for r in results] == ["CRASH(target)", "CRASH(target)"], results
        artifacts = [json.loads((Path(r["run_dir"]) / "manifest.json").read_text())["artifact"] for r in results]
        tags = {a["ref"] for a in artifacts}
        assert len(tags) == 1 and next(iter(tags)).startswith("kvrepro/vllm:0.26.0-"), artifacts
        assert sorted(a["reused"] for a in artifacts) == [False, True], artifacts  # made once, then reused
        assert "queued for a placement group of 2 nodes" in proc.stderr  # one run waited for the other's nodes
        for r in results:  # the ray target's own section of the run's records (by_target.ray)
            held = r["by_target"]["ray"]["placement_nodes"]
            assert len(held) == 2 and held[0] == r["by_target"]["ray"]["node"] and held[0]["node_id"] != held[1]["node_id"], r
            manifest = json.loads((Path(r["run_dir"]) / "manifest.json").read_text())
            assert manifest["by_target"]["ray"] == r["by_target"]["ray"]
        report = (next((tmp_path / "r").glob("*/report.md"))).read_text()
        sections = [r["by_target"]["ray"] for r in results]
        assert all(f"{p['node']['address']} ({p['node']['node_id'][:8]}) + {p['placement_nodes'][1]['address']}"
                   in report for p in sections), report
        first, second = sorted(_engine_window(Path(r["run_dir"])) for r in results)
        assert first[1] <= second[0], (first, second)  # the second engine started after the first one's last request
        groups = [g for g in _placement_groups(cluster.address) if g["name"].startswith("kvrepro-")]
        assert len(groups) >= 2 and all(g["strategy"] == "STRICT_SPREAD" for g in groups), groups
        assert all(g["state"] == "REMOVED" for g in groups), groups
        for r in results:  # the container's own log came back with the run
            assert (Path(r["run_dir"]) / "docker.log").is_file(), r["run_dir"]
        time.sleep(2)
        left = [c.name for c in docker_host.client.containers.list(all=True, filters=L.MANAGED_FILTER,
                                                                    ignore_removed=True)
                if "/ray-run-" in c.labels.get(L.LABEL_RUN, "")]
        assert not left, left
        assert not _engines_below(raylets)
    finally:
        for tag in tags:
            docker_host.client.images.remove(tag)


@pytest.mark.parametrize("worker", ["tears down", "too slow"])
def test_sigterm_removes_every_placement_group_and_container(tmp_path, cluster, docker_host, cpu_base, worker):
    """SIGTERM to kvrepro while one 2-node engine runs in a container (ray.engine docker; the
    container's environment names its placement group and both nodes) and the second run waits
    for its group: exit 130, both groups removed (the waiting one and the running one's), no
    container of the runs left when kvrepro has exited, no engine process on any node.

    "too slow": the worker running the engine's task cannot tear it down within ray.cancel_grace_s
    (a loaded machine: seen in CI at load 8-20 on 2 cores). Made deterministic: the test freezes the
    worker (SIGSTOP) and kills the docker session's reaper beside it (as Ray's forced cancel kills a
    worker's children with it); the worker is then killed after the grace with its container
    running, and only the driver's sweep of its nodes removes it before kvrepro exits."""
    from kvrepro.deploy.docker import labels as L

    def containers(running_only: bool = False) -> list:
        return [c for c in docker_host.client.containers.list(all=True, filters=L.MANAGED_FILTER, ignore_removed=True)
                if "/ray-run-" in c.labels.get(L.LABEL_RUN, "") and (c.status == "running" or not running_only)]

    raylets = {p for p in (cluster.raylet_pid(ip) for ip in cluster.addresses) if p}
    matrix = _matrix(tmp_path, "ray", cluster.address, requests=600, reps=2, builds=("E",), nodes_per_engine=2,
                     engine="docker", **({"cancel_grace_s": 1} if worker == "too slow" else {}))
    data = yaml.safe_load(matrix.read_text())
    data["base_image"] = cpu_base
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    log = tmp_path / "stderr.txt"
    proc = _started(matrix, tmp_path, log)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not containers(running_only=True) and proc.poll() is None:
            time.sleep(0.5)
        running = containers(running_only=True)
        assert running, f"no engine container started; {log.read_text()[-3000:]}"
        env = dict(e.split("=", 1) for e in running[0].attrs["Config"]["Env"])  # the group, named to the engine
        assert env["KVREPRO_RAY_PLACEMENT_GROUP_NAME"].startswith(f"kvrepro-{proc.pid}-E-"), env
        assert env["KVREPRO_RAY_PLACEMENT_BUNDLES"] == "0,1" and len(env["KVREPRO_RAY_PLACEMENT_GROUP"]) > 16
        assert len(set(env["KVREPRO_RAY_PLACEMENT_NODES"].split(","))) == 2, env
        waiting = time.monotonic() + 30
        while "queued for a placement group of 2 nodes" not in log.read_text() and time.monotonic() < waiting:
            time.sleep(0.5)
        assert "queued for a placement group of 2 nodes" in log.read_text()  # the second run waits for its group
        if worker == "too slow":
            from kvrepro.deploy.ray.localcluster import _all_pids, _cmdline

            os.kill(int(running[0].labels[L.LABEL_OWNER_PID]), signal.SIGSTOP)  # the task's worker
            session = running[0].labels[L.LABEL_SESSION]
            reapers = [p for p in _all_pids() if "kvrepro.deploy.docker.reaper" in _cmdline(p) and session in _cmdline(p)]
            assert reapers
            for pid in reapers:
                os.kill(pid, signal.SIGKILL)
    except BaseException:
        proc.kill()
        raise

    def no_container() -> None:
        assert not containers(), [c.name for c in containers()]

    _terminated(proc, log, then=no_container)
    assert not _engines_below(raylets)
    ours = [g for g in _placement_groups(cluster.address) if g["name"].startswith(f"kvrepro-{proc.pid}-")]
    assert len(ours) == 2 and all(g["state"] == "REMOVED" for g in ours), ours


def test_killing_a_nodes_raylet_mid_matrix_loses_no_run(tmp_path, cluster):
    """SIGKILL of a worker node's raylet while an engine runs there: that run is INFRA, sent
    again to another node; every run ends finished, and nothing the killed node ran is left.
    (Build E twice: both runs serve their whole budget, so the kill always lands mid-run.) Last in
    this file: the module's cluster has one node fewer afterwards."""
    matrix = _matrix(tmp_path, "ray", cluster.address, requests=300, reps=2, builds=("E",))
    killed: dict[str, object] = {}

    def kill_when_busy() -> None:
        from kvrepro.deploy.ray.localcluster import descendants

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            for ip in cluster.addresses[1:]:  # a worker node, never the head (the driver is on it)
                raylet = cluster.raylet_pid(ip)
                if raylet and _engines_below({raylet}):
                    time.sleep(2)  # the engine is under load by now
                    killed.update(ip=ip, below=descendants({raylet}) - {raylet})
                    os.kill(raylet, signal.SIGKILL)
                    return
            time.sleep(0.5)

    killer = threading.Thread(target=kill_when_busy, daemon=True)
    killer.start()
    proc = _kvrepro("matrix", "run", "-m", str(matrix), "--results", str(tmp_path / "r"), "--json", "--ci",
                    cwd=tmp_path)
    killer.join(timeout=5)
    assert "below" in killed, "no worker node ran an engine"
    victim = killed["ip"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout)  # Ray's "node died" messages went to stderr: stdout is --json's alone
    results = [r for info in run["builds"].values() for r in info["runs"]]
    assert len(results) == 2 and all(r["verdict"] == "UNREACHED" for r in results), results
    retried = [r for r in results if r["retried_after"]]
    assert len(retried) == 1, results
    assert f"node {victim} " in retried[0]["retried_after"][0] and retried[0]["by_target"]["ray"]["node"]["address"] != victim, retried
    for r in results:
        assert (Path(r["run_dir"]) / "engine.log").is_file() and (Path(r["run_dir"]) / "verdict.json").is_file()
    time.sleep(3)
    left = [p for p in killed["below"] if Path(f"/proc/{p}").exists()]  # type: ignore[union-attr]
    assert not left, f"processes of the killed node still alive: {left}"
