"""What runs on a node: one Ray task per run (the driver side is target.py).

The task reports that it started (and on which node) to the driver's progress actor, makes the
build's overlay from its content-addressed bundle (once per node, bundle.py), runs the runner's
own run function (sent by reference: ``kvrepro.matrix.runner.run_one``) with a node-local `sim`
target into a node-local scratch folder, and returns every file of the run with the result.
The engine is a child of this worker (its own session, a parent-death signal: kvrepro.lifetime),
so a worker that is cancelled, killed or loses its raylet takes its engine with it.

With ``ray.engine: docker`` the node-local target is the `docker` target on the node's own
daemon instead: the build's image is found or made there (:func:`node_image`) and the engine is
a container, removed by the run's end, or by the docker target's reaper if the worker dies.
"""

from __future__ import annotations

import copy
import fcntl
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ... import scratch
from ...errors import KvreproError
from ...records import BuildArtifact, NodeInfo, RunResult
from ..base import RunFunction, SilentProgress
from .bundle import BundleRef, node_cache, unpack, unpacked


@dataclass(frozen=True)
class PatchBytes:
    """One patch file of a build, sent with its run (a few kB): with ``ray.engine: docker`` a node
    makes the build's image from these and the base image, as the docker target does on a host."""

    sha256: str
    data: bytes


@dataclass(frozen=True)
class Placement:
    """A multi-node run's placement group (``ray.nodes_per_engine`` > 1), as its task gets it.

    The task runs in bundle 0; the other bundles are held on their nodes for the engine's other
    workers. The engine gets the group in its environment (:meth:`engine_env`): a launcher of a
    real multi-node vLLM engine looks the group up by name (``ray.util.get_placement_group``) and
    hands it to vLLM's Ray executor with these bundle indices. The GPU-free engine is one process
    and does not use them: for it the other bundles are only held (docs/ray.md).
    """

    group_id: str                # Ray's placement group id (hex)
    name: str                    # its name in the "kvrepro" namespace
    bundles: tuple[int, ...]     # the bundle indices of the engine, 0 first
    nodes: tuple[NodeInfo, ...]  # the node of each bundle, same order

    def engine_env(self) -> dict[str, str]:
        return {"KVREPRO_RAY_PLACEMENT_GROUP": self.group_id,
                "KVREPRO_RAY_PLACEMENT_GROUP_NAME": self.name,
                "KVREPRO_RAY_PLACEMENT_BUNDLES": ",".join(str(b) for b in self.bundles),
                "KVREPRO_RAY_PLACEMENT_NODES": ",".join(n.address for n in self.nodes)}


@dataclass(frozen=True)
class NodeRun:
    """One run as sent to a node. ``bundle_data`` holds the bundle's object-store reference inside
    a list, so Ray does not fetch the bytes unless the node lacks the build."""

    key: str
    loaded: Any  # the LoadedMatrix (spec/ is an earlier stage, but a record here stays import-light)
    artifact: BuildArtifact
    rep: int
    bundle: BundleRef | None
    bundle_data: list = field(default_factory=list)
    sink: Any = None  # the driver's progress actor, or None
    replay: Any = None
    placement: Placement | None = None  # a multi-node engine's placement group, else None
    engine: str = "sim"  # ray.engine: sim (the bundle's overlay) or docker (the build's image, node_image)
    patches: tuple[PatchBytes, ...] = ()  # engine docker: the build's patch files, in the plan's order


@dataclass(frozen=True)
class RunFiles:
    """What comes back from a node: the run's files (path relative to the run folder, bytes), the
    node, the result (the run folder inside it is the node's; the driver puts its own)."""

    node: NodeInfo
    result: RunResult
    files: tuple[tuple[str, bytes], ...]


def this_node() -> NodeInfo:
    import ray

    return NodeInfo(node_id=ray.get_runtime_context().get_node_id(), address=ray.util.get_node_ip_address())


class _NodeProgress(SilentProgress):
    """run_one's progress on a node, forwarded to the driver's actor (requests at most once a second)."""

    def __init__(self, sink: Any, key: str):
        self.sink, self.key, self._last = sink, key, 0.0

    def requests_done(self, build: str, rep: int, done: int, failed: int) -> None:
        now = time.monotonic()
        if self.sink is not None and now - self._last >= 1.0:
            self._last = now
            self.sink.requests.remote(self.key, done, failed)


