"""Engine zygote: pay vLLM's third-party import cost once per matrix, not once per run.

Most of an engine's start-up is importing torch, transformers, fastapi, opentelemetry and the
like, which are the same for every build; only ``vllm`` itself differs (each build is its own
overlay). A zygote is a runtime-env python that has imported those dependencies, but never
vLLM, and forks one engine per request. A forked engine imports vLLM from its own overlay and
then runs exactly what ``python -m kvrepro.engine`` runs: vLLM's own ``vllm serve``. Its API
server in turn forks the EngineCore process (the platform plugin selects ``fork``), so neither
process imports torch again.

Use (stdlib only on both sides):

* the deploy target starts ``<runtime python> -m kvrepro.engine.zygote --socket PATH`` once
  (``kvrepro.deploy.sim.start_zygote``) and stops it when done (SIGTERM; it takes its engines down with it);
* engine commands stay ``python -m kvrepro.engine <args>``, with env
  ``KVREPRO_ENGINE_ZYGOTE=PATH``: that process then becomes a thin client that hands its argv,
  environment, working directory and stdin/stdout/stderr to the zygote, forwards SIGTERM /
  SIGINT / SIGHUP to the forked engine and exits with its exit code. If no zygote answers, the
  engine starts normally (one line on stderr says so). If the client dies, the engine sees
  its connection close and shuts itself down.

The zygote learns what to preload: the first engine it forks reports the non-vLLM modules it
ended up importing, and the zygote imports them before the next fork. With ``--learned FILE``
what was learned is also kept in FILE (one module a line) and preloaded from the start by the
next zygote of the same runtime: without it the first engine of every slot (forked before any
engine had reported) imported those modules itself, 12-15 s to healthy against 4 s for the rest.

Build zygotes: vLLM itself once per build, not once per engine (kvrepro issue 27). Importing a
build's `vllm serve` path costs ~2 CPU s, and each build runs several engines (a matrix's
repetitions, a bisection's probes). So the zygote forks, per build (its ``PYTHONPATH``: the
content-addressed overlay first), a *build zygote* that puts the overlay on ``sys.path``, imports
:data:`SERVE_PRELOAD` (and, once the first engine has reported them, the vLLM modules it imported),
and then forks that build's engines; the zygote hands each request over with its fds. What must
stay each engine's own:

* output: what the import printed (the platform plugin's lines) is captured and written at the
  start of each engine's own log, after one ``kvrepro zygote: forked from build zygote`` line;
  the probe's ``installed`` line is printed when its target module is imported, which a build
  zygote never does (:data:`_ENGINE_ONLY`), so it comes from each engine's own API server;
* settings: the environment variables the import read are recorded with their values; an engine
  whose environment differs in one of them is forked by the zygote and imports vLLM itself. kvrepro's
  engine modules that read per-run ``KVREPRO_SIM_*`` settings (executor, shadow, faults, arcs) are
  never imported there (:data:`_IMPORT_SAFE_OWN`), and the probe starts its counts from zero in
  every forked process;
* failure: a build whose serve path does not import is remembered; its engines import vLLM
  themselves and their logs show the real error, as without build zygotes;
* lifetime: build zygotes are the zygote's children in its process group, die with it, and stop
  their engines on SIGTERM; at most :data:`BUILD_ZYGOTES_MAX` per zygote.

``KVREPRO_BUILD_ZYGOTES=0`` in an engine's environment turns this off for that engine.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable

ENV_VAR = "KVREPRO_ENGINE_ZYGOTE"
# Imported before the first engine is forked: the heavy roots every vLLM import pulls in.
DEFAULT_PRELOAD = (
    "torch", "torch._dynamo", "torch._inductor", "torch._inductor.standalone_compile",
    "torch._inductor.lowering", "torch.fx.experimental.symbolic_shapes", "sympy", "networkx",
    "numpy", "transformers", "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto", "transformers.models.auto.image_processing_auto",
    "opentelemetry.trace", "openai", "triton", "msgspec", "zmq", "pydantic", "prometheus_client",
    "huggingface_hub", "safetensors", "cbor2", "psutil", "fastapi", "uvicorn", "uvloop", "starlette",
    "aiohttp", "tokenizers", "transformers.tokenization_utils_fast",
)
_OWN_ROOTS = ("vllm", "kvrepro", "kvrepro_probe", "__main__", "__mp_main__")
_MAX_MESSAGE = 1 << 20

# Build zygotes (see the module docstring). What one imports before its first engine's lesson is in:
# vLLM's `vllm serve` path, down to the EngineCore.
SERVE_PRELOAD = ("vllm.entrypoints.cli.main", "vllm.entrypoints.openai.api_server", "vllm.v1.engine.core",
                 "vllm.v1.engine.async_llm", "vllm.v1.core.sched.scheduler")
# Never imported in a build zygote: the probe's target lives here (kvrepro_probe.TARGET_MODULE), and the
# probe prints its `installed` line, which the classifier reads from each engine's own log, when it wraps.
_ENGINE_ONLY = ("vllm.distributed.kv_transfer",)
# Live build zygotes per runtime zygote, least recently used retired first (a retired one exits when its
# engines have). 6: the default matrix's 5 builds of one release stay warm through all repetitions, plus
# one (a bisection's next probe, a test's patched build). Each holds ~220 MB of its own (private dirty,
# measured on 0.26.0: vLLM's modules and the pages the fork copied), so 6 stay under 1.5 GB; a suite's
# ~10 releases are other runtimes or other overlays, run one after another: the oldest retire.
BUILD_ZYGOTES_MAX = 6
# "0" in an engine's environment: that engine is forked by the runtime zygote and imports vLLM itself
# (benchmarks/matrix_wallclock.py --build-zygotes compares both ways in one run).
BUILD_ZYGOTES_ENV = "KVREPRO_BUILD_ZYGOTES"
# "0" in the zygote's environment: no gc.freeze() before forking (benchmarks/zygote_gc_freeze.py compares)
GC_FREEZE_ENV = "KVREPRO_ZYGOTE_GC_FREEZE"
# kvrepro's own modules that may be imported in a build zygote: they read nothing of a run's own at
# import (the plugin reads KVREPRO_SIM when vLLM calls it; the probe counts from zero in each fork). The
# engine's others (executor, shadow, arcs, faults) read per-run KVREPRO_SIM_* settings and are imported
# by each engine itself; a build zygote that imported one fails, and its engines import vLLM themselves.
_IMPORT_SAFE_OWN = ("kvrepro", "kvrepro.engine", "kvrepro.engine.zygote", "kvrepro.engine.plugin",
                    "kvrepro.engine.platform", "kvrepro.engine.model_info", "kvrepro.lifetime", "kvrepro_probe")


def _send(conn: socket.socket, payload: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(payload).encode() + b"\n"
    if fds:
        socket.send_fds(conn, [data], fds)
    else:
        conn.sendall(data)


def _recv_line(conn: socket.socket, with_fds: bool = False) -> tuple[dict | None, list[int]]:
    buf = b""
    fds: list[int] = []
    while not buf.endswith(b"\n"):
        if with_fds and not fds:
            chunk, got, _flags, _addr = socket.recv_fds(conn, _MAX_MESSAGE, 8)
            fds = list(got)
        else:
            chunk = conn.recv(_MAX_MESSAGE)
        if not chunk:
            return None, fds
        buf += chunk
    return json.loads(buf), fds


def freeze_heap() -> None:
    """Move everything imported so far into the collector's permanent generation before forking.

    A zygote's heap is about 630,000 tracked objects (torch & co.; more with a build's vLLM). Each
    forked engine process (API server, EngineCore) runs full collections over it: vLLM's own
    ``freeze_gc_heap`` at the end of its start-up (gc.collect(2): measured 0.3 CPU s over that
    heap) and whatever automatic gen-2 collections come before, and each traversal also writes
    every object's header, copying the zygote's pages into the child. Frozen objects are skipped
    by every later collection in the zygote and in every child (CPython's gc.freeze(), made for
    pre-fork servers); they are modules and what they hold, never garbage."""
    if os.environ.get(GC_FREEZE_ENV, "1") == "0":
        return
    import gc

    gc.collect()
    gc.freeze()


def preload(names) -> int:
    ok = 0
    for name in names:
        if name.split(".")[0] in _OWN_ROOTS or name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            ok += 1
        except BaseException:  # a module that cannot be imported here is simply not preloaded
            pass
    return ok


def _foreign_modules(exclude_dirs: list[str]) -> list[str]:
    names = []
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] in _OWN_ROOTS:
            continue
        path = getattr(module, "__file__", None) or ""
        if any(path.startswith(d) for d in exclude_dirs):
            continue
        names.append(name)
    return sorted(names)


# -- the forked engine ----------------------------------------------------------------------

def _serve_modules() -> list[str]:
    """The vLLM modules this engine imported, in import order: what a build zygote preloads."""
    return [name for name, module in list(sys.modules.items())
            if module is not None and (name == "vllm" or name.startswith("vllm."))
            and not name.startswith(_ENGINE_ONLY)]


def _take_over(request: dict, fds: list[int], replay: bytes) -> list[str]:
    """In the child: the client's stdin/stdout/stderr, environment, working directory and overlay
    on sys.path, in a session of its own; the overlay's paths."""
    os.setsid()
    for target, fd in zip((0, 1, 2), fds[:3], strict=False):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    _write_all(1, replay)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    # the zygote's own TMPDIR may be another command's (a shared zygote): ask again
    tempfile.tempdir = None
    os.chdir(request["cwd"])
    overlay_paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0:0] = [p for p in overlay_paths if p not in sys.path]
    importlib.invalidate_caches()
    return overlay_paths


