"""Issue 30, hardening round three: the suite, `clean`, `classify`, `results` and Ray surfaces keep
the promise (docs/reliability.md) against what a hostile or careless user leaves for them.

Real parts: the `kvrepro` command as a process, real files, FIFOs (os.mkfifo), symbolic links to
/dev/zero, sparse 1 GiB files (no disk used), real gzip and UTF-16 files, real TCP listeners on
loopback, real signals, a real loopback Ray where it matters. Nothing is faked. The tests that
need the vLLM runtime env (a real suite run) are marked ``vllm``/``slow``; every other test takes
a few seconds (the `kvrepro` start-up). No timings are asserted except a generous bound that
tells a hang from an answer; benchmarks/hostile_files.py measures time and memory.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, require

GIB = 1 << 30
HANG = 60  # a command that has not answered by then hangs (each answers in about a second)


def kvrepro(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT,
            timeout: float = HANG) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_line(proc: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The command exited ``code`` with exactly one line on stderr, no traceback, holding ``words``."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def zero_link(path: Path) -> Path:
    path.symlink_to("/dev/zero")
    return path


def sparse_gib(path: Path) -> Path:
    with open(path, "wb") as fh:
        fh.truncate(GIB)  # 1 GiB that takes no disk: what matters is that nobody reads it
    return path


# ------------------------------------------------------------------ 1. clean and the temp folder

def test_clean_skips_owner_records_that_are_not_ones(tmp_path):
    """Case 1: the temp folder is world-writable. An owner.json that is a FIFO, a link to /dev/zero,
    a 1 GiB file, `"pid": [1]` or a mapping: each folder is kept with one line why, exit 0, and
    `clean` neither hangs nor reads past 4 KiB."""
    from kvrepro import lifetime

    temp = tmp_path / "tmp"
    temp.mkdir()
    makers = {
        "111111": lambda p: fifo(p),
        "222222": lambda p: zero_link(p),
        "333333": lambda p: sparse_gib(p),
        "444444": lambda p: p.write_text(json.dumps({"pid": [1], "host": lifetime.hostname(), "start": "1"})),
        "555555": lambda p: p.write_text(json.dumps({"pid": {"a": 1}, "host": lifetime.hostname(), "start": "1"})),
        "666666": lambda p: p.write_text("[1, 2]"),
    }
    folders = []
    for i, (hexpart, make) in enumerate(makers.items()):
        folder = temp / f"kvrepro-{4000000 + i}-{hexpart[:6]}"
        folder.mkdir()
        make(folder / "owner.json")
        folders.append(folder)
    env = dict(os.environ, TMPDIR=str(temp))
    for extra in ((), ("--dry-run",)):
        proc = kvrepro("clean", "--temp-only", *extra, "--json", env=env)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        report = json.loads(proc.stdout)[0]
        kept = {item["path"]: item["note"] for item in report["kept_temp"]}
        assert set(kept) == {str(f) for f in folders}, report
        assert not report["removed"]
        assert "FIFO" in kept[str(folders[0])] and "symbolic link" in kept[str(folders[1])]
        assert "1,073,741,824 bytes" in kept[str(folders[2])]
        assert all("not an owner record" in kept[str(f)] for f in folders[3:])
    human = kvrepro("clean", "--temp-only", "--dry-run", env=dict(env, COLUMNS="400"))
    assert human.returncode == 0 and "Traceback" not in human.stderr
    assert sum("not ours to judge" in line for line in human.stdout.splitlines()) == len(folders), human.stdout
    assert all(f.exists() for f in folders)


def test_the_bounded_reader_never_blocks_follows_or_overreads(tmp_path):
    """The one reader of files kvrepro does not own (kvrepro/untrusted.py), on its own: a FIFO with
    no writer, a /dev/zero link (followed when asked: a character device), a file over the bound,
    a folder; a regular file within the bound reads whole."""
    from kvrepro import untrusted

    cases = {
        "a FIFO": fifo(tmp_path / "fifo"),
        "symbolic link": zero_link(tmp_path / "zero"),
        "bytes; at most": sparse_gib(tmp_path / "big"),
        "a folder": tmp_path,
    }
    for words, path in cases.items():
        with pytest.raises(untrusted.UnreadableFile) as caught:
            untrusted.read_bytes(path, 4096)
        assert words in caught.value.strerror, caught.value
        assert isinstance(caught.value, OSError)
    with pytest.raises(untrusted.UnreadableFile, match="a character device"):
        untrusted.read_bytes(tmp_path / "zero", 4096, follow=True)
    good = tmp_path / "good"
    good.write_bytes(b"x" * 4096)
    assert untrusted.read_bytes(good, 4096) == b"x" * 4096
    good.write_bytes(b"x" * 4097)
    with pytest.raises(untrusted.UnreadableFile):
        untrusted.read_bytes(good, 4096)


# ------------------------------------------------------------------ 2. one bad catalogue file

def _catalogue(tmp_path: Path) -> Path:
    folder = tmp_path / "defects"
    shutil.copytree(ROOT / "defects", folder)
    return folder


@pytest.mark.parametrize("name, make, words", [
    ("fifo", lambda p: fifo(p), ("x.yaml", "FIFO")),
    ("zero", lambda p: zero_link(p), ("x.yaml", "symbolic link")),
    ("big", lambda p: sparse_gib(p), ("x.yaml", "1,073,741,824 bytes")),
    ("deep", lambda p: p.write_text("a: " + "[" * 900 + "]" * 900 + "\n"), ("x.yaml", "nested too deeply")),
    ("nul", lambda p: p.write_text("# comment\n" * 37 + "name: x\x00\n"), ("x.yaml:38:", "not valid YAML")),
])
def test_one_bad_catalogue_file_is_one_line_for_every_suite_command(tmp_path, name, make, words):
    """Case 2: a FIFO, a /dev/zero link, 1 GiB, YAML 900 deep, a NUL on line 38: `suite list`,
    `suite run` and `suite report` each give one line naming the file, exit 2, at once."""
    folder = _catalogue(tmp_path)
    make(folder / "x.yaml")
    results = tmp_path / "results"
    for args in (("suite", "list"), ("suite", "run", "--base", "0.26.0", "--results", str(results)),
                 ("suite", "report", "latest", "--results", str(results))):
        one_line(kvrepro(*args, "--catalogue", str(folder)), 2, *words)
    assert not results.exists() or not any(results.iterdir())


@pytest.mark.parametrize("release", ["9.9.9", "0.0.0", "99999999999999999999.0.0"])
def test_an_unsupported_release_in_present_in_is_bad_input(tmp_path, release):
    """Case 7 (the catalogue): `present_in: ["9.9.9"]` names the file, line and field."""
    folder = _catalogue(tmp_path)
    path = folder / "offload-boundary-assert.yaml"
    text = path.read_text()
    line = text[:text.index('present_in: ["0.25.1", "0.26.0"]')].count("\n") + 1
    path.write_text(text.replace('present_in: ["0.25.1", "0.26.0"]', f'present_in: ["{release}"]'))
    one_line(kvrepro("suite", "list", "--catalogue", str(folder)), 2,
             f"offload-boundary-assert.yaml:{line}:", "present_in", "not a vLLM release kvrepro supports")


# ------------------------------------------------------------------ 3, 4. suite.json

def _suite(results: Path, record: object) -> Path:
    folder = results / "suite-20261202-000000-abcd"
    (folder / "runs").mkdir(parents=True)
    (folder / "suite.json").write_text(record if isinstance(record, str) else json.dumps(record))
    return folder


def _record(**over: object) -> dict:
    record = {"suite_id": "suite-20261202-000000-abcd", "status": "complete", "started": 1.0, "finished": 2.0,
              "catalogue": "defects", "command": "kvrepro suite run --base 0.26.0", "kvrepro_version": "0",
              "builds": [{"release": "0.26.0", "patches": []}],
              "entries": {"offload-boundary-assert": {"testable": True, "run": None, "reps": None}}}
    record.update(over)
    return record


_ENTRY = {"testable": True, "run": None, "reps": None}


@pytest.mark.parametrize("record, words", [
    (_record(entries=["offload-boundary-assert"]), "field entries: expected an object"),
    (_record(entries={"offload-boundary-assert": "x"}), "field entries.offload-boundary-assert: expected an object"),
    (_record(builds=[{"release": "banana"}]), "field builds[0]: 'banana'"),
    (_record(builds=[{"release": "../x"}]), "field builds[0]: '../x'"),
    (_record(started="yesterday"), "field started"),
    (_record(entries={"offload-boundary-assert": {**_ENTRY, "run": 7}}), "field entries.offload-boundary-assert.run"),
    (_record(entries={"offload-boundary-assert": {**_ENTRY, "run": "../../elsewhere"}}), "is not a run id"),
    ('{"a": ' * 5000 + "1" + "}" * 5000, "nested too deeply"),
    (_record(builds=[{"release": "0.26.0", "patches": "pr-52807"}]), "field builds[0].patches: expected a list"),
    ("[1, 2]", "expected an object"),
])
def test_suite_report_reads_suite_json_typed(tmp_path, record, words):
    """Case 4: a hand-edited or foreign suite.json is one line naming the field, exit 2; `patches`
    as a string is refused, not read letter by letter as a patch stack."""
    results = tmp_path / "results"
    _suite(results, record)
    one_line(kvrepro("suite", "report", "latest", "--results", str(results)), 2, "suite.json", words)


def test_a_suite_whose_owner_is_gone_reads_aborted_and_an_interrupted_one_is_not_130(tmp_path):
    """Case 3 (owner) and the smaller case: suite.json records its owner as run.json does; a
    "running" suite whose process is gone is `aborted`; `suite report` of an interrupted suite
    is not itself interrupted: exit 3 (its rows are INFRA), never 130."""
    from kvrepro import lifetime

    gone = subprocess.Popen(["true"])
    gone.wait()
    results = tmp_path / "results"
    folder = _suite(results, _record(status="running", finished=None,
                                     owner={"pid": str(gone.pid), "host": lifetime.hostname(), "start": "1"}))
    proc = kvrepro("suite", "report", str(folder), "--json")
    assert proc.returncode == 3, proc.stderr[-2000:]
    suite = json.loads(proc.stdout)
    assert suite["status"] == "aborted" and suite["rows"][0]["state"] == "INFRA"
    assert suite["rows"][0]["detail"] == "not run"
    (folder / "suite.json").write_text(json.dumps(_record(status="interrupted")))
    proc = kvrepro("suite", "report", str(folder))
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-2000:])


@pytest.mark.vllm
def test_suite_json_names_its_owner_and_a_sigkilled_suite_reads_aborted(tmp_path, runtime_python):
    """Case 3 (SIGKILL): a real `kvrepro suite run`, killed with SIGKILL as soon as its suite.json
    exists; `suite report` says aborted (not "running" forever). (The runtime env must exist: the
    run would otherwise start making it in the shared cache.)"""
    results = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "kvrepro.cli", "suite", "run", "--base", "0.26.0", "--entry",
                             "offload-boundary-assert", "--results", str(results), "--ci"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + HANG
        while not list(results.glob("suite-*/suite.json")) and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.05)
        record = json.loads(next(results.glob("suite-*/suite.json")).read_text())
        assert record["owner"]["pid"] == str(proc.pid) and record["status"] == "running"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the process group it leads (its own session): engines too
        proc.wait()
    report = kvrepro("suite", "report", "latest", "--results", str(results), "--json")
    assert json.loads(report.stdout)["status"] == "aborted", report.stderr[-2000:]


# ------------------------------------------------------------------ 5, 9. Ray addresses

def _ray_matrix(tmp_path: Path, address: str | None) -> Path:
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data["target"] = "ray"
    if address is not None:
        data["ray"] = {"address": address}
    (tmp_path / "builds").symlink_to(ROOT / "builds")
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("address, words", [
    ("http://127.0.0.1:6379", "http:// is not a Ray address scheme"),
    ("my head node:6379", "'my head node' is not a host name or IP address"),
    ("not an address", "give host:port"),
])
def test_a_malformed_ray_address_is_bad_input_in_validate(tmp_path, address, words):
    """Case 5 (ray.address): `matrix validate` refuses it with file:line and field, exit 2."""
    matrix = _ray_matrix(tmp_path, address)
    proc = kvrepro("matrix", "validate", "-m", str(matrix))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "ray.address" in proc.stderr and words in proc.stderr, proc.stderr


def test_a_malformed_ray_address_env_is_bad_input_before_anything_is_recorded(tmp_path):
    """Case 5 ($RAY_ADDRESS): `matrix run` and `suite run --target ray` say so in one line, exit 2,
    no run or suite folder."""
    matrix = _ray_matrix(tmp_path, None)
    env = dict(os.environ, RAY_ADDRESS="not an address")
    results = tmp_path / "results"
    proc = kvrepro("matrix", "run", "-m", str(matrix), "--results", str(results), "--ci", env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "RAY_ADDRESS='not an address'" in proc.stderr
    one_line(kvrepro("suite", "run", "--base", "0.26.0", "--target", "ray", "--results", str(results), env=env), 2,
             "RAY_ADDRESS='not an address'", "give host:port")
    assert not results.exists() or not any(results.iterdir())


def _silent_listener() -> tuple[socket.socket, int]:
    """A TCP port on loopback that accepts connections and never says a word (not Ray)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return server, server.getsockname()[1]


