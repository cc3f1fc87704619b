"""End-to-end tests of the GPU-free engine (python -m kvrepro.engine) over real HTTP.

The engine runs as a subprocess on a free 127.0.0.1 port, against a vLLM overlay, with the
argument list every target uses (``EngineSpec.serve_args``). Everything vLLM does runs for
real (EngineCore, scheduler, KV-cache manager, OffloadingConnector); what the engine itself
fakes is the model and the offload data movement (no GPU here), see kvrepro/engine/executor.py.

The geometry is the default matrix's except two values (see ``ENGINE``): 96 GPU blocks instead
of 64 and max_model_len 1024 instead of 4096, because vLLM refuses to start when one request
of max_model_len cannot fit in the pool (checked by ``test_vllm_rejects_a_pool_too_small``),
and because 64 blocks let vLLM 0.26.0's scheduler deadlock on async loads now and then
(upstream vllm#57841), which would turn a survival check into a coin toss.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import ROOT, require


MODEL_DIR = ROOT / "kvrepro" / "data" / "models" / "qwen3-next-tiny"
START_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def builds(runtime_python, overlays) -> dict:
    """The runtime env's python and the default matrix's overlays, made by kvrepro.builds."""
    return {"python": str(runtime_python), **{name: str(path) for name, path in overlays.items()}}


def engine_spec(**overrides):
    from kvrepro.spec import EngineSpec, SimSettings

    values = dict(max_model_len=1024, sim=SimSettings(num_gpu_blocks=96))
    values.update(overrides)
    return EngineSpec(**values)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """One engine subprocess; its log is a file; stop() sends SIGTERM and waits."""

    def __init__(self, python: str, overlay: str, log: Path, args: list[str], seed: int = 0,
                 extra_env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = dict(os.environ)
        env.update(PYTHONPATH=os.pathsep.join([overlay, str(ROOT)]), PYTHONUNBUFFERED="1",
                   KVREPRO_SIM_SEED=str(seed), KVREPRO_SIM_ACCEPTANCE_RATE="0.7")
        env.update(extra_env or {})
        self._log = log.open("wb")
        cmd = [python, "-m", "kvrepro.engine", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"engine exited ({self.proc.returncode}):\n{self.log()[-4000:]}"
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise AssertionError(f"engine not healthy in {START_TIMEOUT_S}s:\n{self.log()[-4000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        text = requests.get(self.url + "/metrics", timeout=5).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name.split("{")[0]] = float(value)
        return values


@pytest.fixture
def start(builds, tmp_path):
    engines: list[Engine] = []

    def _start(build: str = "A", seed: int = 0, args: list[str] | None = None, wait: bool = True) -> Engine:
        overlay = builds.get(build)
        if args is None:
            args = engine_spec().serve_args(str(MODEL_DIR), include_sim=True)
        engine = Engine(builds["python"], overlay, tmp_path / f"engine-{build}-{len(engines)}.log", args, seed)
        engines.append(engine)
        if wait:
            engine.wait_ready()
        return engine

    yield _start
    for engine in engines:
        engine.stop()


def shared_prefix_load(url: str, model: str, requests_budget: int, seed: int, stop_on_error: bool = True) -> dict:
    """The default profile: 6 documents x 400 tokens, random prefix + 0-39 tokens, 8 out, 4 at once."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1000) for _ in range(400)] for _ in range(6)]
    lock = threading.Lock()
    state = {"sent": 0, "ok": 0, "errors": []}

    def next_prompt():
        with lock:
            if state["sent"] >= requests_budget or (stop_on_error and state["errors"]):
                return None
            state["sent"] += 1
            doc = rng.choice(docs)
            return doc[: rng.randint(1, 400)] + [rng.randrange(1000) for _ in range(rng.randint(0, 39))]

    def worker():
        with requests.Session() as session:
            while (prompt := next_prompt()) is not None:
                resp = session.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8},
                                    timeout=60)
                with lock:
                    if resp.status_code == 200:
                        state["ok"] += 1
                    else:
                        state["errors"].append((resp.status_code, resp.json()))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return state