def _watch_client(conn: socket.socket) -> None:
    """The client holds the other end of ``conn``; if it goes away, so does this engine."""
    try:
        while conn.recv(1024):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    from kvrepro import lifetime  # kvrepro#8: nobody waits on us any more: bound the stop

    lifetime.kill_group_later(os.getpid(), grace=3.0)


def _module_reporter(listen_path: str, overlay_paths: list[str], learn: bool) -> Callable[[], None]:
    """What the engine calls once settled: tell the zygote what it imported (only when asked to learn)."""

    def report_modules() -> None:
        if not learn:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(listen_path)
                _send(s, {"learn": _foreign_modules(overlay_paths), "serve": _serve_modules()})
        except OSError:
            pass

    return report_modules


def _run_engine(conn: socket.socket, listen_path: str, request: dict, fds: list[int], learn: bool,
                replay: bytes = b"") -> None:
    """In the child: become the engine process the client asked for, then exit.

    ``replay``: what vLLM printed while a build zygote imported it (its plugin and platform lines),
    written first so that this engine's own log reads as if it had imported vLLM itself."""
    code = 1
    try:
        overlay_paths = _take_over(request, fds, replay)
        argv = list(request["argv"])
        sys.argv = ["kvrepro.engine", *argv]
        threading.Thread(target=_watch_client, args=(conn,), name="zygote-client-watch", daemon=True).start()
        module = request.get("module")
        if module:  # `python -m MODULE ARGV` (the minimizer's kvrepro.engine.offline), run as its own __main__
            import runpy

            os.environ.pop(ENV_VAR, None)  # its __main__ must not hand itself to a zygote again
            sys.argv = [module, *argv]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        else:
            from kvrepro.engine.vllm_cli import run

            code = run(argv, on_settled=_module_reporter(listen_path, overlay_paths, learn))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


