"""`kvrepro builds test --target ray`: each build's pytest job of vLLM's own tests as a Ray task.

The driver (:class:`RayPytest`, a :class:`kvrepro.builds.upstream_tests.PytestRunner`) connects as
the `ray` target does (``ray:`` / $RAY_ADDRESS, the same checks), puts each build's overlay in the
object store once as its sha256 bundle (bundle.py, as ``matrix run --target ray`` ships builds) and
the release's test tree (the sdist's ``tests/`` with the patches' copied tests and the pytest
plugin) once as a bundle of its own, and submits one task per job reserving ``ray.cpus_per_run``.
The task (:func:`pytest_task`) makes both on its node once (node cache, keyed by sha256), finds the
node's own runtime of the release plus the test layer, and runs the very pytest command and plugin
a local job runs; it returns the typed outcomes and its node. The driver caches them under the
same key as a local job: a cached build is not sent again, and a local and a Ray run share results.

The release's baseline stays on the driver: it runs under coverage.py, whose data the impact rule
reads there to choose each build's tests, and it is cached after the first run anyway.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import ray
import ray.exceptions as rex

from ...builds import prepare_runtime, upstream_tests
from ...builds.runtime import Runtime
from ...builds.sdist import source_tests
from ...errors import InfraError
from ...builds.records import UpstreamTestOutcome
from .bundle import COMPLETE, BundleRef, node_cache, pack, unpack, unpacked
from .node import cancel_with_grace, this_node
from .records import NodeInfo


@dataclass(frozen=True)
class TreeBundle:
    """The release's test tree as its task gets it: a tar of every file, named by its sha256."""

    sha256: str
    tree_key: str
    size: int


@dataclass(frozen=True)
class PytestTask:
    """One build's pytest job as sent to a node (the bundles' bytes travel as object-store
    references inside lists, fetched only by a node that lacks them)."""

    base: str
    tree: upstream_tests.TestTree  # its root is the driver's; the node puts its own
    job: upstream_tests.TreeRun    # its vllm_root likewise
    key: str                       # the job's cache key (the node's work folder is named by it)
    tests: TreeBundle
    tests_data: list = field(default_factory=list)
    overlay: BundleRef | None = None
    overlay_data: list = field(default_factory=list)
    # what the driver's vLLM learnt about the release's model classes (file name -> bytes, a few kB):
    # a node's first job then inspects none of them again (~8 CPU s each)
    modelinfos: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True)
class PytestResult:
    """What comes back: the outcome of every test and the node that ran them."""

    node: NodeInfo
    outcomes: tuple[UpstreamTestOutcome, ...]
    seconds: float