@pytest.mark.vllm
@pytest.mark.slow
def test_serves_the_openai_api(start):
    engine = start("A")
    assert requests.get(engine.url + "/health", timeout=5).status_code == 200
    models = requests.get(engine.url + "/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["qwen3-next-tiny"]  # --served-model-name from EngineSpec
    model = models["data"][0]["id"]

    resp = requests.post(engine.url + "/v1/completions",
                         json={"model": model, "prompt": "the quick brown fox jumps", "max_tokens": 5}, timeout=30)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["text"].split()) == 5

    ids = list(range(100, 180))
    again = requests.post(engine.url + "/v1/completions", json={"prompt": ids, "max_tokens": 3}, timeout=30).json()
    assert again["usage"]["prompt_tokens"] == 80 and again["usage"]["completion_tokens"] == 3

    with requests.post(engine.url + "/v1/completions", json={"prompt": ids, "max_tokens": 4, "stream": True},
                       stream=True, timeout=30) as stream:
        assert stream.status_code == 200
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in stream.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert len(text.split()) == 4
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 4

    bad = requests.post(engine.url + "/v1/completions", json={"prompt": "", "max_tokens": 3}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    too_long = requests.post(engine.url + "/v1/completions", json={"prompt": [1] * 1020, "max_tokens": 8}, timeout=10)
    assert too_long.status_code == 400 and "maximum context length is 1024" in too_long.json()["error"]["message"]
    unknown = requests.post(engine.url + "/v1/completions", json={"model": "nope", "prompt": "a", "max_tokens": 1},
                            timeout=10)
    assert unknown.status_code == 404

    metrics_text = requests.get(engine.url + "/metrics", timeout=5).text
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
                 "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "kvrepro_probe_external_hit_calls_total", "kvrepro_probe_trigger_calls_total",
                 "kvrepro_offload_load_jobs_total", "kvrepro_offload_store_jobs_total", "kvrepro_engine_steps_total"):
        assert f"# TYPE {name} " in metrics_text, name
    m = engine.metrics()
    # 5 + 80 + 80 prompt tokens were looked up in the prefix cache; the repeated 80 hit.
    assert m["vllm:prefix_cache_queries_total"] == 165
    assert m["vllm:prefix_cache_hits_total"] > 0
    assert m["kvrepro_engine_steps_total"] >= 12
    assert m["kvrepro_offload_store_jobs_total"] > 0  # 80-token prompts fill whole blocks: stored
    assert m["vllm:num_requests_running"] == 0


@pytest.mark.vllm
@pytest.mark.slow
def test_idle_engine_sleeps(start):
    engine = start("A")
    stat = Path(f"/proc/{engine.proc.pid}/stat")
    require(stat.exists(), "needs /proc")

    def cpu_seconds() -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    time.sleep(1.0)  # let start-up work settle
    before = cpu_seconds()
    time.sleep(3.0)
    assert cpu_seconds() - before < 0.3


@pytest.mark.vllm
@pytest.mark.slow
def test_target_crash_kills_the_engine_but_not_the_process(start):
    engine = start("A", seed=0)
    model = requests.get(engine.url + "/v1/models", timeout=5).json()["data"][0]["id"]
    state = shared_prefix_load(engine.url, model, requests_budget=600, seed=0)
    assert state["errors"], f"vLLM 0.26.0 survived {state['ok']} requests; the target crash never fired"
    status, body = state["errors"][0]
    assert status == 500 and body["error"]["type"] == "EngineDeadError"
    assert "EngineCore encountered an issue" in body["error"]["message"]

    assert requests.get(engine.url + "/health", timeout=5).status_code == 503
    late = requests.post(engine.url + "/v1/completions", json={"prompt": "still there", "max_tokens": 2}, timeout=10)
    assert late.status_code == 500 and late.json()["error"]["type"] == "EngineDeadError"
    m = engine.metrics()  # still served
    assert m["kvrepro_engine_dead"] == 1
    assert m["kvrepro_probe_trigger_calls_total"] >= 1
    assert engine.proc.poll() is None

    assert engine.stop() == 0
    log = engine.log()
    assert "Application startup complete." in log
    assert "kvrepro-probe: installed function=OffloadingConnectorScheduler.update_state_after_alloc" in log
    fatal = log.index("EngineCore encountered a fatal error.")
    traceback = log[fatal:]
    assert "Traceback (most recent call last):" in traceback
    assert "offloading/scheduler.py" in traceback and "in update_state_after_alloc" in traceback
    assert "AssertionError" in traceback
    assert log.count("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
                     "See stack trace (above) for the root cause.") == 1
    # The probe reported right before the crash propagated.
    assert "kvrepro-probe: counts external_hit_calls=" in log[:fatal]


@pytest.mark.vllm
@pytest.mark.slow
def test_boundary_fix_survives_and_still_loads(start, builds):
    engine = start("B", seed=0)
    model = requests.get(engine.url + "/v1/models", timeout=5).json()["data"][0]["id"]
    state = shared_prefix_load(engine.url, model, requests_budget=600, seed=0)
    assert state["errors"] == [] and state["ok"] == 600
    m = engine.metrics()
    assert m["kvrepro_probe_trigger_calls_total"] > 0  # the crash path ran ...
    assert m["kvrepro_offload_load_jobs_total"] > 0  # ... and loads from the offload tier completed
    assert m["vllm:external_prefix_cache_hits_total"] > 0
    assert requests.get(engine.url + "/health", timeout=5).status_code == 200
    assert engine.stop() == 0
    assert "EngineCore encountered a fatal error." not in engine.log()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_rejects_a_pool_too_small(start):
    """64 blocks of 16 tokens cannot hold one 4096-token request: vLLM's own check says so."""
    from kvrepro.spec import SimSettings

    args = engine_spec(max_model_len=4096, sim=SimSettings(num_gpu_blocks=64)).serve_args(str(MODEL_DIR), include_sim=True)
    engine = start("A", args=args, wait=False)
    assert engine.proc.wait(timeout=START_TIMEOUT_S) != 0
    log = engine.log()
    assert "To serve at least one request with the model's max seq len (4096)" in log
    assert "Application startup complete." not in log