# -- the zygote -------------------------------------------------------------------------------

def read_learned(path: str | None) -> list[str]:
    """The modules a previous zygote of this runtime learned (none when the file is missing)."""
    if not path:
        return []
    try:
        with open(path, encoding="utf-8") as fh:
            return [line.strip() for line in fh if line.strip() and not line.startswith("#")]
    except OSError:
        return []


def write_learned(path: str | None, names: list[str]) -> None:
    """Keep what was learned, added to what was there (atomically: several zygotes may write)."""
    merged = sorted(set(read_learned(path)) | {n for n in names if n.split(".")[0] not in _OWN_ROOTS})
    _write_lines(path, merged, "modules a kvrepro engine zygote preloads (learned from its engines)")


def _serve_lesson(learned_path: str | None) -> str | None:
    """Where the vLLM modules a build zygote imports are kept: beside the runtime's lesson."""
    return f"{learned_path}.vllm" if learned_path else None


def _write_lines(path: str | None, names: list[str], title: str) -> None:
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(f"# {title}\n")
            fh.writelines(name + "\n" for name in names)
        os.replace(tmp, path)
    except OSError:  # a read-only cache only costs the next zygote the lesson
        try:
            os.unlink(tmp)
        except OSError:
            pass


class _Engines:
    """The engines one zygote (runtime or build) forked: each one's client connection, until it exits."""

    def __init__(self) -> None:
        self.conns: dict[int, socket.socket] = {}

    def reap(self, others: "dict[int, object] | None" = None) -> list[int]:
        """Tell the clients of engines that ended their exit codes; the pids of ``others`` that ended."""
        ended = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = self.conns.pop(pid, None)
            if conn is not None:
                try:
                    _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()
            elif others is not None and pid in others:
                ended.append(pid)
        return ended

    def fork(self, conn: socket.socket, listen_path: str, request: dict, fds: list[int], learn: bool,
             closing: list, replay: bytes = b"") -> int:
        """Fork one engine for ``conn``'s client; ``closing``: this zygote's sockets and fds (other clients'
        stdin/stdout/stderr waiting for a build zygote) the engine must not hold: a client's output ends
        only when no process holds its pipe."""
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            from kvrepro import lifetime  # kvrepro#8: the engine dies with the zygote

            lifetime.die_with_parent(signal.SIGTERM, expected_parent=parent)
            _close(closing)
            for other in self.conns.values():
                other.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            _run_engine(conn, listen_path, request, fds, learn, replay)
        # one line per engine: a shared zygote's log shows which commands it served (tests/test_shared_zygote.py)
        print(f"kvrepro zygote: forked engine {pid}", file=sys.stderr, flush=True)
        for fd in fds:
            os.close(fd)
        self.conns[pid] = conn
        try:
            _send(conn, {"pid": pid})
        except OSError:
            pass
        return pid

    def stop(self, grace: float, extra: "list[int] | tuple" = ()) -> None:
        """SIGTERM every engine (and ``extra`` children), SIGKILL the groups of those still there after ``grace``."""
        pending = set(self.conns) | set(extra)
        for pid in pending:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pending and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                pending.discard(pid)
            else:
                time.sleep(0.05)
        for pid in pending:
            try:
                if pid in self.conns:
                    os.killpg(pid, signal.SIGKILL)  # the engine and what it started (it called setsid)
                else:
                    os.kill(pid, signal.SIGKILL)  # a build zygote (its engines get their parent-death signal)
            except ProcessLookupError:
                pass


