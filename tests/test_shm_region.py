"""vLLM's /dev/shm offload regions left by engines kvrepro started: claimed, then removed.

Real files, real processes, the real janitor and real /dev/shm (tmpfs); the regions here are small
files the test makes under names of its own (``vllm_offload_kvreprotest-<hex>.mmap``), never
another engine's. The end-to-end checks with vLLM's own region are in tests/test_engine.py.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT

from kvrepro import scratch
from kvrepro.engine import shm_region


def _dead_owner() -> dict[str, str]:
    from kvrepro import lifetime

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    record = lifetime.owner(proc.pid)
    proc.wait()
    record["start"] = record["start"] or "1"
    return record


def _claim_as(folder: Path, name: str, owner: dict) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(owner) + "\n")


def test_a_dead_engines_region_goes_and_a_live_ones_stays(tmp_path):
    shm, claims = tmp_path / "shm", tmp_path / "claims"
    shm.mkdir()
    dead, live = "vllm_offload_1a2b-3c_dp0.mmap", "vllm_offload_live.mmap"
    for name in (dead, live):
        (shm / name).write_bytes(b"\0" * 4096)
    _claim_as(claims, dead, _dead_owner())
    assert shm_region.claim("live", claims) == claims / live  # this (live) process's claim
    assert scratch.release_claimed(claims, shm=shm) == [dead]
    assert sorted(p.name for p in shm.iterdir()) == [live]
    assert sorted(p.name for p in claims.iterdir()) == [live]
    # the offline engine: this process's own EngineCore is over
    assert scratch.release_claimed(claims, only_pid=os.getpid(), shm=shm) == [live]
    assert not list(shm.iterdir()) and not list(claims.iterdir())


def test_a_crafted_claim_never_reaches_outside_the_shm_folder_nor_through_a_link(tmp_path):
    """The claims folder is in a world-writable temp folder: its names and contents are untrusted."""
    shm, claims, outside = tmp_path / "shm", tmp_path / "claims", tmp_path / "outside"
    shm.mkdir()
    outside.mkdir()
    victim = outside / "victim.mmap"
    victim.write_text("keep")
    (shm / "vllm_offload_link.mmap").symlink_to(victim)  # a link in /dev/shm named like a region
    (shm / "vllm_offload_dir.mmap").mkdir()
    (shm / "other.mmap").write_text("keep")
    owner = _dead_owner()
    _claim_as(claims, "vllm_offload_link.mmap", owner)
    _claim_as(claims, "vllm_offload_dir.mmap", owner)
    _claim_as(claims, "other.mmap", owner)
    _claim_as(claims, "vllm_offload_..mmap", owner)
    (claims / "vllm_offload_x").mkdir()
    assert scratch.release_claimed(claims, everything=True, shm=shm) == []
    assert victim.read_text() == "keep" and (shm / "vllm_offload_link.mmap").is_symlink()
    assert (shm / "vllm_offload_dir.mmap").is_dir() and (shm / "other.mmap").exists()
    # names that would leave the folder are not region names at all
    for engine_id in ("../../etc/passwd", "a/b", "..", "", "x" * 300, "id\n", None, 7):
        assert shm_region.region_name(engine_id) is None
        assert shm_region.claim(engine_id, claims) is None
    assert not scratch.unlink_region("../outside/victim.mmap", shm) and victim.exists()


def test_a_claim_is_not_written_through_a_link(tmp_path):
    claims, target = tmp_path / "claims", tmp_path / "target"
    claims.mkdir()
    target.write_text("keep")
    (claims / "vllm_offload_abc.mmap").symlink_to(target)
    assert shm_region.claim("abc", claims) is None
    assert target.read_text() == "keep"


def test_the_janitor_removes_the_regions_of_a_sigkilled_kvrepro(tmp_path):
    """A kvrepro killed by SIGKILL: its janitor unlinks the regions its engines claimed (a real
    file in the real /dev/shm), then the folder; an unclaimed region stays."""
    ours = f"vllm_offload_kvreprotest-{secrets.token_hex(6)}.mmap"
    other = f"vllm_offload_kvreprotest-{secrets.token_hex(6)}.mmap"
    script = (
        "import os, sys, time\n"
        "from kvrepro import scratch\n"
        "from kvrepro.engine import shm_region\n"
        "env = scratch.engine_env()\n"
        f"shm_region.claim({ours[len('vllm_offload_'):-len('.mmap')]!r}, env[shm_region.ENV])\n"
        f"open('/dev/shm/{ours}', 'wb').write(bytes(4096))\n"
        "print(scratch.folder(), flush=True)\n"
        "time.sleep(600)\n"
    )
    (Path("/dev/shm") / other).write_bytes(bytes(4096))
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        folder = Path(proc.stdout.readline().strip())
        assert folder.is_dir() and (Path("/dev/shm") / ours).exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ((Path("/dev/shm") / ours).exists() or folder.exists()):
            time.sleep(0.1)
        assert not (Path("/dev/shm") / ours).exists() and not folder.exists()
        assert (Path("/dev/shm") / other).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for name in (ours, other):
            (Path("/dev/shm") / name).unlink(missing_ok=True)


def test_kvrepro_clean_removes_the_regions_of_a_gone_owners_folder(tmp_path):
    name = f"vllm_offload_kvreprotest-{secrets.token_hex(6)}.mmap"
    folder = tmp_path / "kvrepro-1-abcdef"
    (folder / scratch.SHM_CLAIMS).mkdir(parents=True)
    (folder / scratch.OWNER_FILE).write_text(json.dumps(_dead_owner()))
    _claim_as(folder / scratch.SHM_CLAIMS, name, _dead_owner())
    (Path("/dev/shm") / name).write_bytes(bytes(4096))
    try:
        result = scratch.clean(temp=tmp_path)
        assert [item.path for item in result.removed] == [str(folder)]
        assert not (Path("/dev/shm") / name).exists()
    finally:
        (Path("/dev/shm") / name).unlink(missing_ok=True)
