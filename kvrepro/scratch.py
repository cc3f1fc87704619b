"""One temporary folder per kvrepro process, removed on every exit path.

Everything kvrepro and the engines it starts put in the system temp folder lives under one
folder, ``$TMPDIR/kvrepro-<pid>-<hex>/`` (:func:`folder`, made on first use):

* the engine zygote's socket and log (``zygote-*/``);
* every engine's own temporary files: vLLM's ZMQ IPC sockets (``ipc://`` paths come from
  ``VLLM_RPC_BASE_PATH``, default ``tempfile.gettempdir()``, vllm/utils/network_utils.py), the
  API server's Prometheus multiprocess folder and anything else that asks ``tempfile``: engines
  get ``TMPDIR`` and ``VLLM_RPC_BASE_PATH`` pointing at ``engine-tmp/`` (:func:`engine_env`).

Removal, whatever ends kvrepro:

* a normal exit, an error, Ctrl-C, SIGTERM, SIGHUP: ``kvrepro.cli.main`` calls :func:`remove`
  after every engine has been stopped (and an ``atexit`` hook does it for library use);
* SIGKILL: a *janitor*, a tiny python process started with the folder, holds the read end of a
  pipe whose write end only kvrepro holds; when kvrepro dies the kernel closes it, the janitor
  reads EOF, waits for the engines to go (they get their parent-death signal at the same moment)
  and removes the folder. It is in its own session and ignores Ctrl-C, SIGTERM and SIGHUP, so a
  signal to kvrepro's process group does not take it first.
* whatever is left anyway (the machine lost power, a kvrepro older than this one): ``kvrepro
  clean`` removes the folders of owners that are gone (:func:`clean`), never a live run's.

The engines' ``/dev/shm/vllm_offload_<engine id>.mmap`` regions (vLLM's CPU offload tier, RAM that
outlives a crashed engine) are claimed in ``shm-regions/`` and removed on the same paths, and after
each engine stop (kvrepro/engine/shm_region.py).

``owner.json`` in the folder names its owner (pid, host, start time: kvrepro/lifetime.py).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from dataclasses import dataclass

from . import lifetime, untrusted

PREFIX = "kvrepro-"
OWNER_FILE = "owner.json"
# folders made by kvrepros before this module: one zygote each, no owner record
LEGACY_ZYGOTE = re.compile(r"^kvrepro-zygote-")
OURS = re.compile(r"^kvrepro-\d+-[0-9a-f]{6}$")
# vLLM's IPC socket files (``ipc://<tmp>/<uuid4>``) left by engines before kvrepro moved them
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")

_lock = threading.Lock()
_folder: Path | None = None
_janitor: subprocess.Popen | None = None
_pipe_w: int | None = None

SHM_CLAIMS = "shm-regions"  # the engines' claims of their /dev/shm regions (kvrepro/engine/shm_region.py)

# The janitor: waits for EOF on stdin (its owner died, or let go), then removes the folder,
# again while engines that were still stopping may drop files in it, until it stays gone.
_JANITOR = r"""
import os, shutil, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
folder = sys.argv[1]
try:
    while os.read(0, 4096):
        pass
except OSError:
    pass
if not os.path.exists(folder):  # kvrepro removed it itself (every exit but SIGKILL)
    sys.exit(0)
def regions():  # the engines' claimed /dev/shm regions (kvrepro/engine/shm_region.py), names checked
    import re, stat
    claims = os.path.join(folder, sys.argv[2])
    try:
        names = os.listdir(claims)
    except OSError:
        return
    for name in names:
        if re.fullmatch(sys.argv[3], name):
            path = os.path.join("/dev/shm", name)
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    regions()
    shutil.rmtree(folder, ignore_errors=True)
    if not os.path.exists(folder):
        time.sleep(1.0)
        if not os.path.exists(folder):
            break
    else:
        time.sleep(0.2)
"""


def system_temp() -> Path:
    return Path(tempfile.gettempdir())


def folder() -> Path:
    """This process's temp folder (made, with its owner record and janitor, on first use)."""
    global _folder, _janitor, _pipe_w
    with _lock:
        if _folder is not None and _folder.is_dir():
            return _folder
        if _pipe_w is not None:  # the folder was removed under us: let its janitor go, start anew
            os.close(_pipe_w)
            _pipe_w = None
        path = system_temp() / f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        path.mkdir(mode=0o700)
        (path / OWNER_FILE).write_text(json.dumps(lifetime.owner()) + "\n")
        read_end, write_end = os.pipe()  # both non-inheritable: only the janitor gets the read end
        try:
            _janitor = subprocess.Popen([sys.executable, "-I", "-S", "-c", _JANITOR, str(path),
                                         SHM_CLAIMS, SHM_REGION.pattern.strip("^$")], stdin=read_end,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True, close_fds=True)
            _pipe_w = write_end
        except OSError:  # no janitor: the normal exit paths and `kvrepro clean` still remove it
            os.close(write_end)
        finally:
            os.close(read_end)
        _folder = path
        return path