# -- build zygotes: vLLM of one build imported once, engines of that build forked from it --------

def _close(items) -> None:
    """Close sockets and raw fds (a forked child's copies of what is not its own)."""
    for item in items:
        try:
            if isinstance(item, int):
                os.close(item)
            else:
                item.close()
        except OSError:
            pass


def _differing(reads: dict, env: dict) -> list[str]:
    """The variables read while vLLM was imported whose value in ``env`` differs: none for a match."""
    return sorted(k for k, v in reads.items() if env.get(k) != v)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _RecordingEnviron(type(os.environ)):  # type: ignore[misc]
    """os.environ that notes every variable read (and its value, None when unset): a later engine may
    use what was imported with these values only if its own environment has the same ones."""

    reads: dict = {}

    def __getitem__(self, key):
        try:
            value = super().__getitem__(key)
        except KeyError:
            _RecordingEnviron.reads.setdefault(key, None)
            raise
        _RecordingEnviron.reads.setdefault(key, value)
        return value


def _import_build(modules: list[str]) -> tuple[bool, int, dict, bytes, str]:
    """Import ``modules`` (vLLM's serve path) here, with fds 1 and 2 captured: (the serve path imported,
    modules imported, variables read, what was printed, the first error)."""
    capture = os.memfd_create("kvrepro-build-zygote-imports")
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(capture, 1)
    os.dup2(capture, 2)
    environ_class = type(os.environ)
    _RecordingEnviron.reads = {}
    os.environ.__class__ = _RecordingEnviron
    count, error = 0, ""
    try:
        for name in modules:
            if name.startswith(_ENGINE_ONLY) or name in sys.modules:
                continue
            try:
                importlib.import_module(name)
                count += 1
            except BaseException as exc:  # noqa: BLE001 - the engine will meet it again, in its own log
                if not error:
                    error = f"{name}: {type(exc).__name__}: {exc}"
    finally:
        os.environ.__class__ = environ_class
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    size = os.lseek(capture, 0, os.SEEK_END)
    printed = os.pread(capture, size, 0) if size else b""
    os.close(capture)
    own = sorted(n for n in sys.modules if n.split(".")[0] in ("kvrepro", "kvrepro_probe") and n not in _IMPORT_SAFE_OWN)
    if own and not error:  # kvrepro's engine modules read their KVREPRO_* settings as they run, not here
        error = f"vLLM's import pulled in {', '.join(own[:3])}, whose settings are each engine's own"
    ok = SERVE_PRELOAD[0] in sys.modules and not own
    return ok, count, dict(_RecordingEnviron.reads), printed, error


