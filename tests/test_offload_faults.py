"""Offload-tier faults (``engine.sim.offload_faults``, ``engine.kv_load_failure_policy``).

The engine tests run vLLM 0.33.0's own `vllm serve`, GPU-free, over real HTTP: what each proves
comes from the engine -- its ``kvrepro-fault:`` lines (one per injected fault, a counts line), the
GPU-free engine's own counts, the shadow KV's counts, vLLM's own traceback -- not from what the
client believes. Faked, as in every sim run, because this machine has no GPU: the model executor
and the offload data movement (which is where the faults are injected). The load is two prompts,
the local prefix cache reset between phases (``reset_prefix_cache: local``), so the third and
later requests are served by offload loads.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT

from kvrepro import versions
from kvrepro.records import LoadSummary, Verdict
from kvrepro.spec.matrix import LoadSpec, OffloadFaultsSpec, RunsSpec

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

BASE = "0.33.0"

BAD_VALUES = [  # (line under engine.sim, base, engine.connector, what the one line says)
    ("    offload_faults: {load_fail_rate: 1.5}", "0.33.0", "offloading", "load_fail_rate"),
    ("    offload_faults: {load_fail_at: [0]}", "0.33.0", "offloading", "job numbers count from 1"),
    ("    offload_faults: {latency: {distribution: uniform, steps: 2}}", "0.33.0", "offloading",
     "uniform needs max_steps"),
    ("    offload_faults: {store_fail_at: [3]}", "0.33.0", "mooncake-store-like", "failed loads only"),
    ("    offload_faults: {store_fail_rate: 0.1}", "0.33.0", "nixl-like", "NIXL stores nothing"),
]


def _matrix_with(tmp_path, line: str, base: str, connector: str = "offloading"):
    text = (ROOT / "matrix.yaml").read_text().replace('base: "0.26.0"', f'base: "{base}"', 1)
    assert "\n  sim:\n" in text
    text = text.replace("\n  sim:\n", f"\n  connector: {connector}\n  sim:\n" + line + "\n", 1)
    (tmp_path / "matrix.yaml").write_text(text)
    return tmp_path / "matrix.yaml", text.splitlines().index(line) + 1


@pytest.mark.parametrize("line,base,connector,message", BAD_VALUES)
def test_a_bad_value_names_its_file_line_and_field(tmp_path, line, base, connector, message):
    from kvrepro.errors import SpecError
    from kvrepro.spec.matrix import load_matrix

    path, number = _matrix_with(tmp_path, line, base, connector)
    with pytest.raises(SpecError) as caught:
        load_matrix(path)
    text = str(caught.value)
    assert f"matrix.yaml:{number}: engine.sim.offload_faults." in text and message in text, text


def test_a_bad_value_is_one_line_and_exit_2_from_the_cli(tmp_path):
    line, base, connector, message = BAD_VALUES[-1]
    path, number = _matrix_with(tmp_path, line, base, connector)
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "validate", "--matrix", str(path)],
                          capture_output=True, text=True, cwd=ROOT)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, out
    assert f"matrix.yaml:{number}" in out and message in out, out
    assert "Traceback" not in out and len(out.splitlines()) == 2, out  # "invalid matrix:" + the one line


def test_a_failure_reporting_connector_before_0_30_is_one_line_naming_engine_connector(tmp_path):
    from kvrepro.errors import SpecError
    from kvrepro.spec.matrix import load_matrix

    path, _ = _matrix_with(tmp_path, "    offload_faults: {load_fail_rate: 0.1}", "0.26.0", "nixl-like")
    with pytest.raises(SpecError) as caught:
        load_matrix(path)
    assert "engine.connector: nixl-like models a connector's per-request report" in str(caught.value)
    assert "use base 0.30.0 or later" in str(caught.value)


def test_each_connector_takes_the_faults_its_real_counterpart_can_produce():
    """Read from the wheels (kvrepro/versions.py): vLLM's OffloadingConnector asserts on any failed
    transfer before 0.34.0 and reports from 0.34.0; the modelled connectors report failed loads from
    0.30.0 (Mooncake per block in 0.30.0) and have no store failures."""
    from kvrepro.versions import offload_fault_effect, offload_fault_problem

    for version in ("0.25.1", "0.26.0", "0.33.0", "0.34.0"):
        for kind in ("load", "store"):
            assert offload_fault_problem(version, kind, "offloading") is None
    assert "worker.py:301" in offload_fault_effect("0.33.0", "load", "offloading")
    assert "worker.py:343" in offload_fault_effect("0.26.0", "store", "capable")
    assert "never reads the tier again" in offload_fault_effect("0.34.0", "load", "offloading")
    assert "drops the store's chunks" in offload_fault_effect("0.34.0", "store", "offloading")
    for connector in ("mooncake-store-like", "nixl-like"):
        assert offload_fault_problem("0.29.0", "load", connector) is not None
        assert offload_fault_problem("0.30.0", "load", connector) is None
        assert offload_fault_problem("0.34.0", "store", connector) is not None
    assert "per block" in offload_fault_effect("0.30.0", "load", "mooncake-store-like")
    assert "per request" in offload_fault_effect("0.31.0", "load", "mooncake-store-like")
    assert "nothing asynchronously" in offload_fault_effect("0.33.0", "load", "nixl-like")


def test_a_modelled_connector_is_named_by_module_path_in_the_transfer_config():
    import json

    from kvrepro.spec.matrix import Matrix

    for connector, cls in (("mooncake-store-like", "MooncakeStoreLikeConnector"), ("nixl-like", "NixlLikeConnector")):
        m = Matrix.model_validate({"base": BASE, "builds": {"A": []}, "engine": {
            "connector": connector, "kv_load_failure_policy": "recompute"}})
        args = m.engine.serve_args("model", include_sim=True)
        transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert transfer["kv_connector"] == cls and transfer["kv_connector_module_path"] == "kvrepro.engine.load_failures"
        assert transfer["kv_load_failure_policy"] == "recompute" and "--kv-offloading-size" not in args
        assert transfer["kv_connector_extra_config"]["cpu_bytes_to_use"] == 1 << 30


def test_the_plan_fails_the_kth_job_and_a_share_and_draws_latency():
    from kvrepro.engine.faults import FaultPlan, FaultSettings, Latency

    plan = FaultPlan(FaultSettings(load_fail_at=(2, 5)))
    assert [plan.decide("load")[0] for _ in range(6)] == [False, True, False, False, True, False]
    assert [plan.decide("store")[0] for _ in range(3)] == [False] * 3
    assert plan.faults == {"load": 2, "store": 0} and plan.jobs == {"load": 6, "store": 3}
    rate = FaultPlan(FaultSettings(store_fail_rate=0.25, seed=3))
    failed = sum(rate.decide("store")[0] for _ in range(4000))
    assert 850 < failed < 1150  # 25% of 4000, seeded
    one, two = (FaultPlan(FaultSettings(store_fail_rate=0.25, seed=3)) for _ in range(2))
    assert [one.decide("store") for _ in range(50)] == [two.decide("store") for _ in range(50)]  # seeded
    uniform = FaultPlan(FaultSettings(latency=Latency("uniform", 2, 4)))
    steps = [uniform.decide("load")[1] for _ in range(300)]
    assert set(steps) == {2, 3, 4} and uniform.decide("store")[1] == 1  # latency: jobs load
    geometric = FaultPlan(FaultSettings(latency=Latency("geometric", 5, 40, jobs="both")))
    drawn = [geometric.decide("store")[1] for _ in range(4000)]
    assert 4.5 < sum(drawn) / len(drawn) < 5.5 and max(drawn) <= 40 and min(drawn) == 1


def test_the_matrix_passes_faults_and_policy_to_the_engine_under_the_names_it_reads():
    from kvrepro.engine.faults import FaultSettings, Latency
    from kvrepro.spec.matrix import Matrix

    m = Matrix.model_validate({"base": BASE, "builds": {"A": []}, "engine": {
        "kv_load_failure_policy": "recompute", "sim": {"offload_faults": {
            "load_fail_at": [1, 3], "latency": {"distribution": "uniform", "steps": 2, "max_steps": 4}, "seed": 5}}}})
    args = m.engine.serve_args("model", include_sim=True)
    assert args[args.index("--kv-transfer-config") + 1] == '{"kv_load_failure_policy": "recompute"}'
    read = FaultSettings.from_env(m.engine.sim.engine_env(rep=2))
    assert read == FaultSettings(load_fail_at=(1, 3), latency=Latency("uniform", 2, 4), seed=7)
    assert FaultSettings.from_env(Matrix.model_validate({"builds": {"A": []}}).engine.sim.engine_env(0)) is None


def test_a_read_of_blocks_a_failed_load_did_not_fill_is_corrupt_and_a_recompute_is_clean():
    """The shadow KV (stand-in specs, as tests/test_shadow_unit.py): a failed load leaves its GPU
    blocks unfilled; reading them as if loaded is a ``missing`` read, recomputing them is clean."""
    from types import SimpleNamespace as NS

    from test_shadow_unit import FullAttentionSpec, prefill, shadow

    kv, out = shadow(FullAttentionSpec)
    prefill(kv, "r1", ([1, 2, 3],))
    kv.store(0, NS(block_ids=[1, 2], group_sizes=[2], block_indices=[0]), NS(block_ids=[40, 41]))
    kv.load_failed(1, NS(block_ids=[40, 41]), NS(block_ids=[7, 8], group_sizes=[2], block_indices=[0]))
    prefill(kv, "r2", ([7, 8, 9],), computed=0)  # vLLM's recompute: computed tokens 0, writes 7 and 8 first
    assert kv.violations == 0
    kv.load_failed(2, NS(block_ids=[40, 41]), NS(block_ids=[4, 5], group_sizes=[2], block_indices=[0]))
    prefill(kv, "r3", ([4, 5, 6],), computed=8)  # read as if the load had filled them
    assert kv.violations == 1 and list(kv.by_kind) == ["full_attention/missing/hit"]
    assert "a failed offload load (job 2, injected fault) left it unfilled" in out.getvalue()


def test_a_request_failed_on_purpose_is_not_a_failed_request_but_other_failures_still_are():
    from kvrepro.classify.exposure import read_exposure
    from kvrepro.classify.verdict import decide
    from kvrepro.classify.records import Classification
    from kvrepro.records import Outcome

    log = ("(EngineCore pid=7) INFO 12-02 [executor.py:130] kvrepro-fault: load job 8 failed on purpose (load #1, "
           "request cmpl-kvrepro-2-0-a7, policy fail, 9 GPU blocks not filled: 25,27)\n")
    exposure = read_exposure(log)
    assert (exposure.injected_load_faults, exposure.injected_failed_requests) == (1, 1)
    none = Classification(outcome=Outcome.NONE, title="")
    load = LoadSummary(requests_sent=6, requests_ok=5, requests_failed=1, seconds=1.0, stopped_because="budget")
    assert decide(none, exposure, load, None) is Verdict.VACUOUS
    assert decide(none, read_exposure(""), load, None) is Verdict.INFRA  # the same failure, not injected
    recompute = read_exposure(log.replace("policy fail", "policy recompute"))
    assert recompute.injected_load_faults == 1 and recompute.injected_failed_requests == 0


# ---------------------------------------------------------------- against the real engine

@pytest.fixture(scope="module")
def target():
    """One sim target for the module's engines: they fork from one engine zygote (vLLM imported once)."""
    from kvrepro.deploy.sim import SimTarget
    from kvrepro.spec.matrix import load_matrix

    sim = SimTarget(load_matrix(ROOT / "matrix.yaml"))
    yield sim
    sim.close()


