"""ssh:// Docker hosts: kvrepro's one kept ssh connection against docker-py's ssh transports.

Side by side, against one daemon: N pings, and one engine start (build A, CPU base image, until
/health answers) with the ssh connections sshd accepted and the most ssh client processes seen
at once while it started. Columns:

  local socket        unix:///var/run/docker.sock (no ssh at all: the floor)
  kvrepro (kept)      hosts.connect(): one `ssh -N` master, daemon socket + API forwarded over it
  docker-py ssh       docker-py's ssh transport shelling out to `ssh ... docker system dial-stdio`
                      per HTTP connection (use_ssh_client=True, what kvrepro did before)
  docker-py paramiko  docker-py's paramiko transport (one paramiko session per connection)

The "remote" host is this machine's dockerd behind a throwaway sshd on 127.0.0.1 (tests/sshd.py),
so the numbers measure the ssh plumbing, not a network. The docker-py columns need paramiko
installed (`pip install paramiko`; kvrepro itself does not need it) and are left out without it.

    python benchmarks/ssh_connection.py                    # pings + engine starts
    python benchmarks/ssh_connection.py --pings 50 --no-engine

Needs sshd (apt-get install openssh-server), a Docker daemon and the CPU base image.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    from kvrepro.errors import KvreproError

    try:
        return _main()
    except KvreproError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3


def _ssh_clients(port: int) -> int:
    """ssh client processes running now towards ``port`` (the master, mux commands, dial-stdio sessions)."""
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"ssh" and str(port).encode() in argv:
            count += 1
    return count


class PeakSampler:
    def __init__(self, port: int):
        self.port = port
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, _ssh_clients(self.port))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _docker_py_env(sshd, folder: Path, shell_out: bool) -> dict[str, str]:
    """Environment under which docker-py's ssh transports use the throwaway key and known_hosts
    (they read ~/.ssh, which this script must not touch: a temporary HOME / ssh wrapper)."""
    env = dict(os.environ)
    if shell_out:
        wrapper = folder / "bin" / "ssh"
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {sshd.config()} -o BatchMode=yes \"$@\"\n")
        wrapper.chmod(0o755)
        env["PATH"] = f"{wrapper.parent}:{env['PATH']}"
    else:
        home = folder / "home"
        (home / ".ssh").mkdir(parents=True, exist_ok=True)
        (home / ".ssh" / "known_hosts").write_text((sshd.folder / "known_hosts").read_text())
        (home / ".ssh" / "config").write_text(f"Host *\n  IdentityFile {sshd.folder / 'client_key'}\n")
        env["HOME"] = str(home)
    return env


def _with_env(env: dict[str, str]):
    class Swap:
        def __enter__(self):
            self.old = dict(os.environ)
            os.environ.clear()
            os.environ.update(env)

        def __exit__(self, *exc):
            os.environ.clear()
            os.environ.update(self.old)
    return Swap()


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pings", type=int, default=10)
    parser.add_argument("--no-engine", action="store_true", help="pings only")
    parser.add_argument("--base-image", default=None)
    args = parser.parse_args()

    import docker
    import yaml

    from kvrepro.deploy.docker import DockerTarget
    from kvrepro.deploy.docker.basecpu import default_tag
    from kvrepro.deploy.docker.hosts import DockerHost, connect, local_host_spec
    from kvrepro.deploy.docker.settings import HostSpec
    from kvrepro.matrix import load_matrix
    from sshd import ThrowawaySshd

    try:
        import paramiko  # noqa: F401
        docker_py_modes = ["docker-py ssh", "docker-py paramiko"]
    except ImportError:
        print("paramiko is not installed: the docker-py columns are left out (pip install paramiko)")
        docker_py_modes = []

    work = Path(tempfile.mkdtemp(prefix="kvrepro-bench-ssh-"))
    sshd = ThrowawaySshd(work / "sshd").start()
    remote = HostSpec(name="peer", docker=sshd.url, ssh_config=sshd.config(), local=False,
                      api_address=None)

    def open_host(mode: str) -> tuple[DockerHost, dict[str, str] | None]:
        if mode == "local socket":
            return connect(local_host_spec()), None
        if mode == "kvrepro (kept)":
            return connect(remote), None
        env = _docker_py_env(sshd, work / mode.replace(" ", "-"), shell_out=mode == "docker-py ssh")
        with _with_env(env):
            client = docker.DockerClient(base_url=sshd.url, use_ssh_client=mode == "docker-py ssh",
                                         version="auto", timeout=60)
            client.ping()
            info = client.info()
        # published on this machine's loopback and called there, as the old code did on 0.0.0.0
        spec = HostSpec(name="peer", docker=sshd.url, local=False, api_address="127.0.0.1")
        return DockerHost(spec=spec, client=client, info=info, local=False), env

    def accepted() -> int:
        return sshd.log.read_text(errors="replace").count("Accepted publickey")

    rows = []
    try:
        for mode in ["local socket", "kvrepro (kept)", *docker_py_modes]:
            before = accepted()
            t0 = time.monotonic()
            host, env = open_host(mode)
            connect_s = time.monotonic() - t0
            swap = _with_env(env) if env else None
            if swap:
                swap.__enter__()
            try:
                t0 = time.monotonic()
                for _ in range(args.pings):
                    host.client.ping()
                pings_s = time.monotonic() - t0
                row = {"mode": mode, "connect_s": connect_s, "pings_s": pings_s}
                if not args.no_engine:
                    row.update(_engine_start(host, work / mode.replace(" ", "-"), args.base_image, sshd.port,
                                             DockerTarget, load_matrix, default_tag, yaml))
            finally:
                if swap:
                    swap.__exit__()
                host.close()
            row["ssh_logins"] = accepted() - before
            rows.append(row)
            print(_format(row, args.pings), flush=True)
    finally:
        sshd.stop()
    print()
    print(f"{'mode':<20} {'connect s':>9} {f'{args.pings} pings s':>12} {'engine start s':>15} "
          f"{'ssh logins':>10} {'peak ssh procs':>15}")
    for row in rows:
        print(f"{row['mode']:<20} {row['connect_s']:>9.2f} {row['pings_s']:>12.2f} "
              f"{row.get('engine_start_s', float('nan')):>15.1f} {row['ssh_logins']:>10} "
              f"{row.get('peak_ssh', 0):>15}")
    kept = next(r for r in rows if r["mode"] == "kvrepro (kept)")
    for row in rows:
        if row["mode"].startswith("docker-py"):
            print(f"{row['mode']} / kept: pings x{row['pings_s'] / kept['pings_s']:.1f}"
                  + (f", engine start x{row['engine_start_s'] / kept['engine_start_s']:.2f}"
                     if "engine_start_s" in row else ""))
    return 0


def _format(row: dict, pings: int) -> str:
    text = f"{row['mode']}: connect {row['connect_s']:.2f}s, {pings} pings {row['pings_s']:.2f}s"
    if "engine_start_s" in row:
        text += f", engine start {row['engine_start_s']:.1f}s (peak {row['peak_ssh']} ssh processes)"
    return text


def _engine_start(host, folder: Path, base_image, port: int, DockerTarget, load_matrix, default_tag, yaml) -> dict:
    """Prepare build A (reused image) and start one engine on ``host`` until /health answers."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    version = data.get("base", "0.26.0")
    data.update(target="docker", base_image=base_image or default_tag(version),
                hosts=[host.spec.model_dump(exclude_none=True)])
    data.setdefault("docker", {})["health_timeout_s"] = 600
    if not (folder / "builds").exists():
        shutil.copytree(ROOT / "builds", folder / "builds")
    (folder / "matrix.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    loaded = load_matrix(folder / "matrix.yaml")
    target = DockerTarget(loaded)
    target._hosts[host.name] = host  # this host, connected the way being measured
    try:
        [plan] = loaded.plans(["A"])
        artifact = target.prepare(plan)
        if not artifact.ok:
            raise SystemExit(f"prepare failed: {artifact.error}")
        with PeakSampler(port) as sampler:
            t0 = time.monotonic()
            handle = target.start(artifact, folder / "run", 0)
            seconds = time.monotonic() - t0
        handle.stop()
    finally:
        target._hosts.pop(host.name, None)  # closed by the caller
        target.close()
    return {"engine_start_s": seconds, "peak_ssh": sampler.peak}


if __name__ == "__main__":
    sys.exit(main())
