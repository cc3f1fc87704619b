"""A throwaway OpenSSH server on 127.0.0.1 for the ssh:// tests and benchmark.

It stands in for a remote Docker host: behind it is this machine's own dockerd, reached over a
real sshd with a real key exchange and real forwarding. Everything lives in one temp folder (host
key, client key, authorized_keys, known_hosts, a client ssh config): nothing in ~/.ssh or
/etc/ssh is read or changed. The server logs in as the current user (root here) with the
throwaway key only.
"""

from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD_PATHS = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")


def find_sshd() -> str | None:
    for path in SSHD_PATHS:
        if Path(path).is_file():
            return path
    return shutil.which("sshd")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kvrepro-test", "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL, capture_output=True)


class ThrowawaySshd:
    """sshd -D on 127.0.0.1:<free port> with its own config, host key and authorized key.

    ``client_config`` is an ssh_config for kvrepro's hosts[].ssh_config: the throwaway key and a
    known_hosts holding the server's key. ``trusting_config`` is the same with an empty
    known_hosts (an unknown host key), ``stranger_config`` offers a key the server never saw.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        self.user = getpass.getuser()
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ThrowawaySshd":
        sshd = find_sshd()
        if sshd is None:
            raise RuntimeError("sshd is not installed (apt-get install -y openssh-server)")
        d = self.folder
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        _keygen(d / "host_key")
        _keygen(d / "client_key")
        _keygen(d / "stranger_key")
        (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
        (d / "authorized_keys").chmod(0o600)
        host_pub = (d / "host_key.pub").read_text().split()
        (d / "known_hosts").write_text(f"[127.0.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
        (d / "empty_known_hosts").write_text("")
        (d / "sshd_config").write_text(
            f"ListenAddress 127.0.0.1:{self.port}\n"
            f"HostKey {d / 'host_key'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\n"
            f"PidFile {d / 'sshd.pid'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
            "PermitRootLogin prohibit-password\nUsePAM no\nAllowTcpForwarding yes\n"
            "AllowStreamLocalForwarding yes\nMaxSessions 64\nLogLevel VERBOSE\n"
            # the temp folder may sit under a /tmp sshd finds too open; the key files are 0600
            "StrictModes no\n"
        )
        for name, key, known in (("client_config", "client_key", "known_hosts"),
                                 ("trusting_config", "client_key", "empty_known_hosts"),
                                 ("stranger_config", "stranger_key", "known_hosts")):
            (d / name).write_text(
                f"Host *\n  IdentityFile {d / key}\n  IdentitiesOnly yes\n  UserKnownHostsFile {d / known}\n"
                "  GlobalKnownHostsFile /dev/null\n"
            )
        # sshd wants its privilege-separation folder; the package creates it only when the
        # service starts, which never happens here.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        self.log = d / "sshd.log"
        self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(d / "sshd_config")],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self.log.open("wb"))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"sshd did not listen on 127.0.0.1:{self.port}: {self.log.read_text()[-2000:]}")

    @property
    def url(self) -> str:
        return f"ssh://{self.user}@127.0.0.1:{self.port}"

    def config(self, name: str = "client_config") -> str:
        return str(self.folder / name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