def _start(target, tmp_path_factory, name: str, policy: str | None, faults: OffloadFaultsSpec,
           connector: str = "mooncake-store-like", base: str = BASE):
    """vLLM ``base`` (0.33.0), no patches, the default engine otherwise, with these faults and this
    connector (set on the typed matrix). The target reads its matrix when it starts an engine, so
    each engine gets its own."""
    from kvrepro.spec.matrix import LoadedMatrix, load_matrix

    loaded = load_matrix(ROOT / "matrix.yaml")
    m = loaded.matrix
    eng = m.engine.model_copy(update={"kv_load_failure_policy": policy, "connector": connector,
                                      "sim": m.engine.sim.model_copy(update={"offload_faults": faults})})
    m = m.model_copy(update={"engine": eng, "base": base, "builds": {"A": []}, "common": [], "expect": {}})
    target.loaded = LoadedMatrix(m, loaded.path, loaded.text)
    artifact = target.prepare(next(p for p in target.loaded.plans() if p.name == "A"))
    assert artifact.ok, artifact.error
    run_dir = tmp_path_factory.mktemp(name)
    return target.start(artifact, run_dir, 0), run_dir


@pytest.fixture(scope="module")
def recompute_engine(target, tmp_path_factory):
    """Loads #1 and #2 fail, policy recompute, every load takes 3-5 steps; the connector reports
    them as Mooncake store does and looks the request up again on the retry."""
    faults = OffloadFaultsSpec(load_fail_at=[1, 2], latency={"distribution": "uniform", "steps": 3, "max_steps": 5})
    handle, run_dir = _start(target, tmp_path_factory, "recompute", "recompute", faults)
    yield handle, run_dir
    handle.stop()