@pytest.mark.vllm
@pytest.mark.slow
def test_unknown_argument_is_a_clear_error(start):
    args = engine_spec().serve_args(str(MODEL_DIR), include_sim=True) + ["--api-key", "sk-do-not-log-me"]
    engine = start("A", args=args, wait=False)
    assert engine.proc.wait(timeout=START_TIMEOUT_S) == 2
    log = engine.log()
    assert "unsupported argument(s) for the sim engine: --api-key ***" in log
    assert "sk-do-not-log-me" not in log  # a secret never reaches the log
    assert "Application startup complete." not in log


@pytest.mark.vllm
@pytest.mark.slow
def test_zygote_forks_engines_and_relays_signals(builds, tmp_path):
    """The zygote path: same engine, same log, SIGTERM forwarded, exit code relayed."""
    from kvrepro.engine.zygote import start_zygote

    socket_path = str(tmp_path / "zygote.sock")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    zygote = start_zygote(builds["python"], socket_path, env, str(tmp_path / "zygote.log"))
    args = engine_spec().serve_args(str(MODEL_DIR), include_sim=True)
    try:
        first = Engine(builds["python"], builds["A"], tmp_path / "first.log", args,
                       extra_env={"KVREPRO_ENGINE_ZYGOTE": socket_path})
        first.wait_ready()
        resp = requests.post(first.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=30)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        assert first.stop() == 0
        log = first.log()
        assert "Application startup complete." in log and "Shutdown complete." in log
        assert "no zygote answers" not in log

        # The client dies without a word: the forked engine notices and goes away too.
        second = Engine(builds["python"], builds["A"], tmp_path / "second.log", args,
                        extra_env={"KVREPRO_ENGINE_ZYGOTE": socket_path})
        second.wait_ready()
        second.proc.kill()
        second.proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                requests.get(second.url + "/health", timeout=1)
            except requests.ConnectionError:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the forked engine outlived its client")
        second.stop()
    finally:
        zygote.send_signal(signal.SIGTERM)
        assert zygote.wait(timeout=30) == 0
    assert not Path(socket_path).exists()


# -- the parts that need no vLLM ---------------------------------------------------------------

def test_sim_knobs_come_from_env_and_bad_values_are_named():
    from kvrepro.engine.config import EngineSetupError, SimKnobs

    assert SimKnobs.from_env({}) == SimKnobs(acceptance_rate=0.7, seed=0, step_delay_ms=0.0)
    knobs = SimKnobs.from_env({"KVREPRO_SIM_ACCEPTANCE_RATE": "0.25", "KVREPRO_SIM_SEED": "7",
                               "KVREPRO_SIM_STEP_DELAY_MS": "1.5"})
    assert knobs == SimKnobs(acceptance_rate=0.25, seed=7, step_delay_ms=1.5)
    with pytest.raises(EngineSetupError, match="KVREPRO_SIM_ACCEPTANCE_RATE='1.5': must be between 0.0 and 1.0"):
        SimKnobs.from_env({"KVREPRO_SIM_ACCEPTANCE_RATE": "1.5"})
    with pytest.raises(EngineSetupError, match="KVREPRO_SIM_SEED='x': not a int"):
        SimKnobs.from_env({"KVREPRO_SIM_SEED": "x"})


def test_secret_flag_values_are_redacted():
    from kvrepro.engine.config import redact

    assert redact(["--api-key", "sk-1", "--hf-token=hf_2", "--skip-tokenizer-init", "--tokenizer", "t",
                   "--block-size", "16"]) == [
        "--api-key", "***", "--hf-token=***", "--skip-tokenizer-init", "--tokenizer", "t", "--block-size", "16"]


def test_text_prompts_share_token_prefixes_like_their_words():
    from kvrepro.engine.prompts import PromptError, detokenize, prompt_to_token_ids

    a = prompt_to_token_ids("the cat sat on the mat", 1024)
    b = prompt_to_token_ids("the cat sat on a hat", 1024)
    assert len(a) == 6 and a[:4] == b[:4] and a[4:] != b[4:]
    assert a == prompt_to_token_ids("the  cat sat\non the mat", 1024)  # deterministic, whitespace-split
    assert a[0] == a[4]  # the same word, the same token
    assert prompt_to_token_ids([3, 4, 5], 1024) == [3, 4, 5]
    assert prompt_to_token_ids([[3, 4]], 1024) == [3, 4]
    for bad, why in [([], "empty"), ("", "empty"), ([1, 2048], "out of vocabulary"), ([True], "string or a list"),
                     (None, "string or a list")]:
        with pytest.raises(PromptError, match=why):
            prompt_to_token_ids(bad, 1024)
    assert detokenize([1, 22]) == " t1 t22"
