"""The `docker` target: builds become images, runs become containers on Docker hosts.

prepare(plan): assemble (or reuse) the build's image on every host the engine runs on, in
parallel. start(artifact, run_dir, rep): create the engine's containers (one per node), stream
their logs into the run folder, and return once the head's /health answers. Everything goes
through named errors (errors.py), so a run that cannot start is INFRA with a reason, and every
path out of start/stop leaves no container behind.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker.errors
import requests
from docker.types import DeviceRequest, Mount

from ...errors import InfraError, KvreproError, SpecError
from ...builds.records import BuildArtifact, BuildManifest
from ...spec.records import BuildPlan
from ...secrets import redact, remember
from ...spec.matrix import LoadedMatrix
from .settings import DockerSettings, HostSpec, docker_settings
from .. import register
from ..base import EngineHandle, Target
from . import labels as L, shm
from .assemble import assemble, safe_tag_part
from .clean import reap_orphans
from .reaper import Reaper
from .records import HostImage, ImageManifest, ImageRef
from .containers import ContainerEngine
from .errors import (ContainerError, DaemonDownError, DockerInfraError, ImageMissingError, PortInUseError,
                     SshError, UnknownHostError)
from .hosts import DockerHost, connect, engine_hosts, port_free_locally, published_ports, remove_quietly
from .ssh import free_local_port
from .launch import NodeLaunch, plan_launch

MODEL_MOUNT = "/kvrepro/model"
FS_TIER_ROOT = "/kvrepro/run"  # where a container's fs offload tiers are (kvrepro/spec/fs_tier.py)
VLLM_CACHE_MOUNT = "/kvrepro/vllm-cache"  # VLLM_CACHE_ROOT in the container, on the per-release volume
# A local model folder is copied into containers on remote hosts; beyond this it is surely
# weights, which belong on the host (or in the HF cache), not in a per-run upload.
MAX_MODEL_UPLOAD = 256 * 2**20
_API_ERRORS = (docker.errors.DockerException, requests.RequestException)


class DockerEngineHandle(EngineHandle):
    """One engine (one or more containers). ``stop`` removes them all; safe to call twice."""

    def __init__(self, engine: ContainerEngine, on_stop=None):
        self._engine = engine
        self._on_stop = on_stop
        self.base_url = engine.base_url
        self.log_path = engine.engine_log.path
        self.forwards: list[tuple[DockerHost, int]] = []  # (host, local port) forwarded over its ssh connection

    @property
    def containers(self) -> list[str]:
        return [n.container.name for n in self._engine.nodes]

    def alive(self) -> bool:
        return self._engine.alive()

    def exit_code(self) -> int | None:
        return self._engine.exit_code()

    def use_api(self, url: str, note: str | None = None) -> None:
        """Where the load generator and the health gate reach the engine's API."""
        self._engine.base_url = self.base_url = url
        if note:
            self._engine.note(note)

    def stop(self) -> None:
        self._engine.stop()
        forwards, self.forwards = self.forwards, []
        for host, local_port in forwards:
            host.drop_forward(local_port)
        if self._on_stop is not None:
            self._on_stop(self)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# what sets the KV pool's size on a GPU: given in extra_args, the GPU path adds no cap of its own
_POOL_FLAGS = ("--num-gpu-blocks-override", "--kv-cache-memory-bytes", "--kv-cache-memory", "--gpu-memory-utilization")


def _has_weights(model_dir: Path | None) -> bool:
    """A model folder with weight files (None: a Hugging Face id, which has them)."""
    if model_dir is None:
        return True
    return any(f.name.endswith(_WEIGHT_SUFFIXES) for f in model_dir.iterdir() if f.is_file())