# one `sim` target per worker process: its engine zygote (torch & co. imported once) serves every
# run this worker executes; each run gets a shallow copy holding that run's matrix
_LOCAL: dict[str, Any] = {}
_LOCAL_LOCK = threading.Lock()


def _local_target(loaded: Any, engine: str = "sim") -> Any:
    """This worker's `sim` (or `docker`: the node's own daemon, no hosts:) target, copied for one run."""
    from .. import get_target

    with _LOCAL_LOCK:
        if engine not in _LOCAL:
            _LOCAL[engine] = get_target(engine)(loaded)
        sibling = copy.copy(_LOCAL[engine])
    sibling.loaded = loaded
    sibling.name = "ray"  # the manifest says which target ran it
    return sibling


def local_artifact(job: NodeRun, node: NodeInfo) -> BuildArtifact:
    """The build on this node: its overlay made from the bundle, once (a failed build stays as it is)."""
    if not job.artifact.ok or job.bundle is None:
        return job.artifact
    path = unpacked(job.bundle, node.node_id)
    if path is None:
        import ray

        path = unpack(job.bundle, ray.get(job.bundle_data[0]), node.node_id)
    return replace(job.artifact, ref=str(path), source_root=str(path))


def node_image(job: NodeRun, node: NodeInfo, target: Any) -> BuildArtifact:
    """``ray.engine: docker``: the build's image in this node's own Docker daemon (DOCKER_HOST on
    the node, else its socket), by the docker target's own ``prepare`` (deploy/docker/assemble.py).

    Its tag is content-addressed (base image id + patches + probe): present, it is used as it is;
    absent, it is made here once, ``FROM`` the base image in this daemon plus the patched files.
    That is what the docker code does on every host, so the node needs only the base image and
    the build's patch files (sent with the run, a few kB), never a multi-GB image tarball through
    the object store. Two runs needing the same tag at once take a file lock per daemon and tag
    (``<kvrepro home>/docker/locks``): the second finds the image made by the first. Nodes on one
    machine share that machine's daemon and so the lock.
    """
    if not job.artifact.ok:
        return job.artifact
    from ..docker.assemble import assembly_key, docker_dir, find_base, image_tag, safe_tag_part
    from ..docker.hosts import local_host_spec

    folder = node_cache(node.node_id) / "patches"
    folder.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for patch in job.patches:
        path = folder / f"{patch.sha256}.patch"  # named by its content: any run's copy is the same
        if not path.is_file():
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            tmp.write_bytes(patch.data)
            os.replace(tmp, path)
        paths.append(path)
    plan = replace(job.artifact.plan, patches=tuple(replace(ref, path=path)
                                                    for ref, path in zip(job.artifact.plan.patches, paths)))
    try:
        host = target.host(local_host_spec())
        settings = target.settings
        base = find_base(host, settings.image_for(plan.base), settings.docker.pull)
    except KvreproError as exc:
        return replace(job.artifact, ref=None, error=f"node {node.label}: {exc}")
    tag = image_tag(plan.base, assembly_key(base, plan))
    locks = docker_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{safe_tag_part(str(host.info.get('ID') or host.name))}-{safe_tag_part(tag)}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return target.prepare(plan)


def run_task(job: NodeRun, run: RunFunction) -> RunFiles:
    """The Ray task: one run on this node, its files returned."""
    node = this_node()
    if job.sink is not None:
        job.sink.started.remote(job.key, node)
    if job.engine == "docker":
        target = _local_target(job.loaded, "docker")
        artifact = node_image(job, node, target)
    else:
        artifact = local_artifact(job, node)
        target = _local_target(job.loaded)
    if job.placement is not None:
        target.engine_env = job.placement.engine_env()  # this run's copy only
    run_dir = Path(tempfile.mkdtemp(prefix="ray-run-", dir=scratch.folder()))
    try:
        result = run(job.loaded, target, artifact, run_dir, job.rep, _NodeProgress(job.sink, job.key),
                     threading.Event(), job.replay)
        files = tuple((p.relative_to(run_dir).as_posix(), p.read_bytes())
                      for p in sorted(run_dir.rglob("*")) if p.is_file())
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return RunFiles(node=node, result=result, files=files)
