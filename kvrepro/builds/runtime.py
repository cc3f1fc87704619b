"""The shared runtime env: one venv with vLLM's dependencies that every overlay runs in.

vLLM itself is NOT installed here: each build's patched ``vllm/`` overlay is put in front of
``sys.path``, so four builds share one 1 GB environment. The env is keyed by its inputs (the
Python version, the torch pin and the requirement list), so a vLLM version with other
requirements gets its own env and an unchanged one is reused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .. import paths
from ..errors import SetupError

# The CPU build of torch that this machine (and CI's) holds on disk; a plain `torch` from
# the index would be a multi-GB CUDA build. vLLM's scheduler runs fine on it.
TORCH_PIN = os.environ.get("KVREPRO_TORCH", "torch==2.13.0")
_COMPLETE = ".kvrepro-complete"


def runtime_key(requirements: list[str]) -> str:
    material = "\n".join([sys.version.split()[0], TORCH_PIN, *sorted(requirements)])
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def runtime_dir(requirements: list[str]) -> Path:
    return paths.runtimes_dir() / runtime_key(requirements)


def runtime_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def is_ready(requirements: list[str]) -> bool:
    return (runtime_dir(requirements) / _COMPLETE).exists()


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


def ensure_runtime(requirements: list[str], on_line: Callable[[str], None] | None = None) -> Path:
    """Create (once) the venv holding ``requirements`` + torch; return its python.

    Idempotent: a finished env carries a marker file; an unfinished one (Ctrl-C, a failed
    download) is removed and built again.
    """
    env_dir = runtime_dir(requirements)
    python = runtime_python(env_dir)
    if (env_dir / _COMPLETE).exists() and python.exists():
        return python
    if env_dir.exists():
        shutil.rmtree(env_dir)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    log = env_dir.parent / f"{env_dir.name}.setup.log"
    log.write_text("")
    if on_line:
        on_line(f"creating the runtime env {env_dir}")
    _run([sys.executable, "-m", "venv", str(env_dir)], log, on_line, "creating the runtime venv")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
    _run(pip + [TORCH_PIN], log, on_line, f"installing {TORCH_PIN}")
    constraints = env_dir / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    reqs_file = env_dir / "requirements.txt"
    reqs_file.write_text("\n".join(requirements) + "\n")
    _run(pip + ["-r", str(reqs_file), "-c", str(constraints)], log, on_line, "installing vLLM's dependencies")
    (env_dir / _COMPLETE).write_text(TORCH_PIN + "\n")
    return python