def test_an_address_that_is_not_ray_is_one_line_without_rays_warnings(tmp_path):
    """Case 9: a port that accepts TCP but is not Ray: one kvrepro line naming it (exit 3), not
    Ray's gcs_client warnings for half a minute first."""
    require(importlib.util.find_spec("ray") is not None, "the ray extra (pip install -e '.[ray]')")
    server, port = _silent_listener()
    try:
        matrix = _ray_matrix(tmp_path, f"127.0.0.1:{port}")
        started = time.monotonic()
        proc = kvrepro("matrix", "run", "-m", str(matrix), "--results", str(tmp_path / "r"), "--ci", timeout=120)
        took = time.monotonic() - started
    finally:
        server.close()
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "gcs_client" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"127.0.0.1:{port} is not a Ray cluster (it accepts connections but sent nothing" in proc.stderr
    assert took < HANG, took


@pytest.mark.slow
@pytest.mark.exclusive
def test_the_not_ray_check_accepts_a_real_loopback_ray(tmp_path):
    """The check that tells Ray from a port that is not (case 9) passes a real Ray head's GCS
    (one raylet on loopback, started with `ray start`), and refuses an HTTP/1 server."""
    require(importlib.util.find_spec("ray") is not None, "the ray extra (pip install -e '.[ray]')")
    from kvrepro.deploy.ray.localcluster import LocalCluster
    from kvrepro.deploy.ray.target import not_grpc

    cluster = LocalCluster(nodes=1, cpus_per_node=1).start()
    try:
        assert not_grpc(cluster.address, 5.0) is None
    finally:
        assert not cluster.stop()
    http = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = http.stdout.readline()
        port = int(line.split("port ")[1].split()[0])
        assert "not as gRPC" in not_grpc(f"127.0.0.1:{port}", 5.0)
    finally:
        http.kill()
        http.wait()


