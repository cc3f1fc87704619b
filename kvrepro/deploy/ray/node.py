"""What runs on a node: one Ray task per run (the driver side is target.py).

The task reports that it started (and on which node) to the driver's progress actor, makes the
build's overlay from its content-addressed bundle (once per node, bundle.py), runs the runner's
own run function (sent by reference: ``kvrepro.matrix.runner.run_one``) with a node-local `sim`
target into a node-local scratch folder, and returns every file of the run with the result.
The engine is a child of this worker (its own session, a parent-death signal: kvrepro.lifetime),
so a worker that is cancelled, killed or loses its raylet takes its engine with it.

``ray.engine`` names the node-local target (any target with node-engine hooks,
kvrepro.deploy.node_engine): it says what the driver ships of a build (a folder, carried here as
a bundle; small files, sent with the run) and how the node runs the build from them (e.g. an
image made in the node's own daemon). This module only carries them.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ... import scratch
from ...builds.records import BuildArtifact
from ...records import RunResult
from .records import NodeInfo
from ..base import NodeBuild, RunFunction, ShippedFile, SilentProgress
from .bundle import BundleRef, node_cache, unpack, unpacked


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
    engine: str = "sim"  # ray.engine: the target that runs the engine on the node (its node-engine hooks)
    files: tuple[ShippedFile, ...] = ()  # the build's small files for that engine (NodeBuild.files)
    engine_env: tuple[tuple[str, str], ...] = ()  # the driver target's extra engine environment (explore's probes)
    driver: str = ""  # names the driver: an engine target that labels what it starts (docker) labels it so


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


# one engine target per worker process (`sim`: its engine zygote (torch & co. imported once) serves every
# run this worker executes); each run gets a shallow copy holding that run's matrix
_LOCAL: dict[str, Any] = {}
_LOCAL_LOCK = threading.Lock()


def _local_target(loaded: Any, engine: str = "sim") -> Any:
    """This worker's target ``engine`` (``ray.engine``), copied for one run."""
    from .. import get_target

    with _LOCAL_LOCK:
        if engine not in _LOCAL:
            _LOCAL[engine] = get_target(engine)(loaded)
        sibling = copy.copy(_LOCAL[engine])
    sibling.loaded = loaded
    sibling.name = "ray"  # the manifest says which target ran it
    return sibling


def local_folder(job: NodeRun, node: NodeInfo) -> Path | None:
    """The build's folder on this node, unpacked from its bundle once; None if it ships none."""
    if job.bundle is None:
        return None
    path = unpacked(job.bundle, node.node_id)
    if path is None:
        import ray

        path = unpack(job.bundle, ray.get(job.bundle_data[0]), node.node_id)
    return path


def local_artifact(job: NodeRun, node: NodeInfo, target: Any) -> BuildArtifact:
    """The build as this node runs it (a failed build stays as it is): what the driver shipped,
    made into the engine's artifact by the engine target's own hook (kvrepro.deploy.node_engine)."""
    if not job.artifact.ok:
        return job.artifact
    from .. import node_engine

    build = NodeBuild(folder=local_folder(job, node), files=job.files)
    return node_engine(job.engine).node_artifact(target, job.artifact, build, node_cache(node.node_id), node.label)


def _heed_driver(sink: Any, stop: threading.Event, done: threading.Event) -> None:
    """Set the run's stop when the driver stops (its sink says so), as a matrix run's stop does
    locally: the run ends INTERRUPTED with what it recorded. Ray's cancel raises a KeyboardInterrupt
    in the task too, but one raised inside a callback (mid-import) is lost and the run went on to
    its end (measured: an explore campaign's two runs finished 14 s after its Ctrl-C)."""
    import ray

    while not done.wait(0.5):
        try:
            if ray.get(sink.is_stopped.remote(), timeout=5):
                stop.set()
                return
        except Exception:  # noqa: BLE001 - the driver is gone: Ray ends this task with it
            return


def run_task(job: NodeRun, run: RunFunction) -> RunFiles:
    """The Ray task: one run on this node, its files returned."""
    node = this_node()
    if job.sink is not None:
        job.sink.started.remote(job.key, node)
    target = _local_target(job.loaded, job.engine)
    artifact = local_artifact(job, node, target)
    extra = dict(job.engine_env)
    if job.placement is not None:
        extra.update(job.placement.engine_env())
    if extra:
        target.engine_env = {**getattr(target, "engine_env", {}), **extra}  # this run's copy only
    if job.driver:
        target.driver = job.driver  # this run's copy only: what it starts carries the driver's name
    run_dir = Path(tempfile.mkdtemp(prefix="ray-run-", dir=scratch.folder()))
    stop, done = threading.Event(), threading.Event()
    if job.sink is not None:
        threading.Thread(target=_heed_driver, args=(job.sink, stop, done), daemon=True,
                         name="kvrepro-ray-stop").start()
    try:
        result = run(job.loaded, target, artifact, run_dir, job.rep, _NodeProgress(job.sink, job.key),
                     stop, job.replay)
        files = tuple((p.relative_to(run_dir).as_posix(), p.read_bytes())
                      for p in sorted(run_dir.rglob("*")) if p.is_file())
    finally:
        done.set()
        shutil.rmtree(run_dir, ignore_errors=True)
    return RunFiles(node=node, result=result, files=files)


def sweep_task(engine: str, driver: str) -> tuple[NodeInfo, list[str]]:
    """A Ray task on one node, after the driver's runs there ended: the engine target's
    ``remove_left_behind`` hook (kvrepro.deploy.base.NodeEngine) removes what runs of ``driver``
    left on this node (a worker killed before its teardown ended); (the node, what it removed)."""
    from .. import node_engine

    hook = getattr(node_engine(engine), "remove_left_behind", None)
    return this_node(), (list(hook(driver)) if hook is not None else [])


def cancel_with_grace(refs: list, still_running: Callable[[], list], grace_s: float) -> None:
    """Cancel Ray tasks the gentle way (a running task gets a KeyboardInterrupt and stops its engine or
    pytest), then kill the workers of those ``still_running()`` returns after ``grace_s``."""
    import ray

    for ref in refs:
        ray.cancel(ref, force=False)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not still_running():
            return
        time.sleep(0.2)
    for ref in still_running():
        try:
            ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001 - a task that ended meanwhile
            pass