def pack_tree(root: Path, tree_key: str) -> tuple[TreeBundle, bytes]:
    """Every file of the test tree (hard links stored as files), in a deterministic tar."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.name == ".complete":
                continue
            data = path.read_bytes()
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    return TreeBundle(sha256=hashlib.sha256(data).hexdigest(), tree_key=tree_key, size=len(data)), data


def unpack_tree(ref: TreeBundle, fetch: Callable[[], bytes], node_id: str) -> Path:
    """The test tree on this node, made once (concurrent tasks wait for the first)."""
    root = node_cache(node_id) / "test-trees"
    root.mkdir(parents=True, exist_ok=True)
    dest = root / ref.sha256[:32]
    if (dest / COMPLETE).is_file():
        return dest
    with open(root / f"{ref.sha256[:32]}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / COMPLETE).is_file():
            return dest
        data = fetch()
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise InfraError(f"ray: the test tree {ref.sha256[:12]} arrived damaged (sha256 differs)")
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{ref.sha256[:12]}-"))
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            tar.extractall(tmp, filter="data")  # refuses paths outside tmp
        (tmp / COMPLETE).write_text(ref.sha256 + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
    return dest


_RUNTIMES: dict[str, Runtime] = {}


def pytest_task(task: PytestTask) -> PytestResult:
    """The Ray task: the build's overlay and the test tree on this node, the job's pytest run there."""
    started = time.monotonic()
    node = this_node()
    tests = unpack_tree(task.tests, lambda: ray.get(task.tests_data[0]), node.node_id)
    vllm_root = task.job.vllm_root
    if task.overlay is not None:
        vllm_root = unpacked(task.overlay, node.node_id) or unpack(task.overlay, ray.get(task.overlay_data[0]),
                                                                   node.node_id)
    if task.base not in _RUNTIMES:  # the node's own env of the release and its test layer (made once)
        _RUNTIMES[task.base] = upstream_tests.test_runtime(prepare_runtime(task.base), source_tests(task.base))
    work = node_cache(node.node_id) / "upstream-work" / task.key
    shutil.rmtree(work, ignore_errors=True)
    if task.modelinfos:
        shipped = work / "shipped-modelinfos"
        shipped.mkdir(parents=True)
        for name, data in task.modelinfos:
            (shipped / Path(name).name).write_bytes(data)
        upstream_tests.publish_modelinfos(shipped, upstream_tests.shared_modelinfos(vllm_root))
    found = upstream_tests.run_pytest(_RUNTIMES[task.base], replace(task.tree, root=tests),
                                      replace(task.job, vllm_root=vllm_root), work)
    return PytestResult(node=node, outcomes=tuple(found.values()), seconds=round(time.monotonic() - started, 1))


class RayPytest(upstream_tests.PytestRunner):
    """The driver side: connects as the `ray` target does and sends every build job to the cluster."""

    def __init__(self, loaded: Any, base: str, on_line: Callable[[str], None] | None = None):
        from .target import RayTarget

        self.base = base
        self.target = RayTarget(loaded)  # connect, check a job fits, Ctrl-C/SIGTERM handlers kept
        self.spec = self.target.spec
        self.on_line = on_line or (lambda line: None)
        self.workers = self.target.max_parallel() // 2 or 1  # what the cluster runs at once
        self._lock = threading.Lock()
        self._overlays: dict[str, tuple[BundleRef, Any]] = {}
        self._trees: dict[str, tuple[TreeBundle, Any]] = {}
        self._inflight: set[Any] = set()
        self._stopping = threading.Event()
        self.nodes_used: list[NodeInfo] = []

    def _tree(self, tree: upstream_tests.TestTree) -> tuple[TreeBundle, Any]:
        with self._lock:
            if tree.key not in self._trees:
                ref, data = pack_tree(tree.root, tree.key)
                self._trees[tree.key] = (ref, ray.put(data))
                self.on_line(f"ray: test tree {ref.sha256[:12]} ({ref.size / 1e6:.1f} MB) in the object store")
            return self._trees[tree.key]

    def _overlay(self, job: upstream_tests.TreeRun, base: str) -> tuple[BundleRef, Any]:
        with self._lock:
            path = str(job.vllm_root)
            if path not in self._overlays:
                ref, data = pack(job.vllm_root, base)
                self._overlays[path] = (ref, ray.put(data))
                self.on_line(f"ray: {job.label}: bundle {ref.sha256[:12]} ({ref.size / 1e6:.1f} MB) in the object store")
            return self._overlays[path]

    def run(self, runtime: Runtime, tree: upstream_tests.TestTree, job: upstream_tests.TreeRun,
            work: Path) -> dict[str, UpstreamTestOutcome]:
        if self._stopping.is_set():
            raise KeyboardInterrupt
        base = self.base
        tests, tests_ref = self._tree(tree)
        overlay, overlay_ref = self._overlay(job, base)
        infos = upstream_tests.shared_modelinfos(job.vllm_root)
        shipped = tuple((p.name, p.read_bytes()) for p in sorted(infos.glob("*.json"))) if infos is not None else ()
        task = PytestTask(base=base, tree=tree, job=job, key=upstream_tests.job_key(runtime, tree, job) + f"-{work.name}",
                          tests=tests, tests_data=[tests_ref], overlay=overlay, overlay_data=[overlay_ref],
                          modelinfos=shipped)
        ref = ray.remote(pytest_task).options(num_cpus=self.spec.cpus_per_run, max_retries=0,
                                              retry_exceptions=False).remote(task)
        with self._lock:
            self._inflight.add(ref)
        try:
            while True:
                ready, _ = ray.wait([ref], timeout=0.5)
                if ready:
                    result: PytestResult = ray.get(ref)
                    break
        except rex.TaskCancelledError:
            raise KeyboardInterrupt from None
        except rex.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            raise InfraError(f"INFRA: ray: pytest of {job.label} failed on its node: {type(cause).__name__}: "
                             f"{str(cause).strip().splitlines()[-1][:300] if str(cause).strip() else ''}") from None
        except rex.RayError as exc:
            raise InfraError(f"INFRA: ray: pytest of {job.label}: {type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}") from None
        finally:
            with self._lock:
                self._inflight.discard(ref)
        with self._lock:
            self.nodes_used.append(result.node)
        self.on_line(f"{job.label}: {len(result.outcomes)} tests ran on Ray node {result.node.node_id} "
                     f"({result.node.address}) in {result.seconds:.0f} s")
        return {o.nodeid: o for o in result.outcomes}

    def stop(self) -> None:
        """Cancel every job's task: a running one gets a KeyboardInterrupt, which stops its pytest
        (upstream_tests._run_pytest); after ``ray.cancel_grace_s`` its worker is killed."""
        self._stopping.set()
        with self._lock:
            refs = list(self._inflight)

        def still_running() -> list:
            with self._lock:
                return list(self._inflight)

        cancel_with_grace(refs, still_running, self.spec.cancel_grace_s)

    def close(self) -> None:
        self.target.close()
