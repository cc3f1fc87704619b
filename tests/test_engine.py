"""End to end: vLLM's own `vllm serve`, GPU-free, as the sim target starts it, over real HTTP.

Every engine here is started by ``SimTarget.start`` (the code every matrix run uses): vLLM's
API server and EngineCore process, vLLM's logging and lifecycle, with kvrepro's platform plugin.
What the plugin fakes, because this machine has no GPU: the model executor (which tokens come
out) and the offload worker's data movement; see kvrepro/engine/executor.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests

from conftest import ROOT, alive
from kvrepro import paths

MODEL_DIR = ROOT / "kvrepro" / "data" / "models" / "qwen3-next-tiny"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


_SHARED: dict[str, object] = {}  # the module's one SimTarget: its engine zygote serves every test here


@pytest.fixture(scope="module", autouse=True)
def _shared_zygote():
    """One engine zygote for the whole module (torch & co. imported once, not once per test), closed
    at its end; each test's target is a copy of this one that serves the test's own engine settings,
    as `kvrepro suite run` shares one target between its entries (kvrepro/suite/run.py)."""
    yield
    shared = _SHARED.pop("target", None)
    if shared is not None:
        shared.close()


class _Borrowed:
    """A test's view of the shared target: everything of its own copy, but ``close`` leaves the
    shared zygote running for the next test (the module fixture stops it)."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        return getattr(self._target, name)

    def close(self) -> None:
        pass


def _target(default_matrix, **engine_overrides):
    """A SimTarget on the default matrix, optionally with other engine settings (sharing the module's zygote)."""
    import copy

    from kvrepro.deploy.sim import SimTarget
    from kvrepro.spec.matrix import LoadedMatrix

    matrix = default_matrix.matrix
    if engine_overrides:
        matrix = matrix.model_copy(update={"engine": matrix.engine.model_copy(update=engine_overrides)})
    loaded = LoadedMatrix(matrix, default_matrix.path, default_matrix.text)
    if "target" not in _SHARED:
        _SHARED["target"] = SimTarget(LoadedMatrix(default_matrix.matrix, default_matrix.path, default_matrix.text))
    own = copy.copy(_SHARED["target"])
    own.loaded = loaded
    return _Borrowed(own)


def _start(target, build: str, run_dir: Path, rep: int = 0):
    plan = next(p for p in target.loaded.plans() if p.name == build)
    artifact = target.prepare(plan)
    assert artifact.ok, artifact.error
    run_dir.mkdir(parents=True, exist_ok=True)
    return artifact, target.start(artifact, run_dir, rep)


@pytest.fixture(scope="module")
def served_d(default_matrix, overlays, tmp_path_factory):
    """Build D served once for the API tests of this module; stopped (SIGTERM) at the end."""
    target = _target(default_matrix)
    run_dir = tmp_path_factory.mktemp("served-d")
    artifact, handle = _start(target, "D", run_dir)
    yield artifact, handle, target
    handle.stop()
    target.close()


def test_the_unmodified_openai_client_works(served_d):
    import openai

    artifact, handle, target = served_d
    client = openai.OpenAI(base_url=handle.base_url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["qwen3-next-tiny"]
    # The GPU-free model samples any id of its 1,024, the end-of-text one too (about 1 request in 500
    # stops early); counting tokens needs vLLM's own ignore_eos, as the load generator sends it.
    no_eos = {"ignore_eos": True}
    text = client.completions.create(model="qwen3-next-tiny", prompt="the quick brown fox", max_tokens=5,
                                     extra_body=no_eos)
    assert text.object == "text_completion" and text.usage.completion_tokens == 5
    assert text.choices[0].finish_reason == "length"
    ids = list(range(100, 180))
    by_ids = client.completions.create(model="qwen3-next-tiny", prompt=ids, max_tokens=3, extra_body=no_eos)
    assert by_ids.usage.prompt_tokens == 80 and by_ids.usage.completion_tokens == 3
    chunks = list(client.completions.create(model="qwen3-next-tiny", prompt=ids, max_tokens=4, stream=True,
                                            extra_body=no_eos))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    chat = client.chat.completions.create(model="qwen3-next-tiny", max_tokens=3, extra_body=no_eos,
                                          messages=[{"role": "user", "content": "hello"}])
    assert chat.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError):  # vLLM's own validation answers
        client.completions.create(model="qwen3-next-tiny", prompt=[1] * 1020, max_tokens=8)

    metrics = requests.get(handle.base_url + "/metrics", timeout=5).text
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:external_prefix_cache_hits_total", "vllm:num_requests_running"):
        assert f"\n{name}{{" in metrics, name
    log = handle.log_path.read_text(errors="replace")
    assert "Platform plugin kvrepro_sim is activated" in log
    assert "(EngineCore" in log and "Sim executor: no GPU" in log  # the EngineCore process runs the sim
    assert "kvrepro-probe: installed function=OffloadingConnectorScheduler.update_state_after_alloc" in log
    # vLLM's model-info cache is the base release's own folder (kvrepro.deploy.sim.vllm_cache_root),
    # filled by this engine or an earlier one of 0.26.0, never shared with other releases
    assert target.environment(artifact, 0)["VLLM_CACHE_ROOT"] == str(paths.home() / "vllm-cache" / "0.26.0")
    cached = json.loads((paths.home() / "vllm-cache" / "0.26.0" / "modelinfos" /
                         "vllm-model_executor-models-qwen3_next-Qwen3NextForCausalLM.json").read_text())
    assert cached["hash"] and cached["modelinfo"]