@pytest.fixture(scope="module")
def fail_engine(target, tmp_path_factory):
    """Load #1 fails, policy fail (vLLM's default), reported as Mooncake store does."""
    handle, run_dir = _start(target, tmp_path_factory, "fail", "fail", OffloadFaultsSpec(load_fail_at=[1]))
    yield handle, run_dir
    handle.stop()


def _load(handle, tmp_path, requests=6):
    from kvrepro.loadgen.runner import run_load

    load = LoadSpec.model_validate({
        "profile": "shared_prefix", "concurrency": 1, "max_tokens": 8, "documents": 2, "document_tokens": 128,
        "min_prefix_tokens": 128, "suffix_tokens": [0, 0], "seed": 3,
        "events": [{"at": 2, "every": 2, "reset_prefix_cache": "local"}]})
    return run_load(handle.base_url, load, RunsSpec(requests=requests, duration_s=60), tmp_path / "load.jsonl",
                    seed=1, alive=handle.alive)


def _settled_log(run_dir, *needles: str) -> str:
    """The engine log once its counts lines (written every 0.5-2 s) carry the run."""
    deadline = time.monotonic() + 10
    while True:
        log = (run_dir / "engine.log").read_text(errors="replace")
        if all(n in log for n in needles) or time.monotonic() > deadline:
            return log
        time.sleep(0.5)


