"""The `ray` target, driver side: connect, ship builds once, run every run as a Ray task, retry
runs whose node was lost, cancel everything on Ctrl-C, show runs per node. A multi-node engine
(``ray.nodes_per_engine`` > 1) first holds a placement group, one bundle per node, for the
whole run; the group is removed whichever way the run ends. Before the driver exits, every node
where a run's task ended without returning (cancelled, its worker killed, an error) is asked to
remove what that run started and its task could not (the engine target's ``remove_left_behind``).

Imported only through :func:`kvrepro.deploy.ray.load` (it imports Ray).
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import ray
import ray.exceptions as rex
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ...errors import BadInputError, InfraError
from ...builds.records import BuildArtifact
from ..records import RunManifest
from ...records import Outcome, RunResult, Verdict, from_jsonable, to_jsonable
from ...spec.records import BuildPlan
from ...secrets import redact
from .. import get_target, node_engine, register
from ..base import EngineHandle, RunFunction, ShippedFile, Target
from .bundle import BundleRef, pack
from .records import NodeInfo, RayPlacement
from .node import NodeRun, Placement, RunFiles, cancel_with_grace, run_task, sweep_task
from .settings import RaySpec, cluster_address, ray_settings

# a task failed because its node or worker went away (not because of the run): INFRA, sent again
NODE_LOST = (rex.NodeDiedError, rex.WorkerCrashedError, rex.LocalRayletDiedError, rex.ObjectLostError,
             rex.OwnerDiedError, rex.ObjectFetchTimedOutError, rex.RaySystemError, rex.ActorDiedError)
# how long the driver, before it exits, waits for its nodes to remove what killed workers left
SWEEP_TIMEOUT_S = 60.0


def reachable(address: str, timeout: float) -> str | None:
    """None if ``address`` (host:port, ray://host:port) accepts a TCP connection within ``timeout``,
    else why not: a cluster that is not there is named at once instead of after Ray's own retries."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


# a gRPC client's first bytes (HTTP/2 connection preface, then an empty SETTINGS frame)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def not_grpc(address: str, timeout: float) -> str | None:
    """None if ``address`` answers as a gRPC server does (a Ray GCS or Ray Client server: HTTP/2,
    its first frame a SETTINGS frame), else what it did instead. Ray's own client retries such
    an address for half a minute, printing a gcs_client warning every second or so; this answers
    in at most ``timeout``. (Skipped with RAY_USE_TLS: a TLS server answers nothing in clear.)"""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.sendall(_H2_PREFACE)
            head = b""
            deadline = time.monotonic() + timeout
            while len(head) < 9 and time.monotonic() < deadline:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                chunk = sock.recv(9 - len(head))
                if not chunk:
                    break
                head += chunk
    except socket.timeout:
        return f"it accepts connections but sent nothing within {timeout:.0f}s"
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    if len(head) == 9 and head[3] == 0x04:  # frame type 4: SETTINGS
        return None
    if not head:
        return f"it accepts connections but sent nothing within {timeout:.0f}s"
    return f"it answers, but not as gRPC (first bytes {head[:9]!r})"


def _ray_messages_to_stderr() -> None:
    """Ray's driver prints the cluster's error messages ("(raylet) A worker died ...", a node lost)
    on stdout (ray._private.worker.listen_error_messages); kvrepro's stdout is `--json`'s. They go
    to stderr instead. (Ray's internal function: if it is not there, nothing is changed.)"""
    from ray._private import worker

    original = getattr(worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_kvrepro", False):
        return

    def to_stderr(data, ignore_prefix: bool):
        return original(dict(data, is_err=True), ignore_prefix)

    to_stderr._kvrepro = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_stderr


class _Sink:
    """The driver's progress actor: nodes say when a run started (and where) and how far it got."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.stopped = False

    def stop(self) -> None:
        """The driver is stopping: every run asks (is_stopped) and stops through its own stop event."""
        self.stopped = True

    def is_stopped(self) -> bool:
        return self.stopped

    def started(self, key: str, node: NodeInfo) -> None:
        self.events.append(("started", key, node))

    def requests(self, key: str, done: int, failed: int) -> None:
        self.events.append(("requests", key, done, failed))

    def drain(self) -> list[tuple]:
        out, self.events = self.events, []
        return out


class _Board:
    """Runs queued (sent, not started on a node yet), running and finished per node."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queued: set[str] = set()
        self.where: dict[str, NodeInfo] = {}
        self.finished: Counter[str] = Counter()

    def line(self) -> str:
        with self.lock:
            running = Counter(n.address for n in self.where.values())
            nodes = sorted(set(running) | set(self.finished))
            parts = [f"{a}: {running[a]} running, {self.finished[a]} finished" for a in nodes]
            return f"ray: {len(self.queued)} queued" + ("; " + "; ".join(parts) if parts else "")


class _Unplaceable(Exception):
    """A run's placement group can no longer be placed (nodes were lost since the start): INFRA."""


@register("ray")
class RayTarget(Target):
    """Runs each run as a Ray task that reserves ``ray.cpus_per_run`` (and ``ray.gpus_per_run``) on
    each of its ``ray.nodes_per_engine`` nodes."""

    runs_remotely = True
    # added to every engine's environment on its node (as SimTarget.engine_env): a campaign's per-run
    # copy sets explore's branch probes here, so a run on Ray reports what it reached as on sim
    engine_env: dict[str, str] = {}

    def __init__(self, loaded):
        super().__init__(loaded)
        self.spec: RaySpec = ray_settings(loaded.matrix)
        self.address = cluster_address(self.spec)
        if self.address is None:
            raise BadInputError("target ray: no cluster address; set ray.address in matrix.yaml or RAY_ADDRESS "
                                "(host:port of the head's GCS, ray://host:10001, or auto)")
        self._engine = node_engine(self.spec.engine)  # the target that runs each engine on its node
        self._engine.check_for_nodes(loaded)  # its settings the nodes cannot honour: one line, before connecting
        self._connect()
        self._fitting = self._check_fits()
        self._local = get_target("sim")(loaded)  # builds overlays on the driver; never starts an engine
        self._bundles: dict[str, tuple[BundleRef, Any]] = {}
        self._files: dict[str, tuple[ShippedFile, ...]] = {}  # build -> its small files for the engine, per run
        self._inflight: dict[str, Any] = {}
        self._groups: dict[str, PlacementGroup] = {}  # run key -> the placement group it holds
        # names this driver on what its runs start (docker: a container label), for the sweep at close
        self._driver = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._unswept: set[str] = set()  # nodes where a run's task ended without returning ("": unknown)
        self._lock = threading.Lock()
        self._interrupted = threading.Event()
        self.board = _Board()
        self._keys: dict[str, tuple[str, int]] = {}
        self._progress: dict[str, Any] = {}
        self._sink = ray.remote(num_cpus=0)(_Sink).remote()
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True, name="kvrepro-ray-progress")
        self._poller.start()

    # ------------------------------------------------------------------ the cluster
    def _connect(self) -> None:
        address = self.address or "auto"
        if address != "auto":
            why = reachable(address, self.spec.connect_timeout_s)
            if why is not None:
                raise InfraError(f"INFRA: ray cluster unreachable at {address} ({why} within "
                                 f"{self.spec.connect_timeout_s:.0f}s); start it (`ray start --head`) or fix "
                                 "ray.address / RAY_ADDRESS")
            why = not_grpc(address, self.spec.connect_timeout_s)
            if why is not None:
                raise InfraError(f"INFRA: {address} is not a Ray cluster ({why}); is it the head's GCS port "
                                 "(`ray start --head --port`) or ray://host:10001? fix ray.address / RAY_ADDRESS")
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = dict(address=address, namespace="kvrepro", log_to_driver=False,
                                      logging_level="ERROR")
        host = address.removeprefix("ray://").rpartition(":")[0]
        try:
            if not address.startswith("ray://") and ipaddress.ip_address(host).is_loopback:
                kwargs["_node_ip_address"] = host  # a cluster on this machine's loopback: the driver is on it
        except ValueError:
            pass
        if self.spec.ship_code:
            import kvrepro

            kwargs["runtime_env"] = {"py_modules": [str(Path(kvrepro.__file__).parent)]}
        _ray_messages_to_stderr()
        # ray.init puts its own SIGTERM handler (sys.exit) in place of kvrepro's (stop in order, 130)
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            ray.init(**kwargs)
        except Exception as exc:  # noqa: BLE001 - Ray raises many kinds here (RpcError, AuthenticationError, ...)
            raise InfraError(f"INFRA: ray cluster at {address}: {redact(str(exc)).splitlines()[0][:300]}") from None
        finally:
            if threading.current_thread() is threading.main_thread():
                for sig, handler in handlers.items():
                    if handler is not None:
                        signal.signal(sig, handler)

    def nodes(self) -> list[NodeInfo]:
        """The cluster's alive nodes."""
        return [NodeInfo(node_id=n["NodeID"], address=n["NodeManagerAddress"]) for n in ray.nodes() if n["Alive"]]

    def _per_run(self) -> dict[str, float]:
        """What a run reserves on each of its nodes (one bundle of its placement group)."""
        return {"CPU": self.spec.cpus_per_run, **({"GPU": self.spec.gpus_per_run} if self.spec.gpus_per_run else {})}

    def _fitting_nodes(self) -> tuple[dict[str, float], int]:
        """(the alive nodes that can hold a run's share: node id -> how many shares, how many nodes are alive)."""
        need = self._per_run()
        alive = [n for n in ray.nodes() if n["Alive"]]
        fitting = {n["NodeID"]: min(n["Resources"].get(k, 0.0) / v for k, v in need.items())
                   for n in alive if all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())}
        return fitting, len(alive)

    def _check_fits(self) -> dict[str, float]:
        """The alive nodes that can hold a run's share (node id -> how many shares), checked up front:
        a run the cluster can never place would otherwise wait in Ray's queue forever, silently.
        (An autoscaling cluster that would add such nodes later is not waited for.)"""
        fitting, alive = self._fitting_nodes()
        what = " and ".join(f"{v:g} {k}" for k, v in self._per_run().items())
        wanted = self.spec.nodes_per_engine
        if not fitting:
            raise BadInputError(f"ray.cpus_per_run/gpus_per_run: none of the {alive} alive nodes of the cluster "
                                f"at {self.address} has {what}; a run could never start")
        if len(fitting) < wanted:
            raise BadInputError(f"ray.nodes_per_engine {wanted}: the cluster at {self.address} has {len(fitting)} "
                                f"alive node(s) with {what} (of {alive}); an engine could never be placed")
        return fitting

    def max_parallel(self) -> int:
        """Twice what the cluster can run at once (Ray queues the rest): the queue stays visible."""
        if self.spec.nodes_per_engine == 1:
            cpus = ray.cluster_resources().get("CPU", 1.0)
            return max(1, min(256, 2 * int(cpus // self.spec.cpus_per_run)))
        shares = sum(int(n) for n in self._fitting.values())  # (roughly: one engine spans distinct nodes)
        return max(1, min(256, 2 * (shares // self.spec.nodes_per_engine)))

    def free_slots(self) -> int:
        """How many runs the cluster could start now: its free CPUs (and GPUs) over a run's share."""
        if self.spec.nodes_per_engine > 1:
            return max(1, self.max_parallel() // 2)
        free = ray.available_resources()
        return max(1, int(min(free.get(k, 0.0) / v for k, v in self._per_run().items())))

    # ------------------------------------------------------------------ builds
    def prepare(self, plan: BuildPlan) -> BuildArtifact:
        """Build on the driver (as `sim` does: the patches are checked to apply once, here), then
        ask the engine target what its nodes need of the build (its ``prepare_for_nodes``): a
        folder (`sim`: the overlay) goes into the object store once as a bundle; small files
        (`docker`: the patches, from which a node makes the image) are kept and sent with every run."""
        self._local.on_line = self.on_line
        artifact = self._local.prepare(plan)
        if not artifact.ok:
            return artifact
        build = self._engine.prepare_for_nodes(plan, artifact)
        if build.files:
            self._files[plan.name] = build.files
        if build.folder is not None and str(artifact.ref) not in self._bundles:
            ref, data = pack(build.folder, plan.base)
            self._bundles[str(artifact.ref)] = (ref, ray.put(data))
            self.on_line(f"build {plan.name}: bundle {ref.sha256[:12]} ({ref.size / 1e6:.1f} MB) in the object store")
        return artifact

    def start(self, artifact: BuildArtifact, run_dir: Path, rep: int) -> EngineHandle:
        raise InfraError("target ray runs whole runs on its nodes (run_remotely); it starts no local engine")

    # ------------------------------------------------------------------ runs
    def run_remotely(self, run: RunFunction, loaded: Any, artifact: BuildArtifact, run_dir: Path, rep: int,
                     progress: Any, stop: threading.Event, replay: Any = None) -> RunResult:
        key = f"{artifact.plan.name}/{rep}/{time.monotonic_ns()}"
        bundle = self._bundles.get(str(artifact.ref))
        lost: list[str] = []
        avoid: set[str] = set()
        started = time.monotonic()
        with self._lock:
            self._keys[key] = (artifact.plan.name, rep)
            self._progress[key] = progress
        try:
            for attempt in range(self.spec.max_retries + 1):
                if stop.is_set() or self._interrupted.is_set():
                    return self._result(artifact, rep, run_dir, Verdict.INTERRUPTED, "interrupted before it started",
                                        started, lost)
                with self.board.lock:
                    self.board.queued.add(key)
                self._publish()
                try:  # whatever happens in this attempt, its placement group (if any) is removed after it
                    placement: Placement | None = None
                    if self.spec.nodes_per_engine > 1:
                        try:
                            placement = self._reserve(key, stop, lambda: progress.stage(
                                f"build {artifact.plan.name} rep {rep}: queued for a placement group of "
                                f"{self.spec.nodes_per_engine} nodes ({self.board.line()})"))
                        except _Unplaceable as exc:
                            return self._result(artifact, rep, run_dir, Verdict.INFRA, str(exc), started, lost)
                        if placement is None:
                            return self._result(artifact, rep, run_dir, Verdict.INTERRUPTED,
                                                "interrupted while waiting for its placement group", started, lost)
                    job = NodeRun(key=key, loaded=loaded, artifact=artifact, rep=rep,
                                  bundle=bundle[0] if bundle else None, bundle_data=[bundle[1]] if bundle else [],
                                  sink=self._sink, replay=replay, placement=placement, engine=self.spec.engine,
                                  files=self._files.get(artifact.plan.name, ()),
                                  engine_env=tuple(sorted(self.engine_env.items())), driver=self._driver)
                    ref = self._submit(job, run, avoid)
                    try:
                        try:
                            files: RunFiles = self._wait(ref)
                        except BaseException:
                            self._unclean(key, placement)  # its teardown may not have run to its end
                            raise
                    except rex.TaskCancelledError:
                        return self._result(artifact, rep, run_dir, Verdict.INTERRUPTED,
                                            "interrupted: its Ray task was cancelled", started, lost)
                    except NODE_LOST as exc:
                        with self.board.lock:
                            node = self.board.where.get(key)
                        where = f"node {node.label}" if node else "its node"
                        lost.append(f"attempt {attempt + 1}: {where} lost: {type(exc).__name__}: "
                                    f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}")
                        if node is not None:
                            avoid.add(node.node_id)
                        self._forget(key, finished=False)
                        progress.stage(f"build {artifact.plan.name} rep {rep}: INFRA ({lost[-1]}); "
                                       + ("sent again" if attempt < self.spec.max_retries else "no retries left"))
                        continue
                    except rex.RayTaskError as exc:
                        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                        if isinstance(cause, KeyboardInterrupt):
                            return self._result(artifact, rep, run_dir, Verdict.INTERRUPTED,
                                                "interrupted: its Ray task was cancelled", started, lost)
                        return self._result(artifact, rep, run_dir, Verdict.INFRA,
                                            f"ray task failed: {type(cause).__name__}: {cause}", started, lost)
                    finally:
                        with self._lock:
                            self._inflight.pop(key, None)
                    stored = self._store(files, run_dir, lost, placement)
                    self._forget(key)
                    progress.stage(self.board.line())  # per node, also in --ci's plain lines
                    return stored
                finally:
                    self._release(key)
            return self._result(artifact, rep, run_dir, Verdict.INFRA,
                                f"node lost {len(lost)} times (ray.max_retries {self.spec.max_retries})", started, lost)
        finally:
            self._release(key)
            self._forget(key)
            with self._lock:
                self._keys.pop(key, None)
                self._progress.pop(key, None)

    def _reserve(self, key: str, stop: threading.Event, waiting: Callable[[], None]) -> Placement | None:
        """A placement group for one multi-node engine: ``nodes_per_engine`` bundles of the run's
        share, one per node (STRICT_SPREAD), held until :meth:`_release`. Waits (the run shows as
        queued, and ``waiting`` is called once if it is not placed at once: --ci's plain lines show
        no progress line) until Ray placed it; None if the run was interrupted meanwhile. The group belongs to
        this driver's job: if kvrepro itself is killed, Ray removes it with the job."""
        count = self.spec.nodes_per_engine
        name = f"kvrepro-{os.getpid()}-{key.replace('/', '-')}"
        group = placement_group([self._per_run() for _ in range(count)], strategy="STRICT_SPREAD", name=name)
        with self._lock:
            self._groups[key] = group
        ready = group.ready()
        said = False
        next_check = time.monotonic() + 5
        while True:
            if stop.is_set() or self._interrupted.is_set():
                return None
            done, _ = ray.wait([ready], timeout=0.5)
            if done:
                try:
                    ray.get(done[0])
                except rex.TaskPlacementGroupRemoved:
                    if stop.is_set() or self._interrupted.is_set():  # a stop came during the wait and
                        return None  # removed the group (interrupt's force thread): interrupted, no traceback
                    raise _Unplaceable(f"INFRA: placement group {name} was removed before it was placed")
                break
            if not said:
                said = True
                waiting()
            if time.monotonic() >= next_check:  # nodes lost since the start: never placeable now?
                next_check = time.monotonic() + 5
                fitting, alive = self._fitting_nodes()
                if len(fitting) < count:
                    raise _Unplaceable(f"INFRA: a placement group of {count} nodes can no longer be placed: "
                                       f"{len(fitting)} alive node(s) can hold a run's share (of {alive})")
        bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
        known = {n.node_id: n for n in self.nodes()}
        nodes = tuple(known.get(bundle_nodes[i], NodeInfo(node_id=bundle_nodes[i], address="?")) for i in range(count))
        return Placement(group_id=group.id.hex(), name=name, bundles=tuple(range(count)), nodes=nodes)

    def _unclean(self, key: str, placement: Placement | None) -> None:
        """The run's task ended without returning: its node is swept at close (:meth:`_sweep`)."""
        with self.board.lock:
            node = self.board.where.get(key)
        node_id = node.node_id if node else placement.nodes[0].node_id if placement else ""
        with self._lock:
            self._unswept.add(node_id)  # "": the task's node is not known yet (every alive node is swept)

    def _release(self, key: str) -> None:
        """Remove the run's placement group (if it holds one); safe to call again."""
        with self._lock:
            group = self._groups.pop(key, None)
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - a cluster gone: its groups went with it
                pass

    def _submit(self, job: NodeRun, run: RunFunction, avoid: set[str]) -> Any:
        options: dict[str, Any] = dict(num_cpus=self.spec.cpus_per_run, num_gpus=self.spec.gpus_per_run,
                                       max_retries=0, retry_exceptions=False)
        with self._lock:
            group = self._groups.get(job.key)
        if group is not None:  # a multi-node engine: in bundle 0 of its group (a lost node: a new group)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=0, placement_group_capture_child_tasks=False)
        elif avoid:  # a retry: to another alive node when there is one (soft: any node if that one is busy)
            others = [n for n in self.nodes() if n.node_id not in avoid]
            if others:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(others[0].node_id, soft=True)
        ref = ray.remote(run_task).options(**options).remote(job, run)
        with self._lock:
            self._inflight[job.key] = ref
        if self._interrupted.is_set():
            ray.cancel(ref, force=False)
        return ref

    def _wait(self, ref: Any) -> RunFiles:
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                return ray.get(ref)

    def _store(self, files: RunFiles, run_dir: Path, lost: list[str], placement: Placement | None) -> RunResult:
        """The run's files into its folder (manifest.json with the node), the result with the driver's folder."""
        run_dir.mkdir(parents=True, exist_ok=True)
        placed = RayPlacement(node=files.node, placement_nodes=placement.nodes if placement else ())
        for rel, data in files.files:
            dest = (run_dir / rel).resolve()
            if not dest.is_relative_to(run_dir.resolve()) or rel == "verdict.json":
                continue  # verdict.json is the runner's, written last
            if rel == "manifest.json":
                manifest = placed.onto(from_jsonable(RunManifest, json.loads(data)))
                data = (json.dumps(to_jsonable(manifest), indent=2) + "\n").encode()
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dest)
        return placed.onto(replace(files.result, run_dir=str(run_dir), retried_after=tuple(lost)))

    def _result(self, artifact: BuildArtifact, rep: int, run_dir: Path, verdict: Verdict, title: str,
                started: float, lost: list[str]) -> RunResult:
        return RunResult(build=artifact.plan.name, rep=rep, verdict=verdict,
                         outcome=Outcome.INFRA if verdict is Verdict.INFRA else Outcome.NONE, title=title[:500],
                         trigger_count=0, external_hit_calls=0, requests=0,
                         seconds=round(time.monotonic() - started, 3),
                         infra_error=redact("\n".join([title, *lost])) if verdict is Verdict.INFRA else None,
                         run_dir=str(run_dir), base=artifact.plan.base, retried_after=tuple(lost))

    # ------------------------------------------------------------------ progress
    def _forget(self, key: str, finished: bool = True) -> None:
        with self.board.lock:
            self.board.queued.discard(key)
            node = self.board.where.pop(key, None)
            if node is not None and finished and key in self._keys:
                self.board.finished[node.address] += 1
        self._publish()

    def _publish(self) -> None:
        self.on_line(self.board.line())

    def _poll(self) -> None:
        while not self._closed.wait(1.0):
            try:
                events = ray.get(self._sink.drain.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - progress is best effort; runs are judged by their results
                continue
            for event in events:
                key = event[1]
                with self._lock:
                    progress = self._progress.get(key)
                    build_rep = self._keys.get(key)
                if progress is None or build_rep is None:
                    continue
                if event[0] == "started":
                    with self.board.lock:
                        self.board.queued.discard(key)
                        self.board.where[key] = event[2]
                    progress.run_started(build_rep[0], build_rep[1], self.loaded.matrix.runs.requests)
                    self._publish()
                else:
                    progress.requests_done(build_rep[0], build_rep[1], event[2], event[3])

    # ------------------------------------------------------------------ stopping
    def interrupt(self) -> None:
        """Ctrl-C / SIGTERM: cancel every run's task (queued ones never start); a running task gets
        a KeyboardInterrupt and stops its engine; after ray.cancel_grace_s its worker is killed."""
        self._interrupted.set()
        try:  # the runs hear it from the sink too: a cancel's KeyboardInterrupt can be lost on the node
            self._sink.stop.remote()  # (raised inside a callback mid-import), the run then went on to its end
        except Exception:  # noqa: BLE001 - the cluster is gone: the cancels below say the rest
            pass
        with self._lock:
            refs = list(self._inflight.values())
        for ref in refs:  # at once, in the caller's thread; the wait and the kill in the background
            ray.cancel(ref, force=False)

        def still_running() -> list:
            with self._lock:
                return list(self._inflight.values())

        def force() -> None:
            cancel_with_grace([], still_running, self.spec.cancel_grace_s)
            with self._lock:
                keys = list(self._groups)
            for key in keys:  # what the killed tasks held
                self._release(key)

        threading.Thread(target=force, daemon=True, name="kvrepro-ray-cancel").start()

    def _sweep(self) -> None:
        """Called once every run's task has ended: on each node where one ended without returning,
        a task of the engine target's ``remove_left_behind`` removes what this driver's runs left
        there (a worker killed after ``ray.cancel_grace_s`` in the middle of its engine's teardown;
        Ray kills the worker's children with it, the docker session's reaper among them). Waited
        for, at most SWEEP_TIMEOUT_S: kvrepro exits with nothing of its runs left running."""
        with self._lock:
            wanted, self._unswept = self._unswept, set()
        if not wanted or getattr(self._engine, "remove_left_behind", None) is None:
            return
        try:
            alive = {n.node_id: n for n in self.nodes()}
            ids = set(alive) if "" in wanted else wanted & set(alive)
            refs = {ray.remote(sweep_task).options(
                num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self.spec.engine, self._driver): alive[node_id] for node_id in ids}
            ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=SWEEP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a cluster gone: its nodes' leftovers carry owner labels
            self.on_line(f"ray: could not ask the nodes to remove what stopped runs left "
                         f"({type(exc).__name__}); `kvrepro clean` on each node removes it")
            return
        for ref in ready:
            try:
                node, removed = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - one node's failure: said, the others still count
                self.on_line(f"ray: node {refs[ref].label}: removing what stopped runs left failed "
                             f"({type(exc).__name__}); `kvrepro clean` on that node removes it")
                continue
            for name in removed:
                self.on_line(f"removed {name} on node {node.label}: its run's worker was stopped before it could")
        for ref in pending:
            self.on_line(f"ray: node {refs[ref].label} did not remove what stopped runs left within "
                         f"{SWEEP_TIMEOUT_S:.0f}s; `kvrepro clean` on that node removes it")
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            keys = list(self._groups)
        for key in keys:  # normally none left: every run removes its own
            self._release(key)
        self._sweep()
        self._local.close()
        try:
            ray.kill(self._sink)
        except Exception:  # noqa: BLE001
            pass
