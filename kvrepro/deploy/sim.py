"""The `sim` target: vLLM's own `vllm serve`, GPU-free, as a local process on 127.0.0.1.

Each build is an overlay (patched ``vllm/``, vLLM's dist-info, the probe and kvrepro's platform
plugin) run by the shared runtime env's python. The engine is vLLM's API server and EngineCore
process with kvrepro's platform plugin, which swaps in the fake executor (see kvrepro.engine).
The server is kept up after EngineCore dies (``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``), so the
run can still read ``/metrics`` and see ``/health`` answer 503, as production monitoring would.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
import time
from pathlib import Path


from .. import builds, lifetime, paths, scratch, versions
from ..errors import InfraError, KvreproError, describe_os_error
from ..builds.records import BuildArtifact, BuildManifest
from ..spec.records import BuildPlan
from ..secrets import redact, scrubbed_environ
from . import register
from .base import EngineHandle, NodeBuild, Target

# what this target says about itself (kvrepro.deploy asks; no other stage names it):
# one instance serves many runs of different matrices, each through a shallow copy holding its
# matrix (its engine zygotes stay warm: kvrepro.deploy.shares_one_instance)
SHARED = True
# a build may be any vLLM commit's source (`bisect --kind commits`: kvrepro.deploy.builds_commits)
BUILDS_COMMITS = True
# its engine is always the GPU-free one (kvrepro.deploy.engine_always_gpu_free)
GPU_FREE = True


def upstream_tests(loaded, base: str, on_line) -> None:
    """vLLM's own tests run here, in this machine's runtime env (kvrepro.deploy.upstream_tests)."""
    return None


def vllm_cache_root(plan: BuildPlan) -> Path:
    """vLLM's cache folder for engines of this base release (a commit build uses its base's: vLLM
    checks each entry's hash, so a commit whose model file differs is inspected again, correctly).

    vLLM keeps one model-info file per model class in ``$VLLM_CACHE_ROOT/modelinfos``, keyed by the
    hash of the model's module; on a mismatch it inspects the class again in a subprocess that
    imports torch and vLLM (~10 s of CPU each for the causal LM and the MTP draft, measured here).
    One folder shared by every release made each release switch (a suite, a release table, a
    bisection over releases) pay that on every engine start; one folder per base pays it once.
    """
    return paths.vllm_cache(plan.base)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# the engine side (kvrepro/engine/zygote.py, ENV_VAR) reads this variable; tests/test_engine.py checks they agree
ZYGOTE_ENV = "KVREPRO_ENGINE_ZYGOTE"


def zygote_lesson(runtime: builds.Runtime) -> Path:
    """Where a runtime's zygotes keep the modules their engines imported (kvrepro/engine/zygote.py:
    ``--learned``), so that the next zygote preloads them before its first engine, not after."""
    return paths.home() / "zygote" / f"{runtime.key}.preload"


def _answers(socket_path: Path) -> bool:
    """Whether a zygote accepts connections on ``socket_path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(socket_path))
            return True
        except OSError:
            return False


def start_zygote(python: str, socket_path: str, env: dict[str, str], log_path: str,
                 timeout: float = 180.0, cancel: threading.Event | None = None,
                 learned_path: str | None = None, outlive: bool = False) -> subprocess.Popen:
    """Start a zygote (for a deploy target) and wait until it accepts connections (or ``cancel``).
    ``outlive``: a shared zygote (:data:`SHARED_ZYGOTES_ENV`), which whoever set that variable stops."""
    log = open(log_path, "ab")
    learned = ["--learned", learned_path] if learned_path else []
    proc = subprocess.Popen([python, "-m", "kvrepro.engine.zygote", "--socket", socket_path, *learned], env=env,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True,
                            preexec_fn=None if outlive else lifetime.child_hook())  # kvrepro#8: SIGTERM when kvrepro dies
    log.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cancel is not None and cancel.is_set():  # kvrepro#8: Ctrl-C while it preloads
            proc.terminate()
            raise RuntimeError("interrupted while the engine zygote was starting")
        if proc.poll() is not None:
            raise RuntimeError(f"the engine zygote exited with code {proc.returncode}; see {log_path}")
        if _answers(Path(socket_path)):
            return proc
        time.sleep(0.1)
    proc.terminate()
    raise RuntimeError(f"the engine zygote did not listen on {socket_path} within {timeout:.0f}s; see {log_path}")