def gpu_path_args(args: list[str], engine, docker, weights: bool) -> list[str]:
    """The `vllm serve` arguments of a real vLLM on GPUs (``docker.gpu_free: no``), so that it runs
    the engine the GPU-free one reproduces, under the same load (docs/docker.md says why each):

    * the KV pool capped at ``engine.sim.num_gpu_blocks`` (``--num-gpu-blocks-override``, read by
      vLLM's own KV-cache sizing as on the sim): a GPU of 139 GiB evicts nothing otherwise, and the
      family's bugs need prefix reuse under eviction (``docker.gpu_kv_blocks: all`` drops it; a pool
      flag of the matrix's own in ``engine.extra_args`` wins);
    * one attention backend for the target model (``--attention-backend``) AND the MTP drafter
      (``attention_backend`` in ``--speculative-config``): vLLM's drafter never inherits the
      target's backend (v1/spec_decode/llm_base_proposer.py 0.26.0:1292-1302) but picks its own
      unless the speculative config names one; the default is FlashAttention, whose block-size
      alignment of the hybrid model the GPU-free platform reproduces;
    * ``--load-format dummy`` for a model folder without weights (kvrepro's shipped configs):
      random weights, the same KV geometry (the drafts are then mostly rejected);
    * nothing for asynchronous scheduling: ``engine.async_scheduling: auto`` leaves vLLM's own
      decision, on with MTP, which the GPU-free engine now follows too.

    Built as data: the speculative config is read and written back as JSON, never edited as text."""
    import json

    out = list(args)
    own = {a.split("=", 1)[0] for a in engine.extra_args}
    if docker.gpu_kv_blocks == "matrix" and not own & set(_POOL_FLAGS):
        out += ["--num-gpu-blocks-override", str(engine.sim.num_gpu_blocks)]
    backend = docker.gpu_attention_backend
    if backend is not None and "--attention-backend" not in own:
        out += ["--attention-backend", backend]
        if "--speculative-config" in out:
            i = out.index("--speculative-config") + 1
            spec = json.loads(out[i])
            spec.setdefault("attention_backend", backend)
            out[i] = json.dumps(spec)
    if not weights and "--load-format" not in own:
        out += ["--load-format", "dummy"]
    return out