def _build_zygote(control: socket.socket, listen_path: str, env: dict, modules: list[str]) -> None:
    """In the child of a runtime zygote: import the build's vLLM, then fork that build's engines as the
    runtime zygote hands them over on ``control``, until it says retire (then: until they are gone),
    SIGTERM, or the runtime zygote goes."""
    code = 0
    try:
        # stays in the runtime zygote's process group: whoever stops that group (kvrepro.deploy.sim.stop_shared_zygotes)
        # stops this one too, and it stops its engines (each in a session of its own)
        stopping = {"flag": False}
        signal.signal(signal.SIGTERM, lambda *_: stopping.update(flag=True))
        signal.signal(signal.SIGINT, lambda *_: stopping.update(flag=True))
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None
        overlay_paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[0:0] = [p for p in overlay_paths if p not in sys.path]
        importlib.invalidate_caches()
        started = time.monotonic()
        ok, count, reads, printed, error = _import_build(modules)
        seconds = time.monotonic() - started
        _write_all(2, printed)
        if not ok:
            _send_control(control, {"failed": error or "vLLM's serve path did not import"})
            return
        freeze_heap()  # this build's vLLM too: its engines' collections skip it
        _send_control(control, {"ready": reads, "modules": count, "seconds": round(seconds, 2)})
        print(f"kvrepro zygote: build zygote {os.getpid()} imported {count} vLLM modules in {seconds:.1f} s "
              f"for {overlay_paths[0] if overlay_paths else '?'}", file=sys.stderr, flush=True)
        header = (f"kvrepro zygote: forked from build zygote {os.getpid()}, which imported this build's vLLM "
                  f"({count} modules, {seconds:.1f} s); what that import printed:\n").encode()
        engines = _Engines()
        retiring = False
        while not stopping["flag"] and not (retiring and not engines.conns):
            engines.reap()
            try:
                ready, _, _ = select.select([control], [], [], 0.1)
            except InterruptedError:
                continue
            if not ready:
                continue
            try:
                message, fds = _recv_control(control)
            except OSError:
                message, fds = None, []
            if message is None:  # the runtime zygote is gone: so are its engines
                break
            if message.get("retire"):
                retiring = True
                continue
            conn = socket.socket(fileno=fds[0])
            engines.fork(conn, listen_path, message["request"], fds[1:], bool(message.get("learn")),
                         closing=[control], replay=header + printed)
        engines.stop(grace=4.0)
    except BaseException:  # noqa: BLE001 - in a forked child: say why, never return into the parent's loop
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _send_control(sock: socket.socket, payload: dict, fds: list[int] | None = None) -> None:
    """One message on a SOCK_SEQPACKET pair: one JSON document, with its fds."""
    socket.send_fds(sock, [json.dumps(payload).encode()], fds or [])


def _recv_control(sock: socket.socket) -> tuple[dict | None, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 8)
    if not data:
        return None, list(fds)
    return json.loads(data), list(fds)


class _BuildZygote:
    """The runtime zygote's view of one build zygote: its pid, its control socket, what it read."""

    def __init__(self, pid: int, control: socket.socket):
        self.pid = pid
        self.control = control
        self.reads: dict | None = None  # until it has imported vLLM
        self.pending: list[tuple[socket.socket, dict, list[int], bool]] = []
        self.retired = False


