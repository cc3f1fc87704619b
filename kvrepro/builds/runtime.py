"""The shared runtime env: one venv with vLLM's dependencies that every overlay runs in.

vLLM itself is NOT installed here: each build's patched ``vllm/`` overlay is put in front of
``sys.path``, so all builds of a release share one environment (about 2.8 GB). The env is keyed
by its inputs (the Python version, the torch pin and the requirement list). A release whose
requirement list differs still reuses an existing env when every one of its requirements is
satisfied by what that env has installed (recorded in ``installed.json`` when it was made).

A release whose requirements an existing env does not satisfy (a pin such as
``transformers<5.18`` or a new package) gets a *layer*, not a new env: pip resolves the
release's requirements against what the env already holds (``pip install --dry-run --report``)
and only the packages it would add or replace are installed, without dependencies, into a small
folder that goes in front of the env's ``site-packages`` on ``PYTHONPATH``. A layer is a few
dozen megabytes and seconds of work, where a new env is 2.8 GB and two minutes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from .. import paths
from ..errors import SetupError

# The CPU build of torch that this machine (and CI's) holds on disk; a plain `torch` from
# the index would be a multi-GB CUDA build. vLLM's scheduler runs fine on it.
TORCH_PIN = os.environ.get("KVREPRO_TORCH", "torch==2.13.0")
# Set in an image whose python already holds torch (CPU) and vLLM's dependencies (the CI image,
# kvrepro/data/docker/ci.Dockerfile): the runtime env is made on top of them, with no download.
SYSTEM_SITE_ENV = "KVREPRO_RUNTIME_SYSTEM_SITE"
_COMPLETE = ".kvrepro-complete"
_INSTALLED = "installed.json"  # distribution name -> version, written when the env is complete
_LIST_INSTALLED = (
    "import importlib.metadata as m, json, sys; "
    "json.dump({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}, sys.stdout)"
)


def runtime_key(requirements: list[str]) -> str:
    material = "\n".join([sys.version.split()[0], TORCH_PIN, *sorted(requirements)])
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def runtime_dir(requirements: list[str]) -> Path:
    return paths.runtimes_dir() / runtime_key(requirements)


def runtime_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def _installed(env_dir: Path) -> dict[str, str] | None:
    try:
        raw = json.loads((env_dir / _INSTALLED).read_text())
    except (OSError, ValueError):
        return None
    return {canonicalize_name(name): version for name, version in raw.items()}


def satisfies(installed: dict[str, str], requirements: list[str]) -> bool:
    """True when every requirement (name and version range; extras not followed) is installed."""
    for line in requirements:
        try:
            req = Requirement(line)
            have = installed.get(canonicalize_name(req.name))
            if have is None or not req.specifier.contains(Version(have), prereleases=True):
                return False
        except (InvalidRequirement, InvalidVersion):
            return False
    return True


def find_compatible(requirements: list[str]) -> Path | None:
    """The env made for exactly these requirements, else any complete env that satisfies them."""
    exact = runtime_dir(requirements)
    if (exact / _COMPLETE).exists() and runtime_python(exact).exists():
        return exact
    root = paths.runtimes_dir()
    python_version = sys.version.split()[0]
    for env_dir in sorted(root.iterdir()) if root.is_dir() else ():
        marker = env_dir / _COMPLETE
        if not marker.exists() or not runtime_python(env_dir).exists():
            continue
        if marker.read_text().strip() != TORCH_PIN:
            continue
        if (env_dir / "python-version").exists() and (env_dir / "python-version").read_text().strip() != python_version:
            continue
        installed = _installed(env_dir)
        if installed is not None and satisfies(installed, requirements):
            return env_dir
    return None


def is_ready(requirements: list[str]) -> bool:
    return find_compatible(requirements) is not None


@dataclass(frozen=True)
class Runtime:
    """A python to run vLLM with and the folders (overlay first) its ``PYTHONPATH`` must hold."""

    python: Path
    layers: tuple[Path, ...] = ()

    def pythonpath(self, *front: str | Path) -> str:
        """``PYTHONPATH`` for a process of this runtime: ``front`` (the overlay) then the layers."""
        return os.pathsep.join(str(p) for p in (*front, *self.layers))

    @property
    def key(self) -> str:
        return hashlib.sha256("\n".join(map(str, (self.python, *self.layers))).encode()).hexdigest()[:12]


def _layers_dir() -> Path:
    return paths.runtimes_dir() / "layers"


def _best_base_env() -> Path | None:
    """The complete env (same torch pin and python) that a layer goes on top of: the oldest one."""
    root = paths.runtimes_dir()
    python_version = sys.version.split()[0]
    candidates = []
    for env_dir in root.iterdir() if root.is_dir() else ():
        marker = env_dir / _COMPLETE
        if (marker.exists() and runtime_python(env_dir).exists() and marker.read_text().strip() == TORCH_PIN
                and _installed(env_dir) is not None
                and (not (env_dir / "python-version").exists()
                     or (env_dir / "python-version").read_text().strip() == python_version)):
            candidates.append((marker.stat().st_mtime, env_dir))
    return min(candidates)[1] if candidates else None


@contextlib.contextmanager
def _building(target: Path):
    """Hold an exclusive lock next to ``target`` while it is made: two kvrepro processes sharing
    the cache (a suite's slots, parallel test workers, two terminals) would otherwise remove each
    other's half-made env or share one work folder. The second waits, then finds it made."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_layer(env_dir: Path, requirements: list[str], on_line: Callable[[str], None] | None = None) -> Path:
    """The folder holding what ``requirements`` need beyond ``env_dir`` (made once, then reused)."""
    material = "\n".join([env_dir.name, TORCH_PIN, *sorted(requirements)])
    layer = _layers_dir() / hashlib.sha256(material.encode()).hexdigest()[:16]
    if (layer / _COMPLETE).exists():
        return layer
    with _building(layer):
        return _make_layer(env_dir, requirements, layer, on_line)


def _make_layer(env_dir: Path, requirements: list[str], layer: Path,
                on_line: Callable[[str], None] | None) -> Path:
    if (layer / _COMPLETE).exists():  # made by the process that held the lock before us
        return layer
    if layer.exists():
        shutil.rmtree(layer)
    layer.parent.mkdir(parents=True, exist_ok=True)
    log = layer.parent / f"{layer.name}.setup.log"
    log.write_text("")
    python = runtime_python(env_dir)
    work = layer.parent / f".{layer.name}-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        reqs_file = work / "requirements.txt"
        reqs_file.write_text("\n".join(requirements) + "\n")
        constraints = work / "constraints.txt"
        constraints.write_text(TORCH_PIN + "\n")
        report = work / "report.json"
        if on_line:
            on_line(f"resolving a layer on top of {env_dir.name} for {len(requirements)} requirements")
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
        _run(pip + ["--dry-run", "--quiet", "--report", str(report), "-r", str(reqs_file), "-c", str(constraints)],
             log, on_line, "resolving the release's requirements against the runtime env")
        wanted = sorted(f"{item['metadata']['name']}=={item['metadata']['version']}"
                        for item in json.loads(report.read_text()).get("install", []))
        staged = work / "site"
        staged.mkdir()
        if wanted:
            if on_line:
                on_line(f"layer: {', '.join(wanted)}")
            # --no-compile: pip would compile every module of transformers & co. (2,903 files for 0.33.0's
            # layer: 8.0 against 1.5 CPU s), where an engine imports a few hundred of them, compiled
            # once into the engines' byte-code folder as they are first imported
            _run(pip + ["--no-deps", "--no-compile", "--target", str(staged), *wanted], log, on_line,
                 "installing the layer")
        (staged / "layer.json").write_text(json.dumps({"env": env_dir.name, "packages": wanted}, indent=2) + "\n")
        (staged / _COMPLETE).write_text(TORCH_PIN + "\n")
        os.replace(staged, layer)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return layer


def _run(cmd: list[str], log: Path, on_line: Callable[[str], None] | None, what: str) -> None:
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            fh.write(line)
            tail = (tail + [line.rstrip()])[-8:]
            if on_line and line.strip():
                on_line(line.strip())
        code = proc.wait()
    if code != 0:
        raise SetupError(
            f"{what} failed (exit {code}); full output in {log}. Last lines:\n  " + "\n  ".join(tail)
        )


def ensure_runtime(requirements: list[str], on_line: Callable[[str], None] | None = None) -> Runtime:
    """The runtime for ``requirements``: an env that satisfies them, a layer on one, or a new env,
    with its byte code ready in the engines' byte-code folder (:func:`seed_byte_code`).

    Idempotent: a finished env or layer carries a marker file; an unfinished one (Ctrl-C, a
    failed download) is removed and built again.
    """
    runtime = _ensure_runtime(requirements, on_line)
    seed_byte_code(runtime)
    return runtime


def _ensure_runtime(requirements: list[str], on_line: Callable[[str], None] | None) -> Runtime:
    found = find_compatible(requirements)
    if found is not None:
        return Runtime(runtime_python(found))
    base_env = _best_base_env()
    if base_env is not None:
        return Runtime(runtime_python(base_env), (ensure_layer(base_env, requirements, on_line),))
    env_dir = runtime_dir(requirements)
    with _building(env_dir):
        if (env_dir / _COMPLETE).exists() and runtime_python(env_dir).exists():
            return Runtime(runtime_python(env_dir))  # made by the process that held the lock before us
        return _make_env(env_dir, requirements, on_line)


# the folders whose byte code a runtime's python imports: its standard library and site-packages
_IMPORT_ROOTS = ("import json, sys, sysconfig; p = sysconfig.get_paths(); "
                 "json.dump([sys.implementation.cache_tag, p['stdlib'], p['purelib'], p['platlib']], sys.stdout)")


def seed_byte_code(runtime: Runtime) -> int:
    """Hard-link the byte code pip and Python's installer compiled into each ``__pycache__`` of the
    runtime (its standard library, site-packages and layers) into the engines' byte-code folder
    (:func:`kvrepro.paths.pycache_prefix`), where Python looks for it instead: without this, the
    first engine on a machine compiles every module of torch & co. again (measured: ~11 CPU s more
    for the imports of one engine zygote, 16.8 s against 5.4 s warm). A link shares the file; when
    Python finds one stale it writes a new file in its place, never into the env. Once per runtime
    (a marker in the byte-code folder); a folder it cannot write is left alone, as before.
    Returns the number of files linked."""
    prefix = paths.pycache_prefix()
    marker = prefix / ".seeded" / runtime.key
    if marker.exists():
        return 0
    try:
        proc = subprocess.run([str(runtime.python), "-I", "-c", _IMPORT_ROOTS], capture_output=True, text=True,
                              timeout=120)
        tag, *roots = json.loads(proc.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return 0
    suffix = f".{tag}.pyc"
    linked = 0
    try:
        for root in dict.fromkeys([*roots, *map(str, runtime.layers)]):  # purelib is platlib on most systems
            for folder, _, files in os.walk(root):
                if os.path.basename(folder) != "__pycache__":
                    continue
                dest = prefix / os.path.dirname(os.path.abspath(folder)).lstrip(os.sep)
                names = [n for n in files if n.endswith(suffix)]  # no .opt-1 / .opt-2: engines run without -O
                if names:
                    dest.mkdir(parents=True, exist_ok=True)
                for name in names:
                    try:
                        os.link(os.path.join(folder, name), dest / name)
                        linked += 1
                    except FileExistsError:  # compiled there already, or linked by another process
                        pass
                    except OSError as exc:
                        if exc.errno != errno.EXDEV:
                            raise
                        shutil.copy2(os.path.join(folder, name), dest / name)  # another filesystem
                        linked += 1
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{linked}\n")
    except OSError:  # a read-only or full cache: engines compile as they go
        pass
    return linked


def _make_env(env_dir: Path, requirements: list[str], on_line: Callable[[str], None] | None) -> Runtime:
    python = runtime_python(env_dir)
    if env_dir.exists():
        shutil.rmtree(env_dir)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    log = env_dir.parent / f"{env_dir.name}.setup.log"
    log.write_text("")
    if on_line:
        on_line(f"creating the runtime env {env_dir}")
    # the system's own pip serves the venv too: Debian's python3 has no ensurepip without python3-venv
    system_site = ["--system-site-packages", "--without-pip"] if os.environ.get(SYSTEM_SITE_ENV) == "1" else []
    _run([sys.executable, "-m", "venv", *system_site, str(env_dir)], log, on_line, "creating the runtime venv")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
    _run(pip + [TORCH_PIN], log, on_line, f"installing {TORCH_PIN}")
    constraints = env_dir / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    reqs_file = env_dir / "requirements.txt"
    reqs_file.write_text("\n".join(requirements) + "\n")
    _run(pip + ["-r", str(reqs_file), "-c", str(constraints)], log, on_line, "installing vLLM's dependencies")
    listing = subprocess.run([str(python), "-I", "-c", _LIST_INSTALLED], capture_output=True, text=True)
    if listing.returncode == 0:
        (env_dir / _INSTALLED).write_text(listing.stdout)
    (env_dir / "python-version").write_text(sys.version.split()[0] + "\n")
    (env_dir / _COMPLETE).write_text(TORCH_PIN + "\n")
    return Runtime(python)