class DockerTarget(Target):
    """Runs builds as images on the Docker hosts of matrix.yaml (or the local daemon)."""

    # added to every engine container's environment: the `ray` target's node side names the run's
    # placement group here (its per-run copy of this target sets it)
    engine_env: dict[str, str] = {}
    # the kvrepro that sent the run, labelled on every engine container (L.LABEL_DRIVER): the `ray`
    # target's node side sets it on its per-run copy, so that driver can remove what a killed worker left
    driver: str = ""

    def __init__(self, loaded: LoadedMatrix):
        super().__init__(loaded)
        self._hosts: dict[str, DockerHost] = {}
        self._handles: list[DockerEngineHandle] = []
        self._lock = threading.Lock()
        self._interrupted = threading.Event()
        self._reaper: Reaper | None = None
        names = [h.name for h in docker_settings(loaded.matrix).hosts]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise SpecError(f"{loaded.path}: hosts: name(s) {', '.join(dupes)} used twice; host names must be unique")

    @property
    def settings(self) -> DockerSettings:
        """This target's typed settings (hosts:, docker:, base_image:) of the matrix it runs."""
        return docker_settings(self.loaded.matrix)

    # ---------------------------------------------------------------- hosts

    def host(self, spec: HostSpec) -> DockerHost:
        with self._lock:
            if spec.name in self._hosts:
                return self._hosts[spec.name]
        host = connect(spec)
        with self._lock:
            kept = self._hosts.setdefault(spec.name, host)
        if kept is not host:
            host.close()  # another thread connected first: one connection (one ssh master) per host
            return kept
        # kvrepro#8: engines of a kvrepro that was killed (SIGKILL) go when the next one connects
        for name in reap_orphans(host):
            self.on_line(f"removed {name}: its kvrepro process is gone")
        return kept

    def max_parallel(self) -> int:
        """Engines at once: one per cluster/GPU set (an engine owns its hosts' GPUs and ports);
        on GPU-free hosts a few, like the sim target (one engine keeps about a core busy)."""
        spec = self.settings.docker
        try:
            nodes = self.node_specs()
            if len(nodes) > 1 or spec.api_port or any(n.gpus for n in nodes):
                return 1
            cpus = self.host(nodes[0]).info.get("NCPU") or 1
        except KvreproError:
            return 1  # the run itself will report why the host is unusable
        return max(1, min(4, int(cpus)))

    def interrupt(self) -> None:
        """Make engines that are still starting give up at once (Ctrl-C): start() then raises
        InfraError instead of waiting out the health timeout."""
        self._interrupted.set()

    def node_specs(self) -> list[HostSpec]:
        return engine_hosts(self.loaded.matrix)

    def engine_args(self) -> list[str]:
        engine = self.loaded.matrix.engine
        try:
            model_arg, model_dir = self._model()
        except SpecError:
            model_arg, model_dir = engine.model, None
        return self._serve_args(model_arg, model_dir, self.gpu_free(self.node_specs()))

    def fs_tier_root(self, run_dir: Path) -> str:
        # the run's folder is not mounted in the engine's containers: each fs offload tier gets a
        # folder in the container's own filesystem, empty in every new container (one per start)
        # and removed with it
        return FS_TIER_ROOT

    def _serve_args(self, model_arg: str, model_dir: Path | None, gpu_free: bool,
                    fs_tier_root: str | None = None) -> list[str]:
        engine = self.loaded.matrix.engine
        args = engine.serve_args(model_arg, include_sim=gpu_free, fs_tier_root=fs_tier_root)
        if gpu_free:
            return args
        return gpu_path_args(args, engine, self.settings.docker, weights=_has_weights(model_dir))

    def gpu_free(self, nodes: list[HostSpec]) -> bool:
        mode = self.settings.docker.gpu_free
        return mode == "yes" or (mode == "auto" and all(n.gpus == 0 for n in nodes))

    # ---------------------------------------------------------------- prepare

    def prepare(self, plan: BuildPlan) -> BuildArtifact:
        try:
            specs = list({s.name: s for s in self.node_specs()}.values())
            hosts = [self.host(s) for s in specs]
            with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
                futures = [pool.submit(assemble, h, self.settings.image_for(plan.base), plan, pull=self.settings.docker.pull, on_line=self.on_line)
                           for h in hosts]
                built = [f.result() for f in futures]
        except KvreproError as exc:
            return BuildArtifact(plan=plan, ref=None, error=str(exc),
                                 manifest=BuildManifest(error_kind=getattr(exc, "kind", "spec")))
        first = built[0]
        if len({a.tag for a in built}) > 1:
            # Same base image id everywhere gives the same tag; different ids mean the hosts
            # hold different images under one name, and the runs would not be comparable.
            tags = ", ".join(f"{h.name}: {a.tag}" for h, a in zip(hosts, built))
            return BuildArtifact(plan=plan, ref=None, manifest=BuildManifest(error_kind="image_build"),
                                 error=f"build {plan.name}: hosts hold different {self.settings.image_for(plan.base)} images ({tags}); "
                                       "pull the same base on every host")
        where = f"image {first.tag}'s manifest label"
        label = BuildManifest.from_json(first.manifest, where)
        manifest = dataclasses.replace(
            ImageManifest.of(label, where),
            image=ImageRef(tag=first.tag, id=first.image_id, labels=dict(first.labels)),
            hosts={h.name: HostImage(image_id=a.image_id, reused=a.reused, seconds=round(a.seconds, 3))
                   for h, a in zip(hosts, built)}).onto(label)
        return BuildArtifact(plan=plan, ref=first.tag, manifest=manifest, reused=all(a.reused for a in built),
                             source_root=str(first.source_root) if first.source_root else None)

    # ---------------------------------------------------------------- start

    def _model(self) -> tuple[str, Path | None]:
        """(the model argument inside the container, the host folder to provide there, if any)."""
        name = self.loaded.matrix.engine.model
        try:
            folder = self.loaded.model_dir()
        except SpecError:
            if "/" in name and not name.startswith((".", "/", "~")) and not Path(name).exists():
                return name, None  # a Hugging Face id: vLLM fetches it into the HF cache volume
            raise
        return f"{MODEL_MOUNT}/{folder.name}", folder

    def _env(self, rep: int, gpu_free: bool) -> tuple[dict[str, str], list[str]]:
        """The container environment and the secret values in it (to redact from logs)."""
        spec = self.settings.docker
        env = {"PYTHONUNBUFFERED": "1", **spec.env}
        secrets: list[str] = []
        for name in spec.pass_env:
            value = os.environ.get(name)
            if value:
                env[name] = value
                secrets.append(value)
        remember(secrets)  # masked in every file kvrepro writes, whatever the variable's name or length
        if gpu_free:
            env.update(self.loaded.matrix.engine.sim.engine_env(rep))
            env.update(shm.engine_env(spec.ipc_host))  # its /dev/shm region goes with it (shm.py)
        env.update(self.engine_env)
        return env, secrets

    def vllm_cache_volume(self, plan: BuildPlan) -> str | None:
        """The volume holding vLLM's cache for engines of this base release (None: switched off).

        vLLM keeps ``$VLLM_CACHE_ROOT/modelinfos/<model class>.json``, keyed by the hash of the
        model's module file; a fresh container has none and inspects the causal LM and the MTP
        draft again, each in a subprocess importing torch and vLLM. One volume per release (as
        the sim target's folder per release, ``kvrepro.deploy.sim.vllm_cache_root``) keeps the
        entries of one release from evicting another's; vLLM writes them atomically, so engines
        running side by side can share it.
        """
        name = self.settings.docker.vllm_cache
        return f"{name}-{safe_tag_part(plan.base)}" if name else None

    def _mounts(self, host: DockerHost, model_dir: Path | None, model_arg: str,
                plan: BuildPlan) -> tuple[list[Mount], bool]:
        """Mounts for a node, and whether the model folder must be uploaded instead of mounted."""
        spec = self.settings.docker
        mounts: list[Mount] = []
        if (volume := self.vllm_cache_volume(plan)) is not None:
            # created on the node's own daemon on first use, labelled so that `docker clean --images` finds it
            mounts.append(Mount(VLLM_CACHE_MOUNT, volume, type="volume",
                                labels={L.LABEL_VOLUME: "vllm-cache"}))
        if spec.hf_cache:
            source = spec.hf_cache
            if source.startswith("~"):
                if not host.local:
                    raise SpecError(f"docker.hf_cache {source!r}: '~' means this machine's home, not host "
                                    f"{host.name}'s; give an absolute path on that host or a volume name")
                source = os.path.expanduser(source)
            kind = "bind" if source.startswith("/") else "volume"
            mounts.append(Mount(spec.hf_cache_target, source, type=kind))
        upload = False
        if model_dir is not None:
            if host.local:
                mounts.append(Mount(model_arg, str(model_dir), type="bind", read_only=True))
            else:
                upload = True
        return mounts, upload

    def _check_ports(self, head: DockerHost, api_port: int | None, extra: list[int]) -> None:
        for port in [p for p in [api_port, *extra] if p]:
            if port in published_ports(head) or (head.local and not port_free_locally(port)):
                raise PortInUseError(
                    f"host {head.name}: port {port} is already in use (docker.api_port / docker.rendezvous_port); "
                    "stop what holds it or pick another port, or leave docker.api_port unset to use a free one"
                )

    def start(self, artifact: BuildArtifact, run_dir: Path, rep: int) -> EngineHandle:
        if not artifact.ok:
            raise InfraError(artifact.error or "build failed")
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            return self._start(artifact, run_dir, rep)
        except KvreproError:
            raise
        except _API_ERRORS as exc:
            raise self._lost_ssh("starting the engine") or _translate(exc, "starting the engine") from None

    def _start(self, artifact: BuildArtifact, run_dir: Path, rep: int) -> EngineHandle:
        matrix = self.loaded.matrix
        spec = self.settings.docker
        node_specs = self.node_specs()
        hosts = [self.host(s) for s in node_specs]
        head = hosts[0]
        for host in {h.name: h for h in hosts}.values():
            try:
                host.client.images.get(artifact.ref)
            except docker.errors.ImageNotFound:
                raise ImageMissingError(
                    f"host {host.name}: image {artifact.ref} of build {artifact.plan.name} is not there "
                    "(removed since it was built?); run the matrix again to rebuild it"
                ) from None
        model_arg, model_dir = self._model()
        gpu_free = self.gpu_free(node_specs)
        serve_args = self._serve_args(model_arg, model_dir, gpu_free, fs_tier_root=self.fs_tier_root(run_dir))
        env, secrets = self._env(rep, gpu_free)
        if self.vllm_cache_volume(artifact.plan) is not None:
            env.setdefault("VLLM_CACHE_ROOT", VLLM_CACHE_MOUNT)  # docker.env may point it elsewhere
        multi = len(hosts) > 1
        bind_ip = head.api_bind_ip()  # loopback (reached over ssh) or an explicit address, never 0.0.0.0
        api_port = spec.api_port
        if multi and api_port is None:
            api_port = free_local_port() if head.local else 8000
        self._check_ports(head, api_port, [spec.rendezvous_port] if multi else [])
        launches = plan_launch(serve_args, node_specs, spec, head_address=head.address, api_port=api_port,
                               bind_ip=bind_ip, env=env)

        self._watch_for_death(node_specs)
        engine = ContainerEngine(run_dir, "http://127.0.0.1:0", spec.stop_timeout_s,
                                 spec.log_stall_s, secrets, multi)
        handle = DockerEngineHandle(engine, on_stop=self._forget)
        with self._lock:
            self._handles.append(handle)
        try:
            if api_port:
                self._reach_api(handle, head, api_port)
            for launch, host in zip(launches, hosts):
                container = self._create(launch, host, artifact, run_dir, rep, model_dir, model_arg)
                engine.attach(launch, host, container)
                engine.note(f"created {container.name} on {host.name}: vllm serve {redact(' '.join(launch.argv))}")
            for node in engine.nodes:
                self._start_container(node.container, node.host, node.launch)
                node.pump.start()
            engine.start_watchdog()
            if not api_port:
                port = self._published_port(engine.nodes[0].container, launches[0])
                if port:  # None: the container already exited; wait_healthy says so with its log
                    self._reach_api(handle, head, port)
            timeout = spec.health_timeout_s or matrix.runs.start_timeout_s
            engine.wait_healthy(timeout, f"build {artifact.plan.name} rep {rep}", cancel=self._interrupted)
        except BaseException:
            handle.stop()
            raise
        return handle

    def _create(self, launch: NodeLaunch, host: DockerHost, artifact: BuildArtifact, run_dir: Path, rep: int,
                model_dir: Path | None, model_arg: str):
        spec = self.settings.docker
        mounts, upload = self._mounts(host, model_dir, model_arg, artifact.plan)
        kwargs: dict[str, Any] = dict(
            image=artifact.ref,
            entrypoint=["vllm", "serve"],
            command=list(launch.argv),
            environment=launch.env,
            labels=L.managed("engine", **{L.LABEL_RUN: str(run_dir), L.LABEL_BUILD: artifact.plan.name,
                                          L.LABEL_REP: str(rep), L.LABEL_NODE: str(launch.rank),
                                          **({L.LABEL_DRIVER: self.driver} if self.driver else {})}),
            name=f"kvrepro-{artifact.plan.name}-r{rep}-n{launch.rank}-{L.SESSION}",
            mounts=mounts,
            init=True,  # PID 1 that forwards SIGTERM, so teardown stops vLLM cleanly
            detach=True,
        )
        if spec.ipc_host:
            kwargs["ipc_mode"] = "host"
        elif spec.shm_size:
            kwargs["shm_size"] = spec.shm_size
        if launch.gpus:
            kwargs["device_requests"] = [DeviceRequest(count=launch.gpus, capabilities=[["gpu"]])]
        if launch.network == "host":
            kwargs["network_mode"] = "host"
        else:
            kwargs["ports"] = {f"{launch.container_port}/tcp": (launch.bind_ip, launch.host_port)}
        try:
            container = host.client.containers.create(**kwargs)
        except docker.errors.ImageNotFound:
            raise ImageMissingError(f"host {host.name}: image {artifact.ref} is not there") from None
        except docker.errors.APIError as exc:
            raise ContainerError(f"host {host.name}: creating the engine container failed: {_explain(exc)}") from None
        try:
            if upload and model_dir is not None:
                size = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
                if size > MAX_MODEL_UPLOAD:
                    raise SpecError(
                        f"engine.model {model_dir} is {size / 2**20:.0f} MiB; for remote host {host.name} use a "
                        "Hugging Face id (fetched into docker.hf_cache) or a small config-only folder"
                    )
                container.put_archive("/", _tar_dir(model_dir, model_arg))
        except BaseException:
            remove_quietly(container)  # not attached to the engine yet: nobody else would
            raise
        return container

    def _start_container(self, container, host: DockerHost, launch: NodeLaunch) -> None:
        try:
            container.start()
        except docker.errors.APIError as exc:
            text = _explain(exc)
            if "port is already allocated" in text or "address already in use" in text:
                raise PortInUseError(f"host {host.name}: the engine's port is in use: {text}; "
                                     "free it or change docker.api_port") from None
            raise ContainerError(f"host {host.name}: starting {container.name} failed: {text}") from None

    @staticmethod
    def _published_port(container, launch: NodeLaunch) -> int | None:
        container.reload()
        ports = container.attrs.get("NetworkSettings", {}).get("Ports") or {}
        bindings = ports.get(f"{launch.container_port}/tcp") or []
        return int(bindings[0]["HostPort"]) if bindings else None

    @staticmethod
    def _reach_api(handle: DockerEngineHandle, head: DockerHost, port: int) -> None:
        """Point the handle at the API published on ``port`` of the head host (through a port
        forward over the host's ssh connection when it is another machine)."""
        url, forwarded = head.api_url(port)
        if forwarded is not None:
            handle.forwards.append((head, forwarded))
        handle.use_api(url, f"engine API {head.name}:{port} forwarded to {url} over ssh" if forwarded else None)

    def _lost_ssh(self, what: str) -> SshError | None:
        """An API call failed because a host's kept ssh connection ended: say so with ssh's reason."""
        with self._lock:
            hosts = list(self._hosts.values())
        for host in hosts:
            if host.tunnel is not None and not host.tunnel.alive():
                return SshError(f"{what}: the ssh connection to host {host.name} ended "
                                f"({host.tunnel.reason() or 'ssh gave no reason'}); check the host and the network")
        return None

    def _watch_for_death(self, node_specs: list[HostSpec]) -> None:
        """kvrepro#8: a watcher removes this session's containers if kvrepro is killed (SIGKILL)."""
        with self._lock:
            if self._reaper is None:
                self._reaper = Reaper(L.SESSION, [s.model_dump() for s in node_specs])

    def _forget(self, handle: DockerEngineHandle) -> None:
        with self._lock:
            if handle in self._handles:
                self._handles.remove(handle)

    # ---------------------------------------------------------------- close

    def close(self) -> None:
        """Stop every engine still running and remove any container this session created.

        Runs to the end even through Ctrl-C (which it re-raises afterwards): this is the last
        chance to not leave engines holding GPUs on someone's cluster.
        """
        self._interrupted.set()
        interrupted: BaseException | None = None
        for handle in list(self._handles):
            try:
                handle.stop()
            except KeyboardInterrupt as exc:
                interrupted = exc
        for host in list(self._hosts.values()):
            for _ in range(3):
                try:
                    self._sweep(host)
                    break
                except KeyboardInterrupt as exc:
                    interrupted = exc
            host.close()
        self._hosts.clear()
        if self._reaper is not None:
            self._reaper.done()
            self._reaper = None
        if interrupted is not None:
            raise interrupted

    @staticmethod
    def _sweep(host: DockerHost) -> None:
        try:
            leftovers = host.client.containers.list(all=True, filters={"label": f"{L.LABEL_SESSION}={L.SESSION}"}, ignore_removed=True)
        except _API_ERRORS:
            return
        for container in leftovers:
            remove_quietly(container)


def _explain(exc: docker.errors.APIError) -> str:
    return str(getattr(exc, "explanation", None) or exc)


def _translate(exc: BaseException, what: str) -> DockerInfraError:
    text = str(getattr(exc, "explanation", None) or exc)
    if isinstance(exc, (requests.ConnectionError, docker.errors.DockerException)) and (
            "Connection" in text or "connect" in text):
        return DaemonDownError(f"{what}: the Docker daemon stopped answering ({text[:300]})")
    return ContainerError(f"{what}: {text[:500]}")


def _tar_dir(folder: Path, target: str) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(folder, arcname=target.lstrip("/"))
    return buf.getvalue()


DockerTarget = register("docker")(DockerTarget)

__all__ = ["DockerEngineHandle", "DockerTarget", "UnknownHostError"]