# How often the server checks that its socket is still its own. No one can reach a zygote whose
# socket path is gone or names another socket: its folder was removed (the owner's scratch folder,
# by the owner or by its janitor after a SIGKILL; a test session's temporary folder) or a new zygote
# took the path. Such a zygote would otherwise hold its preloaded torch and vLLM (~0.5 GB a build)
# until the machine stops: measured 2026-12-05, 9 zygotes of killed test sessions alive 75-87 min.
_SOCKET_CHECK_S = 1.0


def _still_bound(path: str, inode: int) -> bool:
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


class _RuntimeZygote:
    """The runtime zygote's server: accepts engine requests on its socket and forks each engine,
    itself or through its build's zygote, until SIGTERM/SIGINT; then stops what it started."""

    def __init__(self, socket_path: str, learned_path: str | None):
        self.socket_path = socket_path
        self.learned_path = learned_path
        self.pid = os.getpid()
        self.listener: socket.socket | None = None
        self.engines = _Engines()
        self.builds: dict[str, _BuildZygote] = {}  # by PYTHONPATH (the overlay first), least recently used first
        self.by_pid: dict[int, _BuildZygote] = {}  # every build zygote still running, retired ones too
        self.broken: dict[str, str] = {}  # PYTHONPATHs whose vLLM did not import: their engines import it themselves
        self.stopping = False
        self.learned = False  # the first engine still reports: a build may import more than the last lesson
        # vLLM modules the first engine imported: what build zygotes preload, kept beside the runtime's lesson
        # so that the next zygote's first build zygotes import them too
        self.serve_lesson = read_learned(_serve_lesson(learned_path))

    # -- the loop -------------------------------------------------------------------------------

    def serve(self) -> int:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.socket_path)
        self.listener.listen(64)
        bound = os.stat(self.socket_path).st_ino
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        checked = time.monotonic()
        try:
            while not self.stopping:
                if time.monotonic() - checked >= _SOCKET_CHECK_S:
                    checked = time.monotonic()
                    self.stopping = not _still_bound(self.socket_path, bound)
                    if self.stopping:
                        print(f"kvrepro-zygote: {self.socket_path} is gone (its folder removed, its owner "
                              f"dead): stopping", file=sys.stderr, flush=True)
                        break
                self._reap_build_zygotes()
                try:
                    ready, _, _ = select.select([self.listener, *(b.control for b in self.by_pid.values())],
                                                [], [], 0.1)
                except InterruptedError:
                    continue
                for build in [b for b in self.by_pid.values() if b.control in ready]:
                    self._read_control(build)
                if self.listener in ready:
                    self._accept()
        finally:
            self._shut_down()
        return 0

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        self.stopping = True

    def _reap_build_zygotes(self) -> None:
        """Tell the clients of engines that ended their exit codes; forget build zygotes that ended."""
        for pid in self.engines.reap(self.by_pid):
            build = self.by_pid.pop(pid)
            self._forget(build, None)
            build.control.close()

    def _shut_down(self) -> None:
        for build in self.by_pid.values():  # stopping: engines still waiting for their build zygote are not started
            for conn, _request, fds, _learn in build.pending:
                conn.close()
                for fd in fds:
                    os.close(fd)
        self.engines.stop(grace=6.0, extra=list(self.by_pid))
        if self.listener is not None:
            self.listener.close()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    # -- requests -------------------------------------------------------------------------------

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            request, fds = _recv_line(conn, with_fds=True)
        except (OSError, ValueError):
            conn.close()
            return
        if request is None:
            conn.close()
        elif "learn" in request:
            conn.close()
            self._learn(request)
        else:
            self._route(conn, request, fds)

    def _learn(self, report: dict) -> None:
        """An engine's report of what it imported: the runtime's modules (preloaded now, from the
        first report only) and vLLM's serve path (what build zygotes import from now on)."""
        if report.get("serve") and not self.learned:
            reported = [n for n in report["serve"] if not n.startswith(_ENGINE_ONLY)]
            self.serve_lesson = list(dict.fromkeys([*self.serve_lesson, *reported]))
            _write_lines(_serve_lesson(self.learned_path), self.serve_lesson,
                         "vLLM modules a kvrepro build zygote imports (learned from its engines)")
        if self.learned:
            return
        self.learned = True
        count = preload(report["learn"])
        freeze_heap()
        write_learned(self.learned_path, report["learn"])
        print(f"kvrepro zygote: learned {count} more modules to preload", file=sys.stderr, flush=True)

    def _route(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        """Fork the engine here, or hand it to its build's zygote (started now if there is none)."""
        module = request.get("module")
        # what `vllm serve` imports: the runtime's modules once, vLLM's serve path once
        learn = not module and not self.learned
        env = request.get("env") or {}
        key = env.get("PYTHONPATH", "")
        if module or not key or env.get(BUILD_ZYGOTES_ENV) == "0" or key in self.broken:
            self._direct(conn, request, fds, learn)
            return
        build = self.builds.pop(key, None)
        if build is None:
            build = self._start_build(key, request, [conn, *fds])
        self.builds[key] = build  # most recently used last
        if build.reads is None:
            build.pending.append((conn, request, fds, learn))
        else:
            self._hand_over(build, conn, request, fds, learn)

    def _sockets(self) -> list:
        """What a forked child must close: the listener, clients' connections, build zygotes' control
        sockets, and the connections and stdio fds of engines waiting for their build zygote."""
        waiting = [item for b in self.by_pid.values() for conn, _r, fds, _l in b.pending for item in (conn, *fds)]
        return [self.listener, *self.engines.conns.values(), *(b.control for b in self.by_pid.values()), *waiting]

    def _direct(self, conn, request, fds, learn, also=()) -> None:
        """Fork the engine from this zygote: it imports vLLM itself."""
        self.engines.fork(conn, self.socket_path, request, fds, learn, closing=[*self._sockets(), *also])

    # -- build zygotes --------------------------------------------------------------------------

    def _read_control(self, build: _BuildZygote) -> None:
        """A build zygote's word: it is ready (its waiting engines go to it), failed, or gone."""
        try:
            message, _ = _recv_control(build.control)
        except OSError:
            message = None
        if message is None or "failed" in message:
            why = (message or {}).get("failed")
            if why:
                print(f"kvrepro zygote: build zygote {build.pid} could not import vLLM ({why}); "
                      "engines of that build import it themselves", file=sys.stderr, flush=True)
            self._forget(build, why)
            return
        if "ready" in message:
            build.reads = message["ready"]
            self._drain(build, lambda *item, b=build: self._hand_over(b, *item))

    def _drain(self, build: _BuildZygote, route) -> None:
        """Route the engines waiting for ``build``; each fork closes the waiting ones after it too."""
        waiting, build.pending = build.pending, []
        for i, (conn, request, fds, learn) in enumerate(waiting):
            rest = [item for c, _r, f, _l in waiting[i + 1:] for item in (c, *f)]
            route(conn, request, fds, learn, rest)

    def _hand_over(self, build: _BuildZygote, conn, request, fds, learn, also=()) -> None:
        differ = _differing(build.reads or {}, request["env"])
        if differ:  # imported with another value of a variable vLLM reads at import: not this engine's
            print(f"kvrepro zygote: this engine's {', '.join(differ[:3])} differ from build zygote "
                  f"{build.pid}'s; it imports vLLM itself", file=sys.stderr, flush=True)
            self._direct(conn, request, fds, learn, also)
            return
        try:
            _send_control(build.control, {"request": request, "learn": learn}, [conn.fileno(), *fds])
        except OSError:
            self._direct(conn, request, fds, learn, also)
            return
        conn.close()
        for fd in fds:
            os.close(fd)

    def _forget(self, build: _BuildZygote, why: str | None) -> None:
        """A build zygote that failed or went away: its waiting engines start the ordinary way."""
        key = next((k for k, b in self.builds.items() if b is build), None)
        if key is not None:
            del self.builds[key]
            if why:
                self.broken[key] = why
        self._drain(build, self._direct)

    def _retire_oldest(self) -> None:
        """At BUILD_ZYGOTES_MAX: the least recently used build zygote goes when its engines have."""
        oldest = self.builds.pop(next(iter(self.builds)))
        oldest.retired = True
        try:
            _send_control(oldest.control, {"retire": True})
        except OSError:
            pass

    def _start_build(self, key: str, request: dict, own: list) -> _BuildZygote:
        """Fork the build zygote of ``key`` (``own``: the connection and fds of the request that asks)."""
        if len(self.builds) >= BUILD_ZYGOTES_MAX:
            self._retire_oldest()
        parent_side, child_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        modules = list(dict.fromkeys([*SERVE_PRELOAD, *self.serve_lesson]))
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            from kvrepro import lifetime  # kvrepro#8: a build zygote dies with its runtime zygote

            lifetime.die_with_parent(signal.SIGTERM, expected_parent=self.pid)
            _close([*self._sockets(), *own])
            parent_side.close()
            _build_zygote(child_side, self.socket_path, request["env"], modules)
        child_side.close()
        build = _BuildZygote(pid, parent_side)
        self.builds[key] = self.by_pid[pid] = build
        print(f"kvrepro zygote: started build zygote {pid} for {key.split(os.pathsep)[0]} "
              f"({len(modules)} modules to import)", file=sys.stderr, flush=True)
        return build


def serve(socket_path: str, learned_path: str | None = None) -> int:
    """Preload, listen on ``socket_path``, fork engines until SIGTERM/SIGINT."""
    started = time.monotonic()
    count = preload(DEFAULT_PRELOAD)
    known = read_learned(learned_path)
    if known:
        count += preload(known)
    freeze_heap()
    print(f"kvrepro zygote: preloaded {count} modules in {time.monotonic() - started:.1f} s; "
          f"listening on {socket_path}", file=sys.stderr, flush=True)
    return _RuntimeZygote(socket_path, learned_path).serve()


# -- the thin client (python -m kvrepro.engine with KVREPRO_ENGINE_ZYGOTE set) ---------------

def delegate(socket_path: str, argv: list[str], module: str | None = None) -> int | None:
    """Run the engine in the zygote; its exit code, or None if no zygote answered.

    ``module``: None for ``python -m kvrepro.engine`` (vLLM's `vllm serve`), else the module the
    forked child runs as ``python -m MODULE`` would (``kvrepro.engine.offline``: the minimizer's
    engine on stdin/stdout)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
    except OSError:
        conn.close()
        return None
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "module": module}
    _send(conn, request, fds=[0, 1, 2])
    reply, _ = _recv_line(conn)
    if reply is None or "pid" not in reply:
        return None
    pid = reply["pid"]
    parent = os.getppid()

    stops = {"count": 0}

    def forward(signum, frame):
        if signum != signal.SIGHUP:
            stops["count"] += 1
        try:
            if stops["count"] > 1:  # kvrepro#8: a second stop is a hard stop, engine and helpers
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            pass
        if signum != signal.SIGHUP:  # kvrepro#8: a stop is bounded, even for an engine mid-start
            from kvrepro import lifetime

            lifetime.kill_group_later(pid, grace=5.0 if os.getppid() == parent else 3.0)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            message, _ = _recv_line(conn)
        except InterruptedError:
            continue
        if message is None:
            return 1  # the zygote went away; it took the engine with it
        if "exit" in message:
            try:  # kvrepro#8: what the engine started and left behind (its session) goes with it
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            code = message["exit"]
            return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrepro.engine.zygote")
    parser.add_argument("--socket", required=True, help="unix socket path to listen on")
    parser.add_argument("--learned", help="file of modules to preload, kept from earlier zygotes of this runtime")
    args = parser.parse_args(argv)
    if "vllm" in sys.modules:
        print("kvrepro zygote: vllm must not be imported in the zygote", file=sys.stderr)
        return 2
    return serve(args.socket, args.learned)


def exit_now(code: int) -> None:
    """End the zygote without the interpreter's teardown: with torch and ~4,700 other modules
    loaded that took 6.2 s here (against 0.2 s), after every matrix, while the runner waits for
    the zygote to go. The zygote holds nothing that teardown would save: its lesson is written
    atomically as it learns, its engines are stopped by ``serve`` before it returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
