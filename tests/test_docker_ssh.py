"""ssh:// Docker hosts through a real sshd: one kept connection, ssh's own failure reasons, no
prompt even with a terminal, the engine API on the host's loopback reached over the connection,
and the same verdicts as the local socket and the sim target.

Faked: the remote machine. The sshd (tests/sshd.py: OpenSSH's sshd on 127.0.0.1 only, a
throwaway host key and client key in a temp folder, nothing in ~/.ssh touched) logs into this
machine, and the daemon behind it is this machine's dockerd. Where the remote code paths are
under test the host says `local: false` (this machine's daemon ID would otherwise, rightly, make
it local): the model folder is then uploaded, the API is published on the "remote" loopback and
reached through a port forward over the kept ssh connection. Everything else is real: ssh, the
key exchange, forwarding, Docker. Fails instead of skipping under CI when sshd cannot be started.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, require
from kvrepro.deploy.docker import labels as L
from kvrepro.deploy.docker.errors import SshError
from kvrepro.deploy.docker.hosts import connect, is_local, local_daemon_id
from kvrepro.deploy.docker.settings import HostSpec, docker_settings
from sshd import ThrowawaySshd, find_sshd
from test_docker_target import cpu_base, docker_host  # noqa: F401 (fixtures)

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    require(find_sshd() is not None, "sshd is not installed (apt-get install -y openssh-server; "
                                     "scripts/test.sh and .ci/docker-setup.sh do it)")
    require(shutil.which("ssh") is not None, "the ssh client is not installed (openssh-client)")
    server = ThrowawaySshd(tmp_path_factory.mktemp("sshd"))
    try:
        server.start()
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        require(False, f"could not start sshd: {exc}")
    yield server
    server.stop()


def logins(server: ThrowawaySshd) -> int:
    """ssh connections sshd accepted so far (one per authenticated connection, not per channel)."""
    return server.log.read_text(errors="replace").count("Accepted publickey")


def ssh_clients_of(port: int) -> list[str]:
    """Command lines of this machine's ssh client processes that talk to ``port``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")[:-1]
        except OSError:
            continue  # ended meanwhile
        line = " ".join(a.decode(errors="replace") for a in argv)
        if argv and os.path.basename(argv[0]) == b"ssh" and f"-p {port} " in line:
            found.append(line)
    return found


def spec(server: ThrowawaySshd, config: str = "client_config", port: int | None = None, **extra) -> HostSpec:
    url = server.url if port is None else f"ssh://{server.user}@127.0.0.1:{port}"
    return HostSpec(name="peer", docker=url, ssh_config=server.config(config), **extra)


def test_one_kept_connection_carries_every_api_call(sshd):
    before = logins(sshd)
    host = connect(spec(sshd), timeout=30)
    try:
        # concurrent calls (as log streams and health polls make them) open channels, not connections
        errors: list[BaseException] = []

        def calls() -> None:
            try:
                for _ in range(5):
                    host.client.ping()
                    host.client.containers.list(all=True)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=calls) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert logins(sshd) - before == 1
        masters = ssh_clients_of(sshd.port)
        assert len(masters) == 1 and " -N -M " in masters[0] and "BatchMode=yes" in masters[0], masters
        socket_folder = host.tunnel.docker_socket.parent
    finally:
        host.close()
    assert ssh_clients_of(sshd.port) == []  # the master ends with the host
    assert not socket_folder.exists()


def test_ssh_failures_carry_sshs_reason(sshd, tmp_path):
    closed_port = ThrowawaySshd(tmp_path / "unused").port  # a free port nothing listens on
    cases = {
        "Connection refused": spec(sshd, port=closed_port),
        "Host key verification failed": spec(sshd, "trusting_config"),  # empty known_hosts
        "Permission denied (publickey)": spec(sshd, "stranger_config"),  # a key sshd never saw
    }
    for reason, host_spec in cases.items():
        with pytest.raises(SshError) as err:
            connect(host_spec, timeout=30)
        assert reason in str(err.value) and "does not answer" not in str(err.value), str(err.value)
    # connected, but no daemon socket at the path the URL names: ssh's channel error, said as such
    no_socket = HostSpec(name="peer", docker=f"{sshd.url}/nonexistent/docker.sock", ssh_config=sshd.config())
    with pytest.raises(SshError, match=r"socket /nonexistent/docker.sock does not answer through it \(channel"):
        connect(no_socket, timeout=30)
    assert ssh_clients_of(sshd.port) == [] and ssh_clients_of(closed_port) == []

    # the same through the CLI: one line per host with the reason, exit 3, no traceback
    hosts = [{"name": f"h{i}", **{k: v for k, v in s.model_dump(exclude_none=True).items() if k != "name"}}
             for i, s in enumerate(cases.values())]
    matrix = write_matrix(tmp_path / "m", "kvrepro/vllm-openai-cpu:v0.26.0", hosts)
    proc = kvrepro("hosts", "check", "--json", "-m", str(matrix), timeout=180)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    reports = json.loads(proc.stdout)
    assert [r["error_kind"] for r in reports] == ["ssh"] * 3
    for report, reason in zip(reports, cases):
        assert reason in report["error"], report


