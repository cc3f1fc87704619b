"""The zygote keeps what its engines taught it (kvrepro/engine/zygote.py ``--learned``), so that the
next zygote of the runtime preloads it before its first fork: warm first starts for every slot.

Runs a real zygote process (this venv's python: the preload of torch & co. just finds nothing to
import here) on a real unix socket; no vLLM is needed to check what it preloads and keeps."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvrepro.engine.zygote import read_learned, write_learned


def test_a_lesson_is_merged_kept_sorted_and_never_names_vllm_or_kvrepro(tmp_path):
    path = str(tmp_path / "sub" / "rt.preload")
    assert read_learned(path) == [] and read_learned(None) == []
    write_learned(path, ["colorsys", "vllm.config", "kvrepro.engine", "json.decoder"])
    assert read_learned(path) == ["colorsys", "json.decoder"]
    write_learned(path, ["wave", "colorsys"])
    assert read_learned(path) == ["colorsys", "json.decoder", "wave"]
    assert Path(path).read_text().startswith("#")  # says what it is to whoever opens it
    assert not list(Path(path).parent.glob("*.tmp"))


def test_a_zygote_preloads_the_last_lesson_and_keeps_a_new_one(tmp_path):
    lesson = tmp_path / "rt.preload"
    write_learned(str(lesson), ["colorsys", "wave"])
    sock = str(tmp_path / "z.sock")
    log = tmp_path / "zygote.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvrepro.engine.zygote", "--socket", sock,
                                 "--learned", str(lesson)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not Path(sock).exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        text = log.read_text()
        loaded = int(text.split("preloaded ")[1].split(" ")[0])
        assert loaded >= 2, text  # the two kept modules at least (torch & co. are not in this venv)
        # what an engine reports after it settled (kvrepro.engine.zygote._run_engine's report_modules)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(sock)
            s.sendall(json.dumps({"learn": ["tabnanny", "vllm.entrypoints"]}).encode() + b"\n")
        while "more modules to preload" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert read_learned(str(lesson)) == ["colorsys", "tabnanny", "wave"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not Path(sock).exists()


def test_a_zygote_heap_is_frozen_for_the_engines_it_forks_unless_turned_off(tmp_path):
    """freeze_heap() (called by the zygote after its preload and by each build zygote after its
    vLLM import) leaves the preloaded objects in the collector's permanent generation, which a
    forked child inherits: its full collections skip them. KVREPRO_ZYGOTE_GC_FREEZE=0 turns it off."""
    code = ("import gc, os, sys\n"
            "from kvrepro.engine import zygote\n"
            "zygote.preload(['json', 'colorsys'])\n"
            "zygote.freeze_heap()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    sys.stdout.write(str(gc.get_freeze_count())); sys.stdout.flush(); os._exit(0)\n"
            "os.waitpid(pid, 0)\n")
    import os

    for setting, frozen in (("1", True), ("0", False)):
        env = dict(os.environ, KVREPRO_ZYGOTE_GC_FREEZE=setting)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert (int(proc.stdout) > 1000) is frozen, (setting, proc.stdout)
