"""Nothing kvrepro starts outlives it: parent-death signals and owner records.

Two mechanisms, because kvrepro can die in two ways:

* it is stopped (Ctrl-C, SIGTERM from a CI runner): it stops its engines itself, in order;
* it is killed (SIGKILL, OOM killer): it can do nothing. Local engine processes then learn it
  from the kernel: :func:`die_with_parent` (``prctl(PR_SET_PDEATHSIG)``) in the child makes the
  kernel send a signal the moment the parent goes. Containers live in a daemon that never hears
  of it, so they carry an *owner record* (:func:`owner`: pid, host, process start time) in their
  labels, and the next kvrepro that looks (`matrix run`, `kvrepro clean`) removes those whose
  owner is gone (:func:`owner_alive`), leaving the containers of live runs alone. Run folders
  carry the same record, so `results show` can tell a run still going from one whose process
  vanished.

Caveat of PR_SET_PDEATHSIG: the "parent" is the *thread* that forked the child. Start engines
from a thread that lives as long as they should (the runner's slot threads and the main thread
do), never from a short-lived helper thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1

try:  # resolved here, in the parent: the child between fork and exec must not load libraries
    _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the owner records still work
    _prctl = None


def die_with_parent(sig: int = signal.SIGTERM, expected_parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies.

    Call it in the child: as ``preexec_fn`` of ``subprocess.Popen`` (see :func:`child_hook`),
    or right after ``os.fork()``. If the parent already died before the call (the race the
    kernel cannot close for us), the signal is sent now.
    """
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)


def child_hook(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for Popen: the child gets ``sig`` when the process that started it dies."""
    parent = os.getpid()

    def hook() -> None:
        die_with_parent(sig, expected_parent=parent)

    return hook


def kill_group_later(pgid: int, grace: float = 5.0) -> None:
    """SIGKILL process group ``pgid`` after ``grace`` seconds unless it is gone by then.

    For a process whose owner died: it has asked its engine to stop (SIGTERM) and nobody will
    escalate if the engine (or a helper process it started) takes its time.
    """
    import threading
    import time

    def escalate() -> None:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    threading.Thread(target=escalate, name="kvrepro-kill-group", daemon=True).start()


# -- owner records ------------------------------------------------------------------------------

def hostname() -> str:
    return socket.gethostname()


def process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (/proc), or None if it does not exist.

    pid + start time names one process for the life of the machine: a pid reused by another
    process after kvrepro died has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its closing one
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped by its parent: gone all the same
        return None
    return fields[19].decode()  # field 22 of proc(5)


def owner(pid: int | None = None) -> dict[str, str]:
    """This process as an owner record: {"pid", "host", "start"} (all strings, fit for labels)."""
    pid = os.getpid() if pid is None else pid
    return {"pid": str(pid), "host": hostname(), "start": process_start(pid) or ""}


def owner_alive(record: dict[str, str] | None) -> bool | None:
    """True if the owner still runs, False if it is gone, None if this machine cannot tell
    (another host's process, or no record): such things are left alone."""
    if not record or not record.get("pid"):
        return None
    if record.get("host") != hostname():
        return None
    try:
        pid = int(record["pid"])
    except ValueError:
        return None
    start = process_start(pid)
    if start is None:
        return False
    return not record.get("start") or start == record["start"]


__all__ = ["child_hook", "die_with_parent", "hostname", "kill_group_later", "owner", "owner_alive", "process_start"]