class RedactingLog:
    """Copies a child's output into its log file line by line, through ``secrets.redact``: a
    token the engine prints (vLLM logs its non-default arguments) never reaches the disk."""

    def __init__(self, source, log_path: Path):
        self._source = source
        self._log = log_path.open("ab")
        self._thread = threading.Thread(target=self._pump, name=f"kvrepro-log-{log_path.parent.name}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for line in iter(self._source.readline, b""):
                self._log.write(redact(line.decode("utf-8", "replace")).encode())
                self._log.flush()
        except (OSError, ValueError):
            pass
        finally:
            self._source.close()
            self._log.close()

    def close(self, timeout: float = 5.0) -> None:
        """Wait for the output to end (the engine exited); give up after ``timeout``."""
        self._thread.join(timeout)


_HEALTH_POLL_S = 0.05  # how often a starting engine's /health is asked


class ProcessEngine(EngineHandle):
    """An engine running as a child process in its own session, logging to a file."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, port: int):
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"
        # Own session: the user's Ctrl-C reaches kvrepro, which stops the engine in order
        # (SIGTERM, then SIGKILL) after recording what it has.
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=lifetime.child_hook())  # kvrepro#8: dies with kvrepro, even on SIGKILL
        self._log = RedactingLog(self.proc.stdout, log_path)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def wait_healthy(self, timeout: float, cancel: threading.Event | None = None) -> None:
        import requests  # here, not at the top: every kvrepro command imports this module (~60 ms)

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                raise InfraError("interrupted while the engine was starting")
            code = self.proc.poll()
            if code is not None:
                raise InfraError(f"engine exited with code {code} before it became healthy; "
                                 f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            try:
                if requests.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            # a refused connection costs next to nothing; each poll skipped is time the run waits
            if cancel is not None:
                cancel.wait(_HEALTH_POLL_S)
            else:
                time.sleep(_HEALTH_POLL_S)
        raise InfraError(f"engine did not become healthy within {timeout:.0f}s "
                         f"(runs.start_timeout_s); last lines of {self.log_path}:\n{log_tail(self.log_path)}")

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:  # a second SIGTERM: the zygote client SIGKILLs the engine's whole session
                    os.killpg(self.proc.pid, signal.SIGTERM)
                    self.proc.wait(timeout=2)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
                if self.proc.poll() is None:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
        self._log.close()
        scratch.release_regions()  # the /dev/shm regions of engines that have ended, this one's included


# Set (to a folder) by whoever runs many short kvrepro commands in a row and stops what they leave
# (kvrepro's own test session, tests/conftest.py): each runtime's zygote is started once in that
# folder and outlives the command, so the next command forks its engines at once instead of
# importing torch & co. again (~9 CPU s a command). Never set by kvrepro itself: a kvrepro command
# must leave nothing running, and without the variable it does not.
SHARED_ZYGOTES_ENV = "KVREPRO_SHARED_ZYGOTES"


def shared_zygote(folder: Path, python: str, env: dict[str, str], learned_path: str) -> str:
    """The socket of the shared zygote of ``python`` + ``env["PYTHONPATH"]`` in ``folder``, started
    (detached, its pid in ``<key>.pid``) by the first command that needs it, under a file lock so
    two commands never start two."""
    key = hashlib.sha256(f"{python}\0{env.get('PYTHONPATH', '')}".encode()).hexdigest()[:16]
    sock = folder / f"{key}.sock"
    with (folder / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _answers(sock):
            sock.unlink(missing_ok=True)
            # its own temp folder: a command's scratch folder is gone when that command ends
            tmp = folder / f"{key}.tmp"
            tmp.mkdir(exist_ok=True)
            env = dict(env, TMPDIR=str(tmp), VLLM_RPC_BASE_PATH=str(tmp))
            proc = start_zygote(python, str(sock), env, str(folder / f"{key}.log"),
                                learned_path=learned_path, outlive=True)
            (folder / f"{key}.pid").write_text(f"{proc.pid}\n")
    return str(sock)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited: reaped here when it is this process's child (a zygote a test
    process started itself), or a zombie its own parent has yet to reap."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    return lifetime.process_start(pid) is None


def stop_shared_zygotes(folder: Path) -> list[int]:
    """For whoever set :data:`SHARED_ZYGOTES_ENV`: SIGTERM every zygote that kvrepro commands started
    in ``folder`` and its engines (each zygote leads its own process group), SIGKILL what is left
    after 10 s; returns the pids it found."""
    pids = []
    for pid_file in folder.glob("*.pid"):
        try:
            pids.append(int(pid_file.read_text()))
        except (OSError, ValueError):
            continue
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(map(_gone, pids)):
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    return pids


class _Zygote:
    """One engine zygote per runtime (python + layers): builds of one release share it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.socket = folder / "zygote.sock"
        self.proc: subprocess.Popen | None = None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


@register("sim")
class SimTarget(Target):
    """Runs each build's overlay in the shared runtime env (no GPU, no container)."""

    starts_during_stop = True  # each engine on a port of its own, no GPU to share

    # added to every engine's environment: the `ray` target's node side names the run's placement
    # group here (its per-run copy of this target sets it; the shared zygote stays as it is)
    engine_env: dict[str, str] = {}

    def __init__(self, loaded):
        super().__init__(loaded)
        self._runtimes: dict[str, builds.Runtime] = {}
        self._zygotes: dict[str, _Zygote] = {}
        self._zygote_lock = threading.Lock()
        self._zygote_parent = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrepro-zygote-parent")
        self._interrupted = threading.Event()

    def interrupt(self) -> None:
        """Ctrl-C / SIGTERM: engines (and the zygote) still starting give up now."""
        self._interrupted.set()

    def _zygote_socket(self, runtime: builds.Runtime) -> str | None:
        """Start (once) the engine zygote: it imports torch & co. once and forks every engine.

        Most of an engine's start-up is importing vLLM's dependencies, identical for every
        build; without the zygote each run pays ~10 s of it. If it cannot start, engines start
        the ordinary way.
        """
        shared = os.environ.get(SHARED_ZYGOTES_ENV)
        if shared:
            env = self._base_environment()
            env["PYTHONPATH"] = runtime.pythonpath(paths.engine_import_root())
            try:
                return shared_zygote(Path(shared), str(runtime.python), env, str(zygote_lesson(runtime)))
            except (OSError, RuntimeError) as exc:
                self.on_line(f"shared engine zygote unavailable, starting this command's own: {exc}")
        with self._zygote_lock:
            zygote = self._zygotes.get(runtime.key)
            if zygote is None:
                # under this kvrepro's one temp folder, removed on every exit path (kvrepro/scratch.py)
                zygote = self._zygotes[runtime.key] = _Zygote(Path(tempfile.mkdtemp(prefix="zygote-",
                                                                                    dir=scratch.folder())))
                env = self._base_environment()
                env["PYTHONPATH"] = runtime.pythonpath(paths.engine_import_root())
                self.on_line("starting the engine zygote (imports vLLM's dependencies once)")
                try:
                    # Started from the target's own long-lived thread: the zygote's parent-death
                    # signal fires when the *thread* that forked it ends, and a run slot's or a
                    # bisection's prefetch thread may end long before kvrepro does.
                    zygote.proc = self._zygote_parent.submit(
                        start_zygote, str(runtime.python), str(zygote.socket), env,
                        str(zygote.folder / "zygote.log"), cancel=self._interrupted,
                        learned_path=str(zygote_lesson(runtime))).result()  # kvrepro#8
                except RuntimeError as exc:
                    if self._interrupted.is_set():  # stopping: no engine starts, directly or not
                        self.on_line("engine zygote not started: stopping")
                    else:
                        self.on_line(f"engine zygote unavailable, starting engines directly: {exc}")
            return str(zygote.socket) if zygote.running() else None

    def shared_zygote_socket(self, base: str) -> str | None:
        """The shared zygote of ``base``'s runtime when :data:`SHARED_ZYGOTES_ENV` names a folder
        (kvrepro's tests set it), else None. The minimizer's offline engines fork from it then;
        without one they start on their own (one zygote of their own would cost them as much)."""
        if not os.environ.get(SHARED_ZYGOTES_ENV):
            return None
        return self._zygote_socket(self.runtime(base))

    def warm_up(self, artifacts: list[BuildArtifact]) -> None:
        """The engine zygote of each release these builds run on, started (and preloaded with its
        kept lesson) before the first run: the first engine of every slot forks as warm as the rest."""
        for base in dict.fromkeys(a.plan.base for a in artifacts if a.ok):
            if self._interrupted.is_set():
                return
            self._zygote_socket(self.runtime(base))

    def close(self) -> None:
        for zygote in self._zygotes.values():
            zygote.stop()
        self._zygote_parent.shutdown(wait=False)

    def max_parallel(self) -> int:
        # one engine keeps about one core busy; the load generator is light
        return max(1, min(4, os.cpu_count() or 1))

    def runtime(self, base: str) -> builds.Runtime:
        """The runtime env (and layer) of a vLLM release, made on first use."""
        if base not in self._runtimes:
            self._runtimes[base] = builds.prepare_runtime(base, self.on_line)
        return self._runtimes[base]

    def prepare(self, plan: BuildPlan) -> BuildArtifact:
        try:
            versions.require(plan.base)
            self.runtime(plan.base)
            return builds.build_overlay(plan, self.on_line)
        except (versions.UnsupportedRelease, KvreproError) as exc:
            return BuildArtifact(plan=plan, ref=None, manifest=BuildManifest(), error=str(exc))
        except OSError as exc:  # a read-only or full cache: this build is INFRA, with what to do
            return BuildArtifact(plan=plan, ref=None, manifest=BuildManifest(),
                                 error=f"build {plan.name}: cannot write the build cache: {describe_os_error(exc)}")

    def command(self, artifact: BuildArtifact, port: int, run_dir: Path | None = None) -> list[str]:
        """`vllm serve MODEL ARGS` in the build's runtime (see kvrepro.engine.__main__); with
        ``run_dir``, its fs offload tiers in that run's folders (kvrepro/spec/fs_tier.py)."""
        engine = self.loaded.matrix.engine
        args = engine.serve_args(str(self.loaded.model_dir()), include_sim=True,
                                 fs_tier_root=self.fs_tier_root(run_dir) if run_dir is not None else None)
        python = self.runtime(artifact.plan.base).python
        return [str(python), "-m", "kvrepro.engine", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]

    @staticmethod
    def _base_environment() -> dict[str, str]:
        env = scrubbed_environ()
        paths.keep_byte_code(env)  # outside the (shared, hard-linked) overlays, so restarts skip compiling
        # vLLM's IPC sockets and other temporary files under kvrepro's temp folder (kvrepro/scratch.py)
        env.update(scratch.engine_env())
        return env

    def environment(self, artifact: BuildArtifact, rep: int, zygote: str | None = None) -> dict[str, str]:
        env = self._base_environment()
        if zygote:
            env[ZYGOTE_ENV] = zygote
        env.update(
            PYTHONPATH=self.runtime(artifact.plan.base).pythonpath(artifact.ref or "", paths.engine_import_root()),
            PYTHONUNBUFFERED="1",
            KVREPRO_SIM="1",
            VLLM_KEEP_ALIVE_ON_ENGINE_DEATH="1",
            # vLLM >= 0.30 defaults `vllm serve` to spawn; fork lets EngineCore reuse the API
            # server's imports (no CUDA here to make fork unsafe)
            VLLM_WORKER_MULTIPROC_METHOD="fork",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_CACHE_ROOT=str(vllm_cache_root(artifact.plan)),
        )
        env.update(self.loaded.matrix.engine.sim.engine_env(rep))
        env.update(self.engine_env)
        return env

    def start(self, artifact: BuildArtifact, run_dir: Path, rep: int) -> EngineHandle:
        if not artifact.ok:
            raise InfraError(artifact.error or "build failed")
        if self._interrupted.is_set():
            raise InfraError("interrupted before the engine was started")
        port = free_port()
        zygote = self._zygote_socket(self.runtime(artifact.plan.base))
        fresh_fs_tiers(self.fs_tier_folders(run_dir))
        handle = ProcessEngine(self.command(artifact, port, run_dir),
                               self.environment(artifact, rep, zygote),
                               run_dir / "engine.log", port)
        try:
            handle.wait_healthy(self.loaded.matrix.runs.start_timeout_s, cancel=self._interrupted)
        except BaseException:
            handle.stop(grace=1.0 if self._interrupted.is_set() else 10.0)  # mid-start: nothing to flush
            raise
        return handle


def fresh_fs_tiers(folders) -> None:
    """Each fs offload tier's folder (kvrepro.deploy.records.FsTierFolder, a local path), empty: a
    leftover of an earlier start in the same run folder is removed first."""
    for folder in folders:
        path = Path(folder.engine_root_dir)
        try:
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.exists():
                shutil.rmtree(path)
            path.mkdir(parents=True)
        except OSError as exc:
            raise InfraError(f"cannot make the fs offload tier's folder {path}: {describe_os_error(exc)}") from None


# --- `kvrepro engine serve`: one build served in the foreground until a stop signal ---------------

def check_port_free(port: int) -> None:
    """BadInputError when 127.0.0.1:PORT cannot be listened on (another server holds it)."""
    from ..errors import BadInputError

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise BadInputError(f"--port {port}: 127.0.0.1:{port} is in use ({exc.strerror}); stop what listens "
                                "there or choose another --port") from None


def serve_build(loaded, build: str, port: int, rep: int, say, status) -> int:
    """`kvrepro engine serve`: build ``build`` of ``loaded`` (a spec LoadedMatrix) and serve it on
    127.0.0.1:``port`` in the foreground (:func:`serve_foreground`); ``status(text)`` is the
    context shown while it builds, ``say`` one line on stderr."""
    plan = loaded.plans([build])[0]
    check_port_free(port)  # at once, not after vLLM's 18 s of imports end in `OSError: [Errno 98]`
    target = SimTarget(loaded)
    with status(f"building {build}"):
        artifact = target.prepare(plan)
    if not artifact.ok:
        raise KvreproError(f"build {build} failed: {artifact.error}")
    say(f"serving build {build} on http://127.0.0.1:{port} (overlay {artifact.ref}); Ctrl-C to stop")
    return serve_foreground(target, artifact, port, rep, say)


def serve_foreground(target: "SimTarget", artifact: BuildArtifact, port: int, rep: int, say) -> int:
    """Run ``artifact``'s `vllm serve` until it exits or a stop signal arrives (kvrepro/stopping.py:
    the first stops the engine with SIGTERM, the next at once); its exit code, 130 when stopped.
    Nothing it started outlives this call."""
    from .. import stopping

    cmd = target.command(artifact, port)
    # its own session: a terminal's Ctrl-C reaches kvrepro only, which stops the engine once
    proc = subprocess.Popen(cmd, env=target.environment(artifact, rep), start_new_session=True,
                            preexec_fn=lifetime.child_hook())  # kvrepro#8: dies with us, even on SIGKILL
    stop = threading.Event()

    def on_first(signum: int) -> None:  # SIGINT, SIGTERM (a supervisor, `kill`), SIGHUP: stop the engine
        say(f"{stopping.name(signum)}: stopping the engine (again to stop at once)")
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    try:
        with stopping.stop_on_signals(stop, on_first):
            code = proc.wait()
    finally:
        if proc.poll() is None:  # a second signal, or an exception of our own: never outlives the command
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        try:  # what the engine started in its session (EngineCore) goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return 130 if stop.is_set() else code


# ---------------------------------------------------------------- as the engine on another target's nodes
# (``ray.engine: sim``; kvrepro.deploy.node_engine finds these hooks by this name)
NODE_ENGINE = __name__


def check_for_nodes(loaded) -> None:
    """Nothing of `sim` that a node could not honour: it has no settings of its own."""


def prepare_for_nodes(plan: BuildPlan, artifact: BuildArtifact) -> NodeBuild:
    """The build's overlay folder: the transport carries it to each node once."""
    return NodeBuild(folder=Path(str(artifact.ref)))


def node_artifact(target: SimTarget, artifact: BuildArtifact, build: NodeBuild, cache: Path,
                  where: str) -> BuildArtifact:
    """The build run from the node's copy of the overlay (its own source root, for the probe's paths)."""
    if build.folder is None:
        return artifact
    return replace(artifact, ref=str(build.folder), source_root=str(build.folder))