def engine_tmp() -> Path:
    """The folder engines use as their TMPDIR (vLLM's IPC sockets, Prometheus files)."""
    path = folder() / "engine-tmp"
    path.mkdir(exist_ok=True)
    return path


def engine_env() -> dict[str, str]:
    """Environment for an engine process: every temporary file of vLLM's under our folder, and
    where it claims its /dev/shm offload region (kvrepro/engine/shm_region.py)."""
    tmp = str(engine_tmp())
    return {"TMPDIR": tmp, "VLLM_RPC_BASE_PATH": tmp, SHM_ENV: str(shm_claims())}


def shm_claims() -> Path:
    """The folder where this process's engines claim their /dev/shm regions."""
    path = folder() / SHM_CLAIMS
    path.mkdir(exist_ok=True)
    return path


def release_regions() -> list[str]:
    """Unlink the /dev/shm regions of this process's engines that have ended (kvrepro/engine/shm_region.py);
    called where every engine stop passes."""
    path = _folder
    return release_claimed(path / SHM_CLAIMS) if path is not None else []


def current() -> Path | None:
    return _folder


def remove() -> None:
    """Remove this process's folder (call once its engines are stopped); let the janitor go."""
    global _folder, _janitor, _pipe_w
    with _lock:
        path, _folder = _folder, None
        if path is not None:
            release_claimed(path / SHM_CLAIMS, everything=True)  # its engines are stopped
            shutil.rmtree(path, ignore_errors=True)
        if _pipe_w is not None:
            try:
                os.close(_pipe_w)  # EOF: the janitor finds nothing (or what an engine dropped late) and ends
            except OSError:
                pass
            _pipe_w = None
        if _janitor is not None:
            try:
                _janitor.wait(timeout=0.5 if path is None or not path.exists() else 2)
            except subprocess.TimeoutExpired:
                pass  # it goes on removing in the background: its own session, no terminal
            _janitor = None


atexit.register(remove)


# -- the engines' /dev/shm regions (kvrepro/engine/shm_region.py says why and who claims) ---------

SHM = Path("/dev/shm")
SHM_ENV = "KVREPRO_SHM_CLAIMS"  # where an engine claims its region (set by engine_env)
SHM_REGION = re.compile(r"^vllm_offload_[A-Za-z0-9_-]{1,200}\.mmap$")  # the only names ever unlinked


