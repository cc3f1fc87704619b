"""Docker target pieces that need no daemon: matrix fields, host resolution and connection
errors, the log pump's timestamp/dedupe/redaction logic, and the engine files of the CPU base."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvrepro.deploy.docker.basecpu import engine_files
from kvrepro.deploy.docker.containers import LogPump, LogSink, parse_ts
from kvrepro.deploy.docker.errors import DaemonDownError, UnknownHostError
from kvrepro.deploy.docker.hosts import connect, engine_hosts, reach_address
from kvrepro.errors import SpecError
from kvrepro.deploy.docker.settings import HostSpec, docker_settings
from kvrepro.matrix import parse_matrix


def _matrix(text: str, tmp_path: Path):
    path = tmp_path / "matrix.yaml"
    path.write_text(text)
    return parse_matrix(text, path)


def test_docker_section_defaults_and_errors_name_the_line(tmp_path):
    loaded = _matrix("builds: {A: []}\n", tmp_path)
    spec = docker_settings(loaded.matrix).docker
    assert spec.pass_env == ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"] and spec.ipc_host and spec.api_port is None
    with pytest.raises(SpecError) as err:
        _matrix("builds: {A: []}\ndocker:\n  env:\n    HF_TOKEN: hf_abcdefghijklmnopqrstuvwxyz\n", tmp_path)
    text = str(err.value)
    assert "matrix.yaml:3" in text and "docker.env" in text and "pass_env" in text
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in text  # the refused value is not echoed back
    with pytest.raises(SpecError, match=r"matrix.yaml:3: docker.pass_env: entry 0 \('HF_TOKEN'") as err:
        _matrix("builds: {A: []}\ndocker:\n  pass_env:\n    - HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz\n", tmp_path)
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in str(err.value)
    with pytest.raises(SpecError, match=r"matrix.yaml:\d+: hosts.0.docker: must start with unix://"):
        _matrix("builds: {A: []}\nhosts:\n  - name: a\n    docker: gpu-node-1:2375\n", tmp_path)
    with pytest.raises(SpecError, match="docker.bogus: unknown field; allowed here: nodes"):
        _matrix("builds: {A: []}\ndocker:\n  bogus: 1\n", tmp_path)


def test_engine_hosts_resolution(tmp_path):
    text = ("builds: {A: []}\nhosts:\n  - {name: g0, docker: 'ssh://ops@g0', gpus: 4, address: 10.0.0.1}\n"
            "  - {name: g1, docker: 'ssh://ops@g1', gpus: 4}\n")
    loaded = _matrix(text, tmp_path)
    assert [h.name for h in engine_hosts(loaded.matrix)] == ["g0"]  # no nodes: the first host
    loaded = _matrix(text + "docker: {nodes: [g1, g0]}\n", tmp_path)
    assert [h.name for h in engine_hosts(loaded.matrix)] == ["g1", "g0"]
    hosts = docker_settings(loaded.matrix).hosts
    assert reach_address(hosts[0]) == "10.0.0.1" and reach_address(hosts[1]) == "g1"
    loaded = _matrix(text + "docker: {nodes: [g0, g7]}\n", tmp_path)
    with pytest.raises(UnknownHostError, match="'g7'.*defined: g0, g1"):
        engine_hosts(loaded.matrix)


def test_unresolvable_ssh_host_is_unknown_host():
    """A remote host cannot exist here: an unresolvable name stands in for a mistyped one."""
    with pytest.raises(UnknownHostError, match="no-such-gpu-node.invalid"):
        connect(HostSpec(name="gpu9", docker="ssh://ops@no-such-gpu-node.invalid"))


def test_missing_socket_and_refused_port_are_daemon_down(tmp_path):
    with pytest.raises(DaemonDownError, match="no Docker daemon socket"):
        connect(HostSpec(name="x", docker=f"unix://{tmp_path}/docker.sock"))
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(DaemonDownError, match=f"tcp://127.0.0.1:{port} does not answer"):
        connect(HostSpec(name="y", docker=f"tcp://127.0.0.1:{port}"), timeout=5)


def test_parse_ts():
    assert parse_ts(b"2026-11-29T10:00:01.5Z hi\n") == (1_795_946_401_500_000_000, b"hi\n")
    assert parse_ts(b"2026-11-29T10:00:01Z x") == (1_795_946_401_000_000_000, b"x")
    assert parse_ts(b"no stamp\n") is None


class _NoContainer:
    name = "c"


def test_log_pump_strips_stamps_joins_partials_dedupes_and_redacts(tmp_path):
    sink = LogSink(tmp_path / "engine.log")
    pump = LogPump(_NoContainer(), [sink], secrets=["s3cret-value-123"], note=lambda _: None)
    pump.feed(b"2026-11-29T10:00:01.000000001Z first line\n2026-11-29T10:00:01.000000002Z token=s3cret-value-123\n")
    pump.feed(b"2026-11-29T10:00:01.000000003Z a long line split ")  # Docker's 16 KiB partial message
    pump.feed(b"2026-11-29T10:00:01.000000004Z by the log driver\n")
    # after a reopen the daemon resends from `since`: lines at or before the last stamp are skipped
    pump.feed(b"2026-11-29T10:00:01.000000002Z token=s3cret-value-123\n2026-11-29T10:00:02Z last\n")
    sink.close()
    assert (tmp_path / "engine.log").read_text() == (
        "first line\ntoken=***\na long line split by the log driver\nlast\n")


def test_engine_files_for_the_cpu_base():
    files = engine_files()
    assert "kvrepro/__init__.py" in files and "kvrepro/engine/__main__.py" in files
    assert "kvrepro/probe/kvrepro_probe.py" in files
    assert not any("__pycache__" in name for name in files)
    assert "kvrepro/cli.py" not in files  # only what the engine imports goes into the image
