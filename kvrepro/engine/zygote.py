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

def _run_engine(conn: socket.socket, listen_path: str, request: dict, fds: list[int], learn: bool) -> None:
    """In the child: become the engine process the client asked for, then exit."""
    code = 1
    try:
        os.setsid()
        for target, fd in zip((0, 1, 2), fds[:3], strict=False):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        # the zygote's own TMPDIR may be another command's (a shared zygote): ask again
        tempfile.tempdir = None
        os.chdir(request["cwd"])
        overlay_paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[0:0] = [p for p in overlay_paths if p not in sys.path]
        importlib.invalidate_caches()
        argv = list(request["argv"])
        sys.argv = ["kvrepro.engine", *argv]

        def watch_client() -> None:
            # The client holds the other end; if it goes away, so does this engine.
            try:
                while conn.recv(1024):
                    pass
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGTERM)
            from kvrepro import lifetime  # kvrepro#8: nobody waits on us any more: bound the stop

            lifetime.kill_group_later(os.getpid(), grace=3.0)

        threading.Thread(target=watch_client, name="zygote-client-watch", daemon=True).start()

        def report_modules() -> None:
            if not learn:
                return
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(listen_path)
                    _send(s, {"learn": _foreign_modules(overlay_paths)})
            except OSError:
                pass

        module = request.get("module")
        if module:  # `python -m MODULE ARGV` (the minimizer's kvrepro.engine.offline), run as its own __main__
            import runpy

            os.environ.pop(ENV_VAR, None)  # its __main__ must not hand itself to a zygote again
            sys.argv = [module, *argv]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        else:
            from kvrepro.engine.vllm_cli import run

            code = run(argv, on_settled=report_modules)
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
    if not path:
        return
    merged = sorted(set(read_learned(path)) | {n for n in names if n.split(".")[0] not in _OWN_ROOTS})
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write("# modules a kvrepro engine zygote preloads (learned from its engines)\n")
            fh.writelines(name + "\n" for name in merged)
        os.replace(tmp, path)
    except OSError:  # a read-only cache only costs the next zygote the lesson
        try:
            os.unlink(tmp)
        except OSError:
            pass


def serve(socket_path: str, learned_path: str | None = None) -> int:
    """Preload, listen on ``socket_path``, fork engines until SIGTERM/SIGINT."""
    started = time.monotonic()
    count = preload(DEFAULT_PRELOAD)
    known = read_learned(learned_path)
    if known:
        count += preload(known)
    print(f"kvrepro zygote: preloaded {count} modules in {time.monotonic() - started:.1f} s; "
          f"listening on {socket_path}", file=sys.stderr, flush=True)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    zygote_pid = os.getpid()
    stopping = {"flag": False}
    learned = {"done": False}  # the first engine still reports: a build may import more than the last lesson

    def on_signal(signum, frame):
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while not stopping["flag"]:
            while children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    try:
                        _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                    except OSError:
                        pass
                    conn.close()
            try:
                ready, _, _ = select.select([listener], [], [], 0.1)
            except InterruptedError:
                continue
            if not ready:
                continue
            conn, _ = listener.accept()
            try:
                request, fds = _recv_line(conn, with_fds=True)
            except (OSError, ValueError):
                conn.close()
                continue
            if request is None:
                conn.close()
                continue
            if "learn" in request:
                conn.close()
                learned["done"] = True
                count = preload(request["learn"])
                write_learned(learned_path, request["learn"])
                print(f"kvrepro zygote: learned {count} more modules to preload", file=sys.stderr, flush=True)
                continue
            learn = not learned["done"] and not request.get("module")  # what `vllm serve` imports
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                from kvrepro import lifetime  # kvrepro#8: the engine dies with the zygote

                lifetime.die_with_parent(signal.SIGTERM, expected_parent=zygote_pid)
                listener.close()
                for other in children.values():
                    other.close()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                _run_engine(conn, socket_path, request, fds, learn)
            # one line per engine: a shared zygote's log shows which commands it served (tests/test_shared_zygote.py)
            print(f"kvrepro zygote: forked engine {pid}", file=sys.stderr, flush=True)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            try:
                _send(conn, {"pid": pid})
            except OSError:
                pass
    finally:
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while children and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                children.pop(pid, None)
            else:
                time.sleep(0.05)
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)  # the engine and what it started (it called setsid)
            except ProcessLookupError:
                pass
        listener.close()
        if os.path.exists(socket_path):
            os.unlink(socket_path)
    return 0


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