# ------------------------------------------------------------------ 6. classify

CRASH_LOG = ROOT / "tests" / "data" / "logs" / "serve-0.26-target.log"


def test_classify_reads_a_gzip_log_as_text(tmp_path):
    """Case 6: `engine.log.gz` is classified as the log it holds (people attach them)."""
    plain = kvrepro("classify", str(CRASH_LOG), "--json")
    assert plain.returncode == 0 and json.loads(plain.stdout)["outcome"] == "target", plain.stderr
    packed = tmp_path / "engine.log.gz"
    packed.write_bytes(gzip.compress(CRASH_LOG.read_bytes()))
    proc = kvrepro("classify", str(packed), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == json.loads(plain.stdout)
    truncated = tmp_path / "cut.log.gz"
    truncated.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    one_line(kvrepro("classify", str(truncated)), 2, "cut.log.gz", "damaged gzip data at byte", "ends inside")


def test_classify_refuses_what_is_not_a_text_log(tmp_path):
    """Case 6: 10 MB of random bytes: "not a text log", exit 2 (not "none: no crash"); a FIFO and a
    /dev/zero link: what they are, exit 2, at once (not "no such file"). A UTF-16 crash log is
    read as the log it is (issue 44; it was refused before), with a note saying so."""
    utf16 = tmp_path / "engine-utf16.log"
    utf16.write_text(CRASH_LOG.read_text(), encoding="utf-16")
    noise = tmp_path / "noise.bin"
    noise.write_bytes(os.urandom(10 * 1024 * 1024))
    read = kvrepro("classify", str(utf16), "--json")
    assert read.returncode == 0 and json.loads(read.stdout)["outcome"] == "target", read.stderr
    assert "UTF-16-LE text, read as such" in read.stderr
    one_line(kvrepro("classify", str(noise)), 2, "noise.bin", "not a text log", "binary")
    one_line(kvrepro("classify", str(fifo(tmp_path / "pipe.log"))), 2, "pipe.log", "FIFO")
    one_line(kvrepro("classify", str(zero_link(tmp_path / "zero.log"))), 2, "zero.log", "character device")
    one_line(kvrepro("classify", str(tmp_path / "missing.log")), 2, "missing.log", "no such file")


# ------------------------------------------------------------------ 7. unsupported releases

@pytest.mark.parametrize("release", ["9.9.9", "0.0.0", "99999999999999999999.0.0"])
def test_an_unsupported_base_is_bad_input_before_anything_is_recorded(tmp_path, release):
    """Case 7: `suite run --base` and `matrix run --base` with a release kvrepro does not support:
    one line, exit 2, no suite or run folder."""
    results = tmp_path / "results"
    one_line(kvrepro("suite", "run", "--base", release, "--results", str(results)), 2,
             "--base", "not a vLLM release kvrepro supports")
    proc = kvrepro("matrix", "run", "--base", release, "--results", str(results), "--ci")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "not a vLLM release kvrepro supports" in proc.stderr
    assert not results.exists() or not any(results.iterdir())


def test_an_early_exit_waits_for_the_background_import_before_finalizing(tmp_path):
    """`matrix run` imports the report's modules (numpy, scipy) on a thread once its input checked
    out. A run that ends soon after (here: target ray without Ray, exit 3) must not finalize the
    interpreter under that thread: in a C extension's init CPython then aborts (SIGABRT,
    "PyThreadState_Get ... the GIL is released", seen once in CI) instead of exiting 3. The child
    refuses `ray` (as an environment without the extra would), makes ``scipy``'s import last 3 s (a
    meta-path finder that sleeps, so the race is not left to chance), and reports at exit (atexit
    runs after interpreter shutdown has joined the non-daemon threads) whether that thread still runs."""
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data.update(target="ray", ray={"address": "127.0.0.1:1"})
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "builds").symlink_to(ROOT / "builds")
    code = ("import atexit, sys, threading, time\n"
            "class Finder:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'ray' or name.startswith('ray.'):\n"
            "            raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n"
            "        if name == 'scipy':\n"
            "            time.sleep(3)\n"
            "        return None\n"
            "sys.meta_path.insert(0, Finder())\n"
            "atexit.register(lambda: print('ALIVE', [t.name for t in threading.enumerate()\n"
            "                                        if t.name == 'kvrepro-import-report'], file=sys.stderr))\n"
            "from kvrepro.cli import main\n"
            "sys.argv = ['kvrepro'] + sys.argv[1:]\n"
            "main()\n")
    proc = subprocess.run([sys.executable, "-c", code, "matrix", "run", "-m", str(matrix), "--results",
                           str(tmp_path / "results"), "--ci"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=HANG)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    assert "pip install 'kvrepro[ray]'" in proc.stderr and "Traceback" not in proc.stderr
    assert "ALIVE []" in proc.stderr, proc.stderr[-2000:]  # joined before finalization


# ------------------------------------------------------------------ 8. --entry X --entry X

def test_an_entry_named_twice_runs_once():
    """Case 8: `--entry X --entry X` is one entry (one run, one record), in the order first named."""
    from kvrepro.suite.run import load

    cat = load()
    chosen = cat.select(["offload-boundary-assert", "mamba-null-state", "offload-boundary-assert"])
    assert [e.name for e in chosen] == ["offload-boundary-assert", "mamba-null-state"]


# ------------------------------------------------------------------ 10. redaction of recorded errors

TOKEN = "hf_" + "Zq8" * 12


def test_suite_report_never_prints_a_recorded_token(tmp_path):
    """Case 10: a row's recorded error holding `--hf-token hf_...` is masked in the table, the
    notes and the "differs from the catalogue" lines, as it is in --json and JUnit."""
    results = tmp_path / "results"
    error = f"engine start failed: vllm serve /m --hf-token {TOKEN} exited 1"
    _suite(results, _record(entries={"offload-boundary-assert": {**_ENTRY, "error": error},
                                     f"gone-{TOKEN.lower()[:20]}": dict(_ENTRY)}))
    junit = tmp_path / "junit.xml"
    for args in ((), ("--ci",), ("--json",), ("--junit", str(junit))):
        proc = kvrepro("suite", "report", "latest", "--results", str(results), *args)
        assert proc.returncode == 3, proc.stderr[-2000:]
        assert TOKEN not in proc.stdout + proc.stderr, (args, proc.stdout, proc.stderr)
        assert "--hf-token ***" in proc.stdout + proc.stderr
    assert TOKEN not in junit.read_text()


def test_a_differs_line_quotes_no_token():
    """Case 10: the detail of a row that differs from the catalogue (OTHER: another crash's title)
    is masked where the row is made, so every printer gets it masked."""
    from kvrepro.records import Outcome, RunResult, Verdict
    from kvrepro.suite.judge import judge
    from kvrepro.suite.run import load

    entry = next(e for e in load().entries if e.name == "offload-boundary-assert")
    run = RunResult(build="x", rep=0, verdict=Verdict.CRASH, outcome=Outcome.OTHER_CRASH,
                    title=f"RuntimeError: bad --hf-token {TOKEN}", trigger_count=0, external_hit_calls=0,
                    requests=1, seconds=1.0)
    row = judge(entry, "0.26.0", "0.26.0", (), [run])
    assert row.failed and TOKEN not in row.detail and "***" in row.detail


def test_results_show_never_prints_a_recorded_token(tmp_path):
    """Case 10, the class: every record is redacted as it is read back (results.store.read_json), so
    a verdict.json copied from elsewhere or edited by hand (not written by kvrepro's redacting
    writer) with `--hf-token hf_...` in its title prints masked in `results show`."""
    from kvrepro.records import Outcome, RunResult, Verdict, to_jsonable

    run = _run_folder(tmp_path)
    rep = run / "A" / "0"
    rep.mkdir(parents=True)
    title = f"CRASH: RuntimeError: vllm serve --hf-token {TOKEN} failed"
    (rep / "verdict.json").write_text(json.dumps(to_jsonable(RunResult(
        build="A", rep=0, verdict=Verdict.CRASH, outcome=Outcome.OTHER_CRASH, title=title, trigger_count=0,
        external_hit_calls=0, requests=1, seconds=1.0))))
    assert TOKEN in (rep / "verdict.json").read_text()
    for args in ((), ("--json",)):
        proc = kvrepro("results", "show", run.name, "--results", str(tmp_path), *args,
                       env=dict(os.environ, COLUMNS="300"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert TOKEN not in proc.stdout + proc.stderr and "--hf-token ***" in proc.stdout, proc.stdout


# ------------------------------------------------------------------ smaller: usage errors, results list

def test_a_usage_error_is_one_line():
    """Typer's usage errors (`--reps 0`, an unknown option, a missing one) are one line, exit 2."""
    one_line(kvrepro("matrix", "run", "--reps", "0"), 2, "--reps", "greater than or equal to 1")
    one_line(kvrepro("results", "list", "--bogus"), 2, "No such option: --bogus")
    one_line(kvrepro("suite", "run"), 2, "Missing option '--base'")
    help_ = kvrepro("matrix")
    assert help_.returncode == 2 and "Usage" in help_.stdout + help_.stderr


def _run_folder(root: Path) -> Path:
    from kvrepro.results.records import RunBuildEntry, RunInfo
    from kvrepro.results import store as results

    run = results.create_run(root, "builds: {A: []}\n", RunInfo(
        run_id=results.new_run_id(), status="complete", build_order=("A",), builds={"A": RunBuildEntry()}))
    return run.path


def test_results_list_names_copied_run_folders(tmp_path):
    """Smaller case: two copies of one run folder are two rows named by their folders (the name
    `results show` takes), each saying which run it is a copy of."""
    original = _run_folder(tmp_path)
    shutil.copytree(original, tmp_path / "copy-1")
    shutil.copytree(original, tmp_path / "copy-2")
    proc = kvrepro("results", "list", "--json", "--results", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert [r["run_id"] for r in rows] == sorted([original.name, "copy-1", "copy-2"])
    copies = [r for r in rows if r["run_id"].startswith("copy-")]
    assert all(r["recorded_run_id"] == original.name for r in copies)
    table = kvrepro("results", "list", "--results", str(tmp_path), env=dict(os.environ, COLUMNS="160"))
    assert "copy-1" in table.stdout and "copy-2" in table.stdout and f"(run.json: {original.name})" in table.stdout


def test_results_survive_fifos_zero_links_and_huge_records(tmp_path):
    """Done-when: a FIFO, a /dev/zero link and a 1 GiB file as run.json (and as a repetition's
    verdict.json) under results/: `results list` and `results show` answer at once, the folders
    listed as unreadable or not runs, never read."""
    good = _run_folder(tmp_path)
    for name, make in (("fifo", fifo), ("zero", zero_link), ("big", sparse_gib)):
        folder = tmp_path / f"20261202-00000{len(name)}-{name}"
        folder.mkdir()
        make(folder / "run.json")
    rep = good / "A" / "0"
    rep.mkdir(parents=True)
    sparse_gib(rep / "verdict.json")
    proc = kvrepro("results", "list", "--json", "--results", str(tmp_path))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert any(r["status"] == "unreadable" and "1,073,741,824 bytes" in r["error"] for r in rows), rows
    assert next(r for r in rows if r.get("run_id") == good.name)["builds"] == {"A": ["DAMAGED"]}
    show = kvrepro("results", "show", good.name, "--results", str(tmp_path))
    assert show.returncode == 0 and "Traceback" not in show.stderr, show.stderr[-2000:]


def _descendants(pid: int) -> set[int]:
    from kvrepro.deploy.ray.localcluster import descendants

    return descendants({pid}) - {pid}


@pytest.mark.vllm
@pytest.mark.slow
def test_a_second_signal_in_a_suites_last_steps_leaves_it_interrupted(tmp_path, runtime_python):
    """Case 3: a real `kvrepro suite run` (one entry, a real engine), Ctrl-C once its engine has
    started, SIGTERM a second later while it stops: exit 130, every process it started gone, and
    suite.json says `interrupted` with a `finished` time (it said `running` forever when the
    targets were closed before the status was saved)."""
    results = tmp_path / "results"
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvrepro.cli", "suite", "run", "--base", "0.26.0", "--entry",
                                 "offload-boundary-assert", "--reps", "1", "--results", str(results), "--ci"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        while not list(results.glob("suite-*/runs/*/*/0/engine.log")) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)
        started = _descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 130, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    record = json.loads(next(results.glob("suite-*/suite.json")).read_text())
    assert record["status"] == "interrupted" and record["finished"], record
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in started) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [pid for pid in started if Path(f"/proc/{pid}").exists()]
    assert not left, left
    report = kvrepro("suite", "report", "latest", "--results", str(results), "--json")
    assert report.returncode != 130 and json.loads(report.stdout)["status"] == "interrupted"