def test_unknown_host_key_fails_at_once_with_a_terminal(sshd, tmp_path):
    """ssh asks "Are you sure you want to continue connecting?" on a terminal; kvrepro must
    never wait there. `script` gives `kvrepro hosts check` a pseudo-terminal as its controlling
    terminal and stdin; a prompt would hang it until the subprocess timeout fails the test."""
    require(shutil.which("script") is not None, "`script` (bsdutils) is needed to run under a terminal")
    hosts = [{"name": "peer", "docker": sshd.url, "ssh_config": sshd.config("trusting_config")}]
    matrix = write_matrix(tmp_path / "m", "kvrepro/vllm-openai-cpu:v0.26.0", hosts)
    command = f"{sys.executable} -m kvrepro.cli hosts check -m {matrix}; echo kvrepro-exit=$?"
    # no stdin redirection: script's pty is the terminal, the test's stdin just never sends anything
    proc = subprocess.run(["script", "-qec", command, "/dev/null"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert "kvrepro-exit=3" in proc.stdout, proc.stdout[-3000:]
    flat = " ".join(proc.stdout.split())
    assert "Host key verification failed" in flat
    assert "continue connecting" not in flat
    assert "Traceback" not in proc.stdout


def test_locality_is_the_daemon_not_the_address(sshd):
    """ssh://...@127.0.0.1:PORT is often a VM behind a port forward: the address decides nothing."""
    loopback = HostSpec(name="vm", docker="ssh://ops@127.0.0.1:2222")
    assert not is_local(loopback)  # no daemon ID known: not this machine
    assert not is_local(loopback, daemon_id="ANOTHER:DAEMON:ID")
    local_id = local_daemon_id()
    require(local_id is not None, "no local Docker daemon")
    # this sshd does lead to this machine's daemon: found out by its ID, over ssh
    host = connect(spec(sshd), timeout=30)
    try:
        assert host.info["ID"] == local_id and host.local
    finally:
        host.close()
    assert is_local(HostSpec(name="x", docker=sshd.url, local=False), daemon_id=local_id) is False


def kvrepro(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def write_matrix(folder: Path, base_image: str, hosts: list[dict] | None) -> Path:
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data.update(target="docker", base_image=base_image)
    # engines start in 40-160 s on this shared 2-core machine; the same generous gate for both runs
    data.setdefault("docker", {})["health_timeout_s"] = 900
    if hosts:
        data["hosts"] = hosts
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "matrix.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    if not (folder / "builds").exists():
        os.symlink(ROOT / "builds", folder / "builds")
    return folder / "matrix.yaml"


@pytest.mark.slow
def test_matrix_through_ssh_gets_the_verdicts_of_every_other_target(tmp_path, sshd, docker_host, cpu_base):
    """A over ssh crashes on the target assertion and B reads stale KV, as on the local socket
    (tests/test_docker_e2e.py) and the sim target (tests/test_matrix_e2e.py): the same matrix is
    not run again on the local socket here, which cost two more engine starts."""
    common = ["matrix", "run", "--build", "A", "--build", "B", "--reps", "1", "--json"]
    remote_hosts = [{"name": "peer", "docker": sshd.url, "ssh_config": sshd.config(), "local": False}]
    results = tmp_path / "ssh-results"
    bindings: dict[str, str] = {}
    stop = threading.Event()

    def watch() -> None:  # how the engine containers of the ssh run publish their API
        while not stop.is_set():
            for c in docker_host.client.containers.list(filters=L.MANAGED_FILTER, ignore_removed=True):
                if c.labels.get(L.LABEL_RUN, "").startswith(str(results)):
                    for ports in (c.attrs["HostConfig"].get("PortBindings") or {}).values():
                        for b in ports or []:
                            bindings[c.name] = b.get("HostIp", "")
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    before = logins(sshd)
    try:
        remote = kvrepro(*common, "-m", str(write_matrix(tmp_path / "ssh", cpu_base, remote_hosts)),
                         "--results", str(results))
    finally:
        stop.set()
        watcher.join()
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert logins(sshd) - before == 1  # one kept connection for the whole run
    on_ssh = json.loads(remote.stdout)
    crashed = on_ssh["builds"]["A"]["runs"][0]
    assert (crashed["verdict"], crashed["outcome"]) == ("CRASH", "target"), crashed
    assert crashed["trigger_count"] > 0 and crashed["state_count"] > 0, crashed
    corrupt = on_ssh["builds"]["B"]["runs"][0]
    # as on the sim target: the boundary fix leaves stale KV (docs/first-case.md)
    assert corrupt["verdict"] == "CORRUPT" and corrupt["trigger_count"] > 0, corrupt
    # the API was published on the host's loopback only and reached through the ssh connection
    assert bindings and set(bindings.values()) == {"127.0.0.1"}, bindings
    for build in ("A", "B"):
        docker_log = (Path(on_ssh["builds"][build]["runs"][0]["run_dir"]) / "docker.log").read_text()
        assert "forwarded to http://127.0.0.1:" in docker_log and "over ssh" in docker_log
    assert ssh_clients_of(sshd.port) == []  # the master ended with kvrepro
    leftovers = [c for c in docker_host.client.containers.list(all=True, filters=L.MANAGED_FILTER,
                                                                 ignore_removed=True)
                 if c.labels.get(L.LABEL_RUN, "").startswith(str(results))]
    assert leftovers == []


def test_api_is_never_published_on_all_interfaces_by_default():
    """No daemon needed: where each kind of host publishes an engine API, and the one refusal."""
    from kvrepro.deploy.docker.hosts import DockerHost
    from kvrepro.errors import SpecError

    tcp = HostSpec(name="far", docker="tcp://10.0.0.5:2376")
    with pytest.raises(SpecError, match=r"far: .*set hosts\[\]\.api_address.*never publishes it on all interfaces"):
        DockerHost(spec=tcp, client=None, local=False).api_bind_ip()
    explicit = HostSpec(name="far", docker="tcp://10.0.0.5:2376", api_address="10.0.0.5")
    assert DockerHost(spec=explicit, client=None, local=False).api_bind_ip() == "10.0.0.5"
    assert DockerHost(spec=explicit, client=None, local=False).api_url(8123) == ("http://10.0.0.5:8123", None)
    assert DockerHost(spec=tcp, client=None, local=True).api_bind_ip() == "127.0.0.1"


def test_ssh_url_and_reason_parsing():
    from kvrepro.deploy.docker.ssh import ssh_reason, ssh_target

    assert ssh_target(HostSpec(name="a", docker="ssh://ops@gpu-0")) == ("ops@gpu-0", None, "/var/run/docker.sock")
    assert ssh_target(HostSpec(name="a", docker="ssh://gpu-0:2222/run/user/1000/docker.sock")) == \
        ("gpu-0", 2222, "/run/user/1000/docker.sock")
    stderr = ("Warning: Permanently added '[127.0.0.1]:2222' (ED25519) to the list of known hosts.\r\n"
              "ops@127.0.0.1: Permission denied (publickey).\r\n")
    assert ssh_reason(stderr) == "ops@127.0.0.1: Permission denied (publickey)"


def test_a_lost_ssh_connection_is_named_with_sshs_reason(tmp_path, sshd, docker_host, cpu_base):
    """The host's sshd drops the kept connection (its session process is killed, as a reboot or
    a network cut would): the next run is INFRA with ssh's own words, not "daemon stopped"."""
    from kvrepro.deploy.docker import DockerTarget
    from kvrepro.spec.matrix import load_matrix

    hosts = [{"name": "peer", "docker": sshd.url, "ssh_config": sshd.config(), "local": False}]
    loaded = load_matrix(write_matrix(tmp_path / "m", cpu_base, hosts))
    target = DockerTarget(loaded)
    try:
        [plan] = loaded.plans(["A"])
        artifact = target.prepare(plan)
        assert artifact.ok, artifact.error
        host = target.host(docker_settings(loaded.matrix).hosts[0])
        assert host.tunnel is not None and host.tunnel.alive()
        sessions = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/stat")
                    if _ppid(p) == sshd.proc.pid]
        assert sessions, "sshd has no session process for the kept connection"
        for pid in sessions:
            os.kill(pid, 15)
        deadline = time.monotonic() + 60
        while host.tunnel.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        # ssh's words for it depend on whether the client was writing when the session died:
        # "Connection to 127.0.0.1 closed" or "client_loop: send disconnect: Broken pipe" (seen in CI)
        with pytest.raises(SshError, match=r"ssh connection to host peer ended \((Connection to 127\.0\.0\.1 closed"
                                            r"|client_loop: send disconnect: Broken pipe)"):
            target.start(artifact, tmp_path / "run", 0)
    finally:
        target.close()


def _ppid(stat: Path) -> int | None:
    try:
        text = stat.read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[1])