def _last(log: str, pattern: str) -> dict[str, int]:
    found = re.findall(pattern, log)
    assert found, pattern
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", found[-1])}


def test_failed_loads_under_recompute_are_recomputed_clean(recompute_engine, tmp_path):
    from kvrepro.classify.judge import judge

    handle, run_dir = recompute_engine
    summary = _load(handle, tmp_path)
    assert (summary.requests_ok, summary.requests_failed, summary.stopped_because) == (6, 0, "budget")
    log = _settled_log(run_dir, "load_faults=2", "full_attention+offload")
    faults = re.findall(r"kvrepro-fault: load job \d+ failed on purpose \(load #(\d+), request cmpl-kvrepro-(\d+)-"
                        r"\S+, policy recompute, (\d+) GPU blocks not filled", log)
    assert [(k, int(n) > 0) for k, _, n in faults] == [("1", True), ("2", True)], log[-3000:]
    counts = _last(log, r"kvrepro-fault: counts .*")
    assert counts["load_faults"] == 2 and counts["load_jobs"] >= 3  # the retry's load after the recompute
    assert 3 * counts["load_jobs"] <= counts["load_steps_total"] <= 5 * counts["load_jobs"]  # the latency
    shadow = re.findall(r"kvrepro-shadow: counts checks=(\d+) violations=(\d+) .*hits=(\S+)", log)[-1]
    assert int(shadow[0]) > 0 and shadow[1] == "0" and "full_attention+offload" in shadow[2], shadow
    judged = judge(log, load=summary)
    assert judged.exposure.injected_load_faults == 2 and judged.exposure.kv_violations == 0
    assert judged.verdict in (Verdict.SURVIVED, Verdict.UNREACHED, Verdict.VACUOUS), judged.title


