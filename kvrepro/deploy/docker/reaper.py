"""A watcher that removes a kvrepro session's containers when that kvrepro dies, even by SIGKILL.

Containers live in the Docker daemon, which never learns that the kvrepro that started them was
killed. The docker target therefore starts this small process next to itself (``Reaper``): it
holds the read end of a pipe whose only write end is in kvrepro. The kernel closes that end
whichever way kvrepro ends; the watcher reads EOF and removes every container labelled with the
session. A kvrepro that closes its target normally writes ``done`` first, and the watcher exits
without touching anything. Containers it cannot reach (a daemon down) carry owner labels, so the
next kvrepro removes them (``clean.reap_orphans``).

Use: ``python -m kvrepro.deploy.docker.reaper SESSION`` with a JSON list of host specs on the
first line of stdin.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from ...secrets import scrubbed_environ


class Reaper:
    """The kvrepro side: start the watcher; ``done()`` when the session closed cleanly."""

    def __init__(self, session: str, hosts: list[dict]):
        import os

        env = scrubbed_environ()
        env["PYTHONPATH"] = os.pathsep.join(p for p in [_source_root(), env.get("PYTHONPATH", "")] if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvrepro.deploy.docker.reaper", session],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # the terminal's Ctrl-C is for kvrepro, not for the watcher
            env=env, close_fds=True,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(hosts) + "\n").encode())
        self._proc.stdin.flush()

    def done(self) -> None:
        """The session's containers are gone: let the watcher exit without reaping."""
        try:
            if self._proc.stdin is not None and not self._proc.stdin.closed:
                self._proc.stdin.write(b"done\n")
                self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()


def _source_root() -> str:
    from ... import paths

    return str(paths.SOURCE_ROOT)


def _reap(session: str, hosts: list[dict]) -> None:
    from .settings import HostSpec
    from . import labels as L
    from . import shm
    from .hosts import connect

    for raw in hosts:
        try:
            host = connect(HostSpec.model_validate(raw), timeout=20)
        except Exception:  # noqa: BLE001 - unreachable: the owner labels let the next kvrepro do it
            continue
        try:
            for container in host.client.containers.list(
                    all=True, filters={"label": f"{L.LABEL_SESSION}={session}"}, ignore_removed=True):
                shm.remove_and_release(host, container)  # and the /dev/shm regions its engines claimed
        except Exception:  # noqa: BLE001
            pass
        finally:
            host.close()


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    session = argv[0]
    hosts = json.loads(sys.stdin.readline() or "[]")
    rest = sys.stdin.read()  # blocks until kvrepro writes "done" or dies
    if rest.strip() != "done":
        _reap(session, hosts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