def test_each_base_release_has_its_own_vllm_cache_and_patch_stacks_share_it():
    """A release switch must not invalidate another release's model-info entries (vLLM inspects a
    model class again, in a subprocess, when the cached module hash differs)."""
    from kvrepro.deploy.sim import vllm_cache_root
    from kvrepro.spec.records import BuildPlan, GitCommitSource, PatchRef

    patch = PatchRef(name="pr-52807", path=Path("builds/pr-52807.patch"), upstream="", sha256="0" * 64)
    a, b = BuildPlan("A", "0.26.0", ()), BuildPlan("B", "0.26.0", (patch,))
    commit = BuildPlan("c", "0.26.0", (), source=GitCommitSource(repo="/r", commit="ab" * 20))
    other = BuildPlan("A@0.30.0", "0.30.0", ())
    assert vllm_cache_root(a) == vllm_cache_root(b) == vllm_cache_root(commit) == paths.home() / "vllm-cache" / "0.26.0"
    assert vllm_cache_root(other) == paths.home() / "vllm-cache" / "0.30.0"


def test_vllm_bench_serve_from_the_builds_own_vllm_completes(served_d, runtime_python, runtime_scripts):
    artifact, handle, target = served_d
    env = target.environment(artifact, 0)
    env.pop("KVREPRO_ENGINE_ZYGOTE", None)
    cmd = ["-m", "vllm.entrypoints.cli.main", "bench", "serve",
           "--base-url", handle.base_url, "--model", "qwen3-next-tiny", "--tokenizer", str(MODEL_DIR),
           "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8",
           "--num-prompts", "20", "--max-concurrency", "4", "--seed", "0"]
    proc = runtime_scripts.run(runtime_python, cmd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "Successful requests:" in out
    successful = int(out.split("Successful requests:", 1)[1].split()[0])
    assert successful == 20, out[-2000:]


def test_target_crash_goes_through_vllms_own_death_path(default_matrix, overlays, tmp_path):
    from kvrepro.classify import classify_log, read_engine_counters
    from kvrepro.loadgen import run_load

    target = _target(default_matrix)
    try:
        artifact, handle = _start(target, "A", tmp_path)
        try:
            summary = run_load(handle.base_url, default_matrix.matrix.load, default_matrix.matrix.runs,
                               tmp_path / "load.jsonl", seed=0, alive=handle.alive)
            assert summary.stopped_because == "engine_dead", summary
            late = requests.post(handle.base_url + "/v1/completions", timeout=10,
                                 json={"model": "qwen3-next-tiny", "prompt": [1, 2, 3], "max_tokens": 2})
            assert late.status_code == 500 and "EngineCore encountered an issue" in late.text
            assert requests.get(handle.base_url + "/health", timeout=5).status_code == 503
            # the server stays up after EngineCore died (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH): /metrics answers
            assert "vllm:prefix_cache_hits_total" in requests.get(handle.base_url + "/metrics", timeout=5).text
            assert handle.alive()
        finally:
            handle.stop()
    finally:
        target.close()
    log = handle.log_path.read_text(errors="replace")
    fatal = log.index("EngineCore encountered a fatal error.")
    assert "(EngineCore" in log[log.rfind("\n", 0, fatal):fatal]  # logged by the EngineCore process
    dead = log.index("EngineDeadError", fatal)
    assert "(APIServer" in log[log.rfind("\n", 0, dead):dead]  # then the API server's death report
    result = classify_log(log, Path(artifact.source_root), default_matrix.matrix.target_signature)
    assert result.outcome.value == "target", result
    # the GPU's scheduling mode (engine.async_scheduling: auto): vLLM 0.26.0 with MTP turns it on and
    # the EngineCore keeps it (the CPU platform would turn it off): batch queue, AsyncScheduler
    assert "Asynchronous scheduling is enabled." in log and "Asynchronous scheduling is disabled." not in log
    assert "asynchronous scheduling on (batch queue of 2)" in log and "async_scheduling=on" in log
    counters = read_engine_counters(log)
    assert counters.steps and counters.steps > 0 and counters.offload_store_jobs is not None


def _assert_regions_gone(log: str) -> None:
    """vLLM's CPU offload region (/dev/shm/vllm_offload_<engine id>.mmap, 256 MiB of RAM here) that
    the engine made is gone once its run is over, however it ended (kvrepro/engine/shm_region.py)."""
    made = re.findall(r"(?:Created|Opened existing) mmap file (/dev/shm/vllm_offload_[A-Za-z0-9_-]+\.mmap)", log)
    assert made, "the engine made no offload region: nothing to check"
    assert [path for path in made if os.path.exists(path)] == []


def _mapping(path: str) -> list[int]:
    """The processes that have ``path`` mapped (/proc/PID/maps)."""
    pids = []
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if path in maps.read_text(errors="replace"):
                pids.append(int(maps.parent.name))
        except (OSError, ValueError):
            continue
    return pids


def test_an_engine_killed_without_cleanup_leaves_no_offload_region_in_dev_shm(default_matrix, overlays, tmp_path):
    """vLLM's multi-tier offloading (TieringOffloadingSpec) maps its CPU tier at
    /dev/shm/vllm_offload_<engine id>.mmap and unlinks it only when the engine shuts down (an
    exception in EngineCore still gets there; a SIGKILL -- the OOM killer, a stop past its grace,
    kvrepro's stop-at-once -- does not). The EngineCore that maps it is SIGKILLed mid-run (found by
    its /proc maps, a real signal); once the runner's stop has run, the region is gone (was: left,
    4 MiB here, 256 MiB with the default offload size, each time). Faked: the model and the
    GPU<->CPU copies (kvrepro/engine)."""
    transfer = {"kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                              "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}]}}
    target = _target(default_matrix, kv_offloading_size_gib=0.004, extra_args=["--kv-transfer-config", json.dumps(transfer)])
    try:
        artifact, handle = _start(target, "E", tmp_path / "run")
        try:
            resp = requests.post(handle.base_url + "/v1/completions", timeout=60,
                                 json={"model": "qwen3-next-tiny", "prompt": list(range(40)), "max_tokens": 4})
            assert resp.status_code == 200
            made = re.findall(r"Created mmap file (/dev/shm/vllm_offload_[A-Za-z0-9_-]+\.mmap)",
                              handle.log_path.read_text(errors="replace"))
            assert len(made) == 1 and os.path.isfile(made[0])
            engine_core = _mapping(made[0])
            assert len(engine_core) == 1, engine_core
            os.kill(engine_core[0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while alive(engine_core[0]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert os.path.isfile(made[0])  # vLLM had no chance to unlink it
        finally:
            handle.stop()
    finally:
        target.close()
    _assert_regions_gone(handle.log_path.read_text(errors="replace"))


def test_a_clean_stop_of_a_healthy_server_is_not_a_crash(default_matrix, overlays, tmp_path):
    """Also the synchronous mode on request (engine.async_scheduling: off -> --no-async-scheduling)."""
    from kvrepro.classify import classify_log

    target = _target(default_matrix, async_scheduling="off")
    try:
        artifact, handle = _start(target, "B", tmp_path)
        resp = requests.post(handle.base_url + "/v1/completions", timeout=30,
                             json={"model": "qwen3-next-tiny", "prompt": list(range(40)), "max_tokens": 4})
        assert resp.status_code == 200
        handle.stop()  # SIGTERM, as the runner stops every engine
    finally:
        target.close()
    log = handle.log_path.read_text(errors="replace")
    assert "EngineCore encountered a fatal error." not in log
    assert "Asynchronous scheduling is disabled." in log and "Asynchronous scheduling is enabled." not in log
    assert "asynchronous scheduling off." in log and "async_scheduling=off" in log
    result = classify_log(log, Path(artifact.source_root), default_matrix.matrix.target_signature)
    assert result.outcome.value == "none", result


def test_vllm_rejects_a_pool_too_small_and_the_title_says_why(default_matrix, overlays, tmp_path):
    from kvrepro.errors import InfraError
    from kvrepro.matrix.runner import _start_failure
    from kvrepro.spec.matrix import SimSettings

    target = _target(default_matrix, max_model_len=4096, sim=SimSettings(num_gpu_blocks=64))
    try:
        with pytest.raises(InfraError) as info:
            _start(target, "A", tmp_path)
    finally:
        target.close()
    artifact = target.prepare(target.loaded.plans()[0])
    title, refused = _start_failure(str(info.value), tmp_path / "engine.log", artifact,
                                    default_matrix.matrix.target_signature)
    assert refused is None  # vLLM started and refused the pool, not an argument
    assert title.startswith("engine exited with code")
    assert "max seq len (4096)" in title or "max_model_len" in title, title


def test_an_unknown_flag_is_vllms_own_argument_error(default_matrix, overlays, tmp_path):
    from kvrepro.classify import classify_log
    from kvrepro.errors import InfraError

    target = _target(default_matrix, extra_args=["--no-such-flag", "3"])
    try:
        with pytest.raises(InfraError):
            _start(target, "A", tmp_path)
    finally:
        target.close()
    log = (tmp_path / "engine.log").read_text(errors="replace")
    assert "unrecognized arguments: --no-such-flag" in log
    assert classify_log(log).outcome.value == "infra"


def test_consecutive_runs_never_share_an_fs_offload_tier(default_matrix, overlays, tmp_path):
    """Multi-tier offloading (vLLM's TieringOffloadingSpec) with an fs tier, real files: vLLM names
    them by block hash with a fixed seed and keeps them, so a later engine would hit an earlier one's
    files and the shadow KV would call those loads wrong KV. Two runs of one build with one load
    through the runner: each writes its chunks into an empty folder of its own run folder (a leftover
    planted there before the second start is gone; the matrix's root_dir, seeded with the first run's
    files, is never written), the manifest says where, the files go when the engine stopped, and
    the shadow KV sees no violation. An engine without MTP on 0.26.0 build E, 12 requests; faked is
    only what needs a GPU (kvrepro/engine: the model, the GPU<->CPU copies)."""
    import shutil
    import threading

    from kvrepro.deploy.base import SilentProgress
    from kvrepro.matrix.runner import run_one
    from kvrepro.spec.matrix import LoadedMatrix

    configured = tmp_path / "shared-volume"
    transfer = {"kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                              "secondary_tiers": [{"type": "fs", "root_dir": str(configured)}]}}
    target = _target(default_matrix, speculative_method="none", num_speculative_tokens=0, kv_offloading_size_gib=0.004,
                     extra_args=["--kv-transfer-config", json.dumps(transfer)])
    matrix = target.loaded.matrix
    target.loaded = LoadedMatrix(matrix.model_copy(update={"runs": matrix.runs.model_copy(update={"requests": 12})}),
                                 default_matrix.path, default_matrix.text)
    artifact = target.prepare(next(p for p in target.loaded.plans() if p.name == "E"))

    def chunk_files(folder: Path) -> set[str]:
        return {p.relative_to(folder).as_posix() for p in folder.rglob("*.bin")}

    seen: list[set[str]] = []
    results = []
    for n in (1, 2):
        run_dir = tmp_path / f"run{n}"
        tier = run_dir / "fs-tier-0"
        if n == 2:  # a leftover of an earlier start in this folder, and the first run's chunks on the "volume"
            shutil.copytree(tmp_path / "kept", configured)
            shutil.copytree(tmp_path / "kept", tier)
            (tier / "leftover.bin").write_bytes(b"x")
            volume = {p: p.stat().st_mtime_ns for p in configured.rglob("*")}

        def at_load_end(tier=tier, n=n):
            seen.append(chunk_files(tier))
            if n == 1:
                shutil.copytree(tier, tmp_path / "kept")

        run_dir.mkdir(exist_ok=True)
        results.append(run_one(target.loaded, target, artifact, run_dir, 0, SilentProgress(), threading.Event(),
                               on_load_done=at_load_end))
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["fs_tiers"] == [{"tier": 0, "configured": str(configured),
                                         "engine_root_dir": str(tier.resolve())}]
        assert not tier.exists()  # removed once the engine stopped
        args = [a for a in manifest["engine_args"] if "secondary_tiers" in a]
        assert json.loads(args[0])["kv_connector_extra_config"]["secondary_tiers"][0]["root_dir"] == str(configured)
        # the shadow KV kept the CPU tier's contents in the scheduler's real region, whose rows the fs
        # tier copies (kvrepro/engine/shadow.py CpuRegion), not by chunk id
        assert re.search(r"kvrepro-shadow: cpu-region path=/dev/shm/vllm_offload_\S+ stamped=[1-9]",
                         (run_dir / "engine.log").read_text())
        _assert_regions_gone((run_dir / "engine.log").read_text())  # the runner stopped it with SIGTERM

    first, second = seen
    assert first, "the first run wrote no chunk file: the fs tier did not run"
    assert second and "leftover.bin" not in second  # written afresh into an emptied folder
    # the matrix's root_dir: no engine wrote there (every file as the test put it)
    assert {p: p.stat().st_mtime_ns for p in configured.rglob("*")} == volume
    for result in results:
        assert result.requests == 12 and result.kv_check == "ok", result
        assert result.kv_violations == 0, result.kv_first_violation
        assert result.kv_stored.get("full_attention", 0) > 0


def test_warm_up_has_the_zygote_listening_before_the_first_engine(default_matrix, overlays):
    """What the runner calls before the first run (kvrepro/matrix/runner.py): the release's zygote
    started and listening, its kept lesson where the next zygote of the runtime finds it."""
    from kvrepro.deploy.sim import zygote_lesson

    target = _target(default_matrix)
    plan = target.loaded.plans()[0]
    artifact = target.prepare(plan)
    target.warm_up([artifact])
    runtime = target.runtime(plan.base)
    zygote = target._zygotes[runtime.key]
    assert zygote.running() and zygote.socket.exists()
    assert zygote_lesson(runtime) == paths.home() / "zygote" / f"{runtime.key}.preload"
    target.warm_up([artifact])  # again: the same zygote, not a second one
    assert target._zygotes[runtime.key] is zygote and zygote.running()


def test_zygote_forks_vllm_serve_and_relays_signals(default_matrix, overlays, runtime_python, tmp_path):
    """The zygote path: the same `vllm serve`, SIGTERM forwarded, the client's death noticed."""
    from kvrepro.deploy.sim import ZYGOTE_ENV, free_port, start_zygote, zygote_lesson
    from kvrepro.engine.zygote import ENV_VAR

    assert ZYGOTE_ENV == ENV_VAR  # the deploy side names the variable the engine side reads

    target = _target(default_matrix)
    plan = target.loaded.plans()[0]
    artifact = target.prepare(plan)
    socket_path = str(tmp_path / "zygote.sock")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = target.runtime(plan.base).pythonpath(ROOT)
    # with the runtime's kept lesson, as the sim target starts it: its engines fork warm
    zygote = start_zygote(str(runtime_python), socket_path, env, str(tmp_path / "zygote.log"),
                          learned_path=str(zygote_lesson(target.runtime(plan.base))))

    def launch(name: str):
        port = free_port()
        log = (tmp_path / f"{name}.log").open("wb")
        proc = subprocess.Popen(target.command(artifact, port), env=target.environment(artifact, 0, socket_path),
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url, log
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise AssertionError("not healthy")

    try:
        first, url, log = launch("first")
        resp = requests.post(url + "/v1/completions", timeout=30,
                             json={"model": "qwen3-next-tiny", "prompt": [5, 6, 7], "max_tokens": 3,
                                   "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        first.send_signal(signal.SIGTERM)
        code = first.wait(timeout=60)
        log.close()
        text = (tmp_path / "first.log").read_text()
        # vLLM 0.26.0's own teardown race (1 CI run in ~3): on SIGTERM serve_http looks up who holds
        # its port, finds the forked EngineCore already a zombie, and psutil raises ZombieProcess
        # (exit 1); the classifier knows it too (tests/data/logs/serve-0.26-zombie-at-stop.log)
        vllm_teardown_race = "psutil.ZombieProcess" in text and "launcher.py" in text
        assert code == 0 or (code == 1 and vllm_teardown_race), text[-3000:]
        assert "no zygote answers" not in text and "Application startup complete." in text

        # The client dies without a word: the forked engine notices and goes away too.
        second, url, log = launch("second")
        second.kill()
        second.wait()
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                requests.get(url + "/health", timeout=1)
            except requests.ConnectionError:
                break
            time.sleep(0.3)
        else:
            raise AssertionError("the forked engine outlived its client")
    finally:
        zygote.send_signal(signal.SIGTERM)
        assert zygote.wait(timeout=60) == 0
        target.close()
    assert not Path(socket_path).exists()


# -- the parts that need no vLLM ---------------------------------------------------------------

def test_sim_knobs_come_from_env_and_bad_values_are_named():
    from kvrepro.engine.config import EngineSetupError, SimKnobs

    assert SimKnobs.from_env({}) == SimKnobs(acceptance_rate=0.7, seed=0, step_delay_ms=0.0, load_steps=1)
    knobs = SimKnobs.from_env({"KVREPRO_SIM_ACCEPTANCE_RATE": "0.25", "KVREPRO_SIM_SEED": "7",
                               "KVREPRO_SIM_STEP_DELAY_MS": "1.5", "KVREPRO_SIM_LOAD_STEPS": "32"})
    assert knobs == SimKnobs(acceptance_rate=0.25, seed=7, step_delay_ms=1.5, load_steps=32)
    with pytest.raises(EngineSetupError, match="KVREPRO_SIM_LOAD_STEPS='0': must be >= 1"):
        SimKnobs.from_env({"KVREPRO_SIM_LOAD_STEPS": "0"})
    with pytest.raises(EngineSetupError, match="KVREPRO_SIM_ACCEPTANCE_RATE='1.5': must be between 0.0 and 1.0"):
        SimKnobs.from_env({"KVREPRO_SIM_ACCEPTANCE_RATE": "1.5"})
    with pytest.raises(EngineSetupError, match="KVREPRO_SIM_SEED='x': not a int"):
        SimKnobs.from_env({"KVREPRO_SIM_SEED": "x"})


def test_every_matrix_sim_knob_reaches_the_engine_under_the_name_it_reads():
    """The targets pass SimSettings.engine_env; the engine reads SimKnobs.from_env: one name each."""
    from kvrepro.engine.config import SimKnobs
    from kvrepro.spec.matrix import SimSettings

    settings = SimSettings(draft_acceptance_rate=0.25, seed=7, step_delay_ms=1.5, load_steps=32)
    assert SimKnobs.from_env(settings.engine_env(rep=2)) == SimKnobs(acceptance_rate=0.25, seed=9,
                                                                      step_delay_ms=1.5, load_steps=32)


TRANSFERS = """
import json
from kvrepro.engine.executor import SimTransferWorker

def steps(load_steps, n=4, flush=()):
    worker = SimTransferWorker(None, load_steps=load_steps)
    worker.submit_load(1, None, None)
    worker.submit_store(2, None, None)
    worker.wait(flush)
    seen = [sorted(r.job_id for r in worker.get_finished())]  # in the step that submitted them
    for _ in range(n):
        worker.begin_step()
        seen.append(sorted(r.job_id for r in worker.get_finished()))
    return seen, worker.completed

print("RESULTS " + json.dumps([steps(1), steps(3), steps(3, flush=[1])]))
"""


def test_sim_transfers_finish_loads_after_load_steps_and_stores_after_one(runtime_python, runtime_scripts, overlays):
    """engine.sim.load_steps: a load is reported that many steps after it was submitted, a store
    one step after; a flush (wait) finishes the named jobs at once. Default 1: both next step."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(overlays["A"]), str(ROOT)])
    proc = runtime_scripts.run(runtime_python, ["-c", TRANSFERS], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS "))
    default, slow, flushed = json.loads(line[len("RESULTS "):])
    assert default == [[[], [1, 2], [], [], []], {"load": 1, "store": 1}]
    assert slow == [[[], [2], [], [1], []], {"load": 1, "store": 1}]
    assert flushed == [[[1], [2], [], [], []], {"load": 1, "store": 1}]


ASYNC_RUNNER = """
import json
from types import SimpleNamespace as NS
from kvrepro.engine.config import SimKnobs
from kvrepro.engine.executor import SimRunner
from kvrepro.engine.shadow import ShadowKV

class FullAttentionSpec:  # the shadow KV reads a group's kind from its spec's class name
    block_size = 4

def runner(async_scheduling):
    config = NS(model_config=NS(get_vocab_size=lambda: 50_000), speculative_config=NS(num_speculative_tokens=1),
                scheduler_config=NS(async_scheduling=async_scheduling))
    shadow = ShadowKV(NS(kv_cache_groups=[NS(kv_cache_spec=FullAttentionSpec())]), stream=open("/dev/null", "w"))
    return SimRunner(config, SimKnobs(acceptance_rate=0.0, seed=1), None, None, shadow)

def output(new=(), cached=(), spec=None, all_tokens=None):
    # new: (req id, prompt tokens); cached: (req id, num_computed_tokens as the scheduler sends it, scheduled)
    return NS(finished_req_ids=set(), preempted_req_ids=set(), kv_cache_block_copies=(),
              scheduled_new_reqs=[NS(req_id=r, prompt_token_ids=list(range(100, 100 + n)), num_computed_tokens=0,
                                     block_ids=([1 + 8 * i + j for j in range(8)],)) for i, (r, n) in enumerate(new)],
              scheduled_cached_reqs=NS(req_ids=[c[0] for c in cached], num_computed_tokens=[c[1] for c in cached],
                                       new_block_ids=[None for _ in cached], resumed_req_ids=set(),
                                       all_token_ids=all_tokens or {}),
              num_scheduled_tokens={**{r: n for r, n in new}, **{c[0]: c[2] for c in cached}},
              scheduled_spec_decode_tokens={r: [-1] for r in (spec or ())}, total_num_scheduled_tokens=1)

def step(r, so):
    num_computed, prev_drafts = r._update_states(so)
    return r._forward(so, num_computed, prev_drafts)[1]

def step_v2(r, so):
    # the step of vLLM's model runner V2 (0.34.0), with the connector's hooks as no-ops
    import contextlib
    import vllm.forward_context

    vllm.forward_context.set_forward_context = lambda *a, **k: contextlib.nullcontext()
    r.kv_steps = NS(pre_forward=lambda so: None, finish_forward=lambda: None)
    assert r._execute_v2(so) is None
    return r._pending[1]

def run(async_scheduling, step=step):
    # What vLLM's AsyncScheduler sends for a request with a 6-token prompt and one MTP draft per
    # step, every draft rejected (acceptance 0): each step is scheduled before the previous step's
    # output is processed, so num_computed_tokens counts the previous step's draft as accepted (it
    # is lowered by one only when that output arrives) and the draft is a -1 placeholder.
    r = runner(async_scheduling)
    step(r, output(new=[("a", 6)]))                                  # prefill; samples token 7
    step(r, output(cached=[("a", 6, 2)], spec="a"))                  # no draft before: exact
    step(r, output(cached=[("a", 8, 2)], spec="a"))                  # 7 computed; the scheduler says 8
    step(r, output(cached=[("a", 9, 2)], spec="a"))                  # 8 computed; the scheduler says 9
    step(r, output(new=[("b", 5)]))                                  # "a" waits a step: the scheduler
    tokens = list(r.requests["a"].tokens)                            # catches up (9 = 10 tokens - 1)
    step(r, output(cached=[("a", 9, 2)], spec="a", all_tokens={"a": tokens}))
    return {"stats": r.async_stats, "violations": r.shadow.violations, "checks": r.shadow.checks,
            "tokens": len(r.requests["a"].tokens)}

def resync():
    # a request that was not in the previous step takes the scheduler's tokens (all_token_ids),
    # e.g. after the scheduler dropped an output still in flight
    r = runner(True)
    step(r, output(new=[("b", 5)]))                                  # samples a 6th token
    step(r, output(new=[("c", 3)]))
    step(r, output(cached=[("b", 4, 1)], all_tokens={"b": list(range(100, 105))}))  # scheduler: 5 tokens
    return {"stats": r.async_stats, "violations": r.shadow.violations,
            "hashes": len(r.shadow.requests["b"].hashes), "tokens": len(r.requests["b"].tokens)}

print("RESULTS " + json.dumps([run(True), run(False), resync(), run(True, step_v2)]))
"""


def test_the_runner_computes_where_the_gpu_does_one_step_behind_an_async_scheduler(runtime_python, runtime_scripts,
                                                                                 overlays):
    """Asynchronous scheduling (vLLM's GPU default with MTP): the scheduler sends -1 placeholders
    and a num_computed_tokens that counts the previous step's drafts as accepted. The runner, as
    vLLM's V1 GPU runner, verifies its own drafts and lowers the count by the drafts that step
    rejected, so every forward reads and writes the positions a GPU does (the shadow KV checks them:
    no violation). The control takes the scheduler's numbers as they are (the synchronous runner)
    and reads a rejected draft's KV: one violation. A request that was not in the previous step
    takes the scheduler's tokens (all_token_ids). The same steps through the runner-V2 step
    (``_execute_v2``, 0.34.0's path; its connector hooks and forward context stubbed, they need a GPU
    runner) compute the same. The scheduler outputs are written by hand, as AsyncScheduler would send
    them (the comments say why each number)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(overlays["A"]), str(ROOT)])
    proc = runtime_scripts.run(runtime_python, ["-c", ASYNC_RUNNER], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS "))
    gpu, control, resync, runner_v2 = json.loads(line[len("RESULTS "):])
    assert gpu == {"stats": {"corrections": 2, "resyncs": 0, "draft_fills": 3, "mismatches": 0},
                   "violations": 0, "checks": 6, "tokens": 11}
    assert control["violations"] == 1 and control["stats"]["corrections"] == 0
    assert resync == {"stats": {"corrections": 0, "resyncs": 1, "draft_fills": 0, "mismatches": 0},
                      "violations": 0, "hashes": 7, "tokens": 6}
    # the same steps through the runner-V2 step (0.34.0's executor path) compute the same
    assert runner_v2 == gpu


def test_plugin_names_the_platform_only_when_asked():
    """With KVREPRO_SIM unset an image that carries the plugin runs on its GPUs unchanged."""
    from kvrepro.engine import plugin

    assert plugin.platform_for({}) is None
    assert plugin.platform_for({"KVREPRO_SIM": "0"}) is None
    assert plugin.platform_for({"KVREPRO_SIM": "1"}) == "kvrepro.engine.platform.SimCpuPlatform"
    from kvrepro.builds.plugin_dist import dist_info_files

    entry = next(text for rel, text in dist_info_files().items() if rel.endswith("entry_points.txt"))
    assert "[vllm.platform_plugins]" in entry and "kvrepro.engine.plugin:register" in entry
    assert callable(plugin.register)  # the entry point names a function the engine side has


# -- build zygotes (kvrepro/engine/zygote.py): vLLM of one build imported once per runtime zygote --------

_FAKE_VLLM_INIT = '''import os
KNOB = os.environ.get("FAKE_VLLM_KNOB")  # read at import, as vLLM reads its logging settings
print(f"fake vllm imported by pid {os.getpid()} with knob {KNOB}", flush=True)
'''
_FAKE_VLLM_MAIN = '''import os, sys
import vllm
{broken}
def main():
    print(f"engine pid {{os.getpid()}} ppid {{os.getppid()}}: knob at import {{vllm.KNOB}}, "
          f"now {{os.environ.get('FAKE_VLLM_KNOB')}}, argv {{sys.argv[1:]}}", flush=True)
    if "wait" in sys.argv:  # an engine that serves until stopped
        import time
        time.sleep(600)
'''


def _fake_overlay(folder: Path, broken: bool = False) -> Path:
    """A two-module stand-in for a build's overlay: ``vllm`` (reads a variable at import and says so)
    and ``vllm.entrypoints.cli.main`` (what `vllm serve` runs). The real vLLM's build zygote is
    exercised end to end in tests/test_shared_zygote.py; this one shows the zygote's own rules fast
    (the cap test needs seven builds: seven real vLLM imports would cost ~20 CPU s and ~1.5 GB)."""
    cli = folder / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    (folder / "vllm" / "__init__.py").write_text(_FAKE_VLLM_INIT)
    (folder / "vllm" / "entrypoints" / "__init__.py").write_text("")
    (cli / "__init__.py").write_text("")
    (cli / "main.py").write_text(_FAKE_VLLM_MAIN.format(
        broken='raise RuntimeError("this overlay is broken on purpose")' if broken else ""))
    return folder


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_build_zygote_forks_engines_of_one_build_and_each_keeps_its_own_import_time_settings(runtime_python,
                                                                                             tmp_path):
    """Real runtime zygote, real build zygotes, real forks and signals; vLLM is a two-module stand-in
    (``_fake_overlay``). Engines of one build with the same import-time environment fork from one build
    zygote, and their output starts with what its import printed; an engine whose environment differs
    in a variable read at import imports vLLM itself; a build whose vLLM does not import runs its
    engines the ordinary way, each showing the real error; stopping the zygote leaves nothing."""
    from kvrepro.deploy.sim import start_zygote
    from kvrepro.engine.zygote import BUILD_ZYGOTES_ENV, ENV_VAR

    good = _fake_overlay(tmp_path / "good")
    broken = _fake_overlay(tmp_path / "broken", broken=True)
    socket_path = str(tmp_path / "zygote.sock")
    log = tmp_path / "zygote.log"
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", ENV_VAR, BUILD_ZYGOTES_ENV)}
    zygote = start_zygote(str(runtime_python), socket_path, dict(base, PYTHONPATH=str(ROOT)), str(log))

    def engine(overlay: Path, knob: str, **extra: str) -> subprocess.CompletedProcess:
        env = dict(base, PYTHONPATH=f"{overlay}{os.pathsep}{ROOT}", FAKE_VLLM_KNOB=knob, **{ENV_VAR: socket_path},
                   **extra)
        return subprocess.run([str(runtime_python), "-m", "kvrepro.engine", "serve", knob], env=env,
                              capture_output=True, text=True, timeout=300)

    try:
        first, second = engine(good, "a"), engine(good, "a")
        other = engine(good, "b")
        own = engine(good, "a", **{BUILD_ZYGOTES_ENV: "0"})
        broken_runs = [engine(broken, "a"), engine(broken, "a")]
        tree = _descendants(zygote.pid)
        text = log.read_text()
        (started,) = [line for line in text.splitlines() if "started build zygote" in line and str(good) in line]
        build_pid = int(started.split()[5])
        assert build_pid in tree  # still running between engines, under the runtime zygote
    finally:
        zygote.send_signal(signal.SIGTERM)
        assert zygote.wait(timeout=60) == 0
    assert not any(alive(pid) for pid in tree), [pid for pid in tree if alive(pid)]

    for run in (first, second):
        assert run.returncode == 0, run.stderr
        assert f"forked from build zygote {build_pid}" in run.stdout
        # the import's own output, printed once in the build zygote, is in each engine's output
        assert f"fake vllm imported by pid {build_pid} with knob a" in run.stdout
        assert f"ppid {build_pid}: knob at import a, now a, argv ['serve', 'a']" in run.stdout
    assert first.stdout.split("engine pid")[1] != second.stdout.split("engine pid")[1]  # two engines
    # a variable vLLM read at import differs: imported afresh, with this engine's value
    assert other.returncode == 0 and "forked from build zygote" not in other.stdout
    assert "knob at import b, now b" in other.stdout
    assert "FAKE_VLLM_KNOB differ from build zygote" in text
    assert own.returncode == 0 and "forked from build zygote" not in own.stdout and "knob at import a" in own.stdout
    for run in broken_runs:  # the engine's own output names the real error, as without build zygotes
        assert run.returncode == 1 and "RuntimeError: this overlay is broken on purpose" in run.stderr, run.stderr
        assert "forked from build zygote" not in run.stdout + run.stderr
    assert text.count("could not import vLLM") == 1  # tried once per build, not once per engine
    assert not Path(socket_path).exists()


def test_build_zygotes_beyond_the_cap_retire_the_least_recently_used(runtime_python, tmp_path):
    """At most BUILD_ZYGOTES_MAX build zygotes run per runtime zygote: the next build retires the one
    used longest ago, which exits once its engines are gone (real processes; vLLM a stand-in)."""
    from kvrepro.deploy.sim import start_zygote
    from kvrepro.engine.zygote import BUILD_ZYGOTES_ENV, BUILD_ZYGOTES_MAX, ENV_VAR

    socket_path = str(tmp_path / "zygote.sock")
    log = tmp_path / "zygote.log"
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", ENV_VAR, BUILD_ZYGOTES_ENV)}
    zygote = start_zygote(str(runtime_python), socket_path, dict(base, PYTHONPATH=str(ROOT)), str(log))
    overlays = [_fake_overlay(tmp_path / f"build{i}") for i in range(BUILD_ZYGOTES_MAX + 1)]
    try:
        for overlay in [*overlays[:-1], overlays[0], overlays[-1]]:  # build0 used again: build1 is the oldest
            env = dict(base, PYTHONPATH=f"{overlay}{os.pathsep}{ROOT}", FAKE_VLLM_KNOB="a", **{ENV_VAR: socket_path})
            run = subprocess.run([str(runtime_python), "-m", "kvrepro.engine", "serve"], env=env,
                                 capture_output=True, text=True, timeout=300)
            assert run.returncode == 0 and "forked from build zygote" in run.stdout, run.stdout + run.stderr
        started = {line.split()[7]: int(line.split()[5]) for line in log.read_text().splitlines()
                   if "started build zygote" in line}
        assert len(started) == BUILD_ZYGOTES_MAX + 1
        deadline = time.monotonic() + 30
        while alive(started[str(overlays[1])]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(started[str(overlays[1])])  # retired: it had no engine left
        assert all(alive(started[str(o)]) for o in overlays if o != overlays[1])
        tree = _descendants(zygote.pid)
    finally:
        zygote.send_signal(signal.SIGTERM)
        assert zygote.wait(timeout=60) == 0
    assert tree and not any(alive(pid) for pid in tree)


def test_a_sigkilled_zygote_takes_its_build_zygote_and_its_engines_with_it(runtime_python, tmp_path):
    """SIGKILL of the runtime zygote (nobody can clean up after it): its build zygote gets its
    parent-death signal and stops its engine, and the engine's client sees the end (real processes
    and signals; vLLM a stand-in, ``_fake_overlay``)."""
    from kvrepro.deploy.sim import start_zygote
    from kvrepro.engine.zygote import BUILD_ZYGOTES_ENV, ENV_VAR

    overlay = _fake_overlay(tmp_path / "good")
    socket_path = str(tmp_path / "zygote.sock")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", ENV_VAR, BUILD_ZYGOTES_ENV)}
    zygote = start_zygote(str(runtime_python), socket_path, dict(base, PYTHONPATH=str(ROOT)),
                          str(tmp_path / "zygote.log"))
    env = dict(base, PYTHONPATH=f"{overlay}{os.pathsep}{ROOT}", FAKE_VLLM_KNOB="a", **{ENV_VAR: socket_path})
    client = subprocess.Popen([str(runtime_python), "-m", "kvrepro.engine", "serve", "wait"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not any("engine pid" in line for line in lines):
            line = client.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        assert any("forked from build zygote" in line for line in lines), lines
        tree = _descendants(zygote.pid)
        assert len(tree) == 2, tree  # the build zygote and its engine
        zygote.kill()
        zygote.wait()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in tree), [pid for pid in tree if alive(pid)]
        assert client.wait(timeout=30) != 0  # its engine ended without a clean exit
    finally:
        if client.poll() is None:
            client.kill()
        if zygote.poll() is None:
            zygote.kill()
        client.wait()
        client.stdout.close()