def test_a_failed_load_under_fail_ends_its_request_and_is_not_a_defect(fail_engine, tmp_path):
    from kvrepro.classify.judge import judge

    handle, run_dir = fail_engine
    summary = _load(handle, tmp_path)
    import json

    lines = [json.loads(x) for x in (tmp_path / "load.jsonl").read_text().splitlines()]
    failed = [r["index"] for r in lines if r.get("ok") is False]
    assert summary.requests_failed == 1 and summary.stopped_because == "budget" and handle.alive()
    log = _settled_log(run_dir, "failed_requests=1")
    named = re.findall(r"kvrepro-fault: load job \d+ failed on purpose \(load #1, request cmpl-kvrepro-(\d+)-", log)
    assert [int(i) for i in named] == failed, (named, failed)  # the request that failed is the one the fault hit
    judged = judge(log, load=summary)
    assert judged.exposure.injected_failed_requests == 1
    assert judged.verdict is not Verdict.INFRA, judged.title  # 1 of 6 failed, on purpose
    assert judge(log.replace("kvrepro-fault:", "kvrepro-xxxxx:"), load=summary).verdict is Verdict.INFRA


def test_a_failed_load_kills_the_engine_on_the_offloading_connectors_own_assertion(target, tmp_path_factory,
                                                                                  tmp_path):
    """What a failed load does with vLLM 0.33.0's own OffloadingConnector: its worker dies on
    ``assert transfer_result.success`` -- the line versions.py names (a failed store dies there too)."""
    from kvrepro.classify.judge import judge

    handle, run_dir = _start(target, tmp_path_factory, "plain", "recompute", OffloadFaultsSpec(load_fail_at=[1]),
                             connector="offloading")
    try:
        summary = _load(handle, tmp_path, requests=4)  # request 2 is the first served by a load
        _settled_log(run_dir, "transfer_result.success")  # the API server stays up (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH)
    finally:
        handle.stop()
    log = (run_dir / "engine.log").read_text(errors="replace")
    assert re.search(r"kvrepro-fault: load job \d+ failed on purpose \(load #1, ", log)
    assert "connector offloading; load: the engine dies on assert transfer_result.success" in log
    assert f"offloading/worker.py\", line {versions.OFFLOAD_TRANSFER_ASSERT_LINE[BASE]}, in get_finished" in log
    judged = judge(log, load=summary, engine_exit=1)
    assert judged.verdict is Verdict.CRASH and judged.exposure.injected_load_faults == 1
    assert judged.title == "AssertionError in get_finished: transfer_result.success", judged.title


def test_a_failed_load_on_0_34_is_reported_once_by_the_offloading_connector_itself(target, tmp_path_factory,
                                                                                  tmp_path):
    """0.34.0's OffloadingConnector takes a failed copy (``TransferResult(success=False)``) and turns it
    into the request's failed_recving itself (offloading/worker.py 0.34.0:306-316): the engine reports
    the failure to it once, as the copy, and adds no report of its own -- vLLM's scheduler side logs
    the job once and never reads the tier for that request again; nothing asserts, nothing fails."""
    handle, run_dir = _start(target, tmp_path_factory, "plain-0.34", "recompute", OffloadFaultsSpec(load_fail_at=[1]),
                             connector="offloading", base="0.34.0")
    try:
        summary = _load(handle, tmp_path, requests=4)
        log = _settled_log(run_dir, "will not load from the offloaded cache again")
    finally:
        handle.stop()
    injected = re.findall(r"kvrepro-fault: load job (\d+) failed on purpose \(load #1, ", log)
    reported = re.findall(r"KV offload load job (\d+) failed; request \S+ will not load from the offloaded cache again", log)
    assert len(injected) == 1 and reported == injected, (injected, reported)
    assert "the OffloadingConnector reports the failed load" in log
    assert "transfer_result.success" not in log and "Traceback" not in log
    assert (summary.requests_ok, summary.requests_failed) == (4, 0)