def _claim_owner(claim_path: Path) -> dict | None:
    try:
        fd = os.open(claim_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = json.loads(os.read(fd, OWNER_LIMIT).decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else None


def unlink_region(name: str, shm: Path = SHM) -> bool:
    """Unlink ``shm/name`` if ``name`` is a region name and that is a regular file (not a link)."""
    if not SHM_REGION.match(name):
        return False
    path = shm / name
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        os.unlink(path)
    except OSError:
        return False
    return True


def release_claimed(folder: str | os.PathLike | None, everything: bool = False, only_pid: int | None = None,
                    shm: Path = SHM) -> list[str]:
    """Unlink the regions claimed in ``folder`` whose owner is gone (``everything``: every claimed
    one; ``only_pid``: those claimed by that live process, whose engine is over) and drop their
    claims. Returns the region names unlinked."""
    if folder is None:
        return []
    removed = []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return []
    for entry in entries:
        if not SHM_REGION.match(entry.name):
            continue
        owner = _claim_owner(Path(entry.path))
        if not everything:
            if only_pid is not None:
                if owner is None or str(owner.get("pid")) != str(only_pid):
                    continue
            elif lifetime.owner_alive(owner) is not False:
                continue  # alive, or not ours to judge (another host's, no record)
        if unlink_region(entry.name, shm):
            removed.append(entry.name)
        try:
            os.unlink(entry.path)
        except OSError:
            pass
    return removed


# -- kvrepro clean ------------------------------------------------------------------------------

def _listening_unix_paths() -> set[str]:
    """Paths of unix sockets some process has bound (/proc/net/unix): a live engine's or zygote's."""
    paths: set[str] = set()
    try:
        with open("/proc/net/unix") as fh:
            next(fh, None)
            for line in fh:
                parts = line.split(None, 7)
                if len(parts) == 8:
                    paths.add(parts[7].strip())
    except OSError:
        pass
    return paths


OWNER_LIMIT = 4096  # an owner record is ~60 bytes


class _BadOwner(Exception):
    """An owner record that is there but is not one (a FIFO, a link, a list for a pid): the folder
    is kept and the line says why; the temp folder is world-writable, so it may be anyone's."""


def _owner_of(path: Path) -> dict[str, str] | None:
    """The folder's owner record; None if it has none; _BadOwner if it is not one. Read through
    kvrepro/untrusted.py: never blocks on a FIFO, never follows a link, never reads more than 4 KiB."""
    try:
        data = json.loads(untrusted.read_text(path / OWNER_FILE, OWNER_LIMIT))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _BadOwner(f"{OWNER_FILE}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise _BadOwner(f"{OWNER_FILE}: not an owner record ({str(exc)[:80]})") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("pid", "host", "start")):
        raise _BadOwner(f"{OWNER_FILE}: not an owner record (pid, host and start as strings)")
    return data


def _bound_under(path: Path, bound: set[str]) -> bool:
    prefix = str(path) + os.sep
    return any(p.startswith(prefix) for p in bound)


@dataclass(frozen=True)
class TempItem:
    """One thing in the temp folder that kvrepro (or the vLLM it ran) left: its path, what it is
    (``run temp folder``, ``zygote folder (older kvrepro)``, ``vLLM IPC socket``) and, for a run's
    folder, the owner record of the kvrepro that made it (kvrepro/lifetime.py)."""

    path: str
    kind: str
    owner: dict[str, str] | None = None
    note: str | None = None  # why it is kept when it is not a live run's (an owner record that is not one)


@dataclass(frozen=True)
class TempClean:
    """What :func:`clean` did in ``temp`` (`kvrepro clean`'s temp-folder part)."""

    temp: str
    removed: tuple[TempItem, ...] = ()
    kept: tuple[TempItem, ...] = ()
    errors: tuple[str, ...] = ()


def leftovers(temp: Path | None = None) -> tuple[list[TempItem], list[TempItem]]:
    """What `kvrepro clean` would remove from the temp folder, and what it keeps (live owners).

    Removed: our folders whose owner is gone (no live process holds a socket in them either);
    ``kvrepro-zygote-*`` folders of older kvrepros whose socket nobody listens on; vLLM IPC
    socket files (uuid4 names) that no process has bound.
    """
    temp = temp or system_temp()
    bound = _listening_unix_paths()
    to_remove: list[TempItem] = []
    to_keep: list[TempItem] = []
    try:
        entries = sorted(temp.iterdir())
    except OSError:
        return to_remove, to_keep
    for entry in entries:
        name = entry.name
        try:
            if OURS.match(name) and entry.is_dir() and not entry.is_symlink():
                try:
                    owner = _owner_of(entry)
                except _BadOwner as exc:
                    to_keep.append(TempItem(path=str(entry), kind="run temp folder", note=f"{exc}; not ours to judge, "
                                            "left alone"))
                    continue
                if owner is not None:
                    gone = lifetime.owner_alive(owner) is False
                else:  # being made this very moment, or its record was lost: idle a while, no socket bound
                    gone = time.time() - entry.stat().st_mtime > 60 and not _bound_under(entry, bound)
                item = TempItem(path=str(entry), kind="run temp folder", owner=owner)
                (to_remove if gone else to_keep).append(item)
            elif LEGACY_ZYGOTE.match(name) and entry.is_dir() and not entry.is_symlink():
                item = TempItem(path=str(entry), kind="zygote folder (older kvrepro)")
                gone = time.time() - entry.stat().st_mtime > 60 and not _bound_under(entry, bound)
                (to_remove if gone else to_keep).append(item)
            elif UUID.match(name) and entry.is_socket():
                item = TempItem(path=str(entry), kind="vLLM IPC socket")
                (to_keep if str(entry) in bound else to_remove).append(item)
        except OSError:
            continue
    return to_remove, to_keep


def clean(dry_run: bool = False, temp: Path | None = None) -> TempClean:
    """Remove what :func:`leftovers` finds."""
    temp = temp or system_temp()
    removed, kept = leftovers(temp)
    errors = []
    mine = str(_folder) if _folder is not None else None
    done = []
    for item in removed:
        if item.path == mine:
            continue
        if not dry_run:
            try:
                path = Path(item.path)
                if path.is_dir():
                    release_claimed(path / SHM_CLAIMS, everything=True)  # its owner is gone
                    shutil.rmtree(path)
                else:
                    path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                errors.append(f"{item.path}: {exc.strerror or exc}")
                continue
        done.append(item)
    return TempClean(temp=str(temp), removed=tuple(done), kept=tuple(kept), errors=tuple(errors))


__all__ = ["SHM_ENV", "SHM_REGION", "TempClean", "TempItem", "clean", "current", "engine_env", "engine_tmp", "folder", "leftovers", "release_claimed", "release_regions", "remove", "shm_claims",
           "system_temp"]
