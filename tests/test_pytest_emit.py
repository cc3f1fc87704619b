"""The test `kvrepro minimize --emit-pytest` writes: a standalone file that drives vLLM's scheduler.

The first tests read the emitted text only (no vLLM). The last ones run it: a shipped minimized
trace (6 requests, from the default matrix's A, rep 0) is emitted with the geometry vLLM reports
from the offline engine of A and D, then run with each build's vLLM in the runtime env, as a
script and under pytest: it must fail on A with vLLM's target AssertionError and pass on D.
They need the runtime env and the overlays, which the fixtures build (CI runs `kvrepro setup`
first); when they cannot, the fixtures error, so nothing here passes by skipping.
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require

from kvrepro.loadgen.trace import Trace, TraceHeader, TraceRequest, read_trace
from kvrepro.minimize.pytest_emit import EngineInfo
from kvrepro.minimize.pytest_emit import _prompt_statements, render
from kvrepro.minimize.shrink import PytestCheck

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "data" / "traces" / "minimized-A.trace.jsonl"

# what kvrepro.engine.offline.describe() reports for the default matrix on vLLM 0.26.0
ENGINE_JSON = {
    "vllm": "0.26.0", "max_model_len": 1024, "dtype": "bfloat16", "vocab_size": 1024, "block_size": 16,
    "mamba_cache_mode": "align", "enable_prefix_caching": True, "prefix_caching_hash_algo": "sha256",
    "num_gpu_blocks": 96, "max_num_seqs": 4, "max_num_batched_tokens": 2048, "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 0, "async_scheduling": False, "disable_hybrid_kv_cache_manager": False,
    "speculative": {"method": "mtp", "num_speculative_tokens": 1},
    "kv_transfer": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": 1073741824.0}},
    "scheduler_block_size": 16, "hash_block_size": 16,
    "kv_cache_groups": [
        {"layer_names": ["model.layers.0.linear_attn", "model.layers.2.linear_attn"],
         "spec": "MambaSpec(block_size=16, shapes=((4, 128), (4, 16, 16)), dtypes=(torch.bfloat16, "
                 "torch.bfloat16), page_size_padded=4096, mamba_type=MambaAttentionBackendEnum.GDN_ATTN, "
                 "mamba_cache_mode='align', num_speculative_blocks=1)"},
        {"layer_names": ["model.layers.3.self_attn.attn", "mtp.layers.4.self_attn.attn"],
         "spec": "FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, head_size_v=32)"},
    ],
    "kv_cache_tensors": [{"size": 393216, "shared_by": ["model.layers.0.linear_attn", "model.layers.3.self_attn.attn"]}],
    "spec_imports": ["torch", "vllm.v1.attention.backends.registry.MambaAttentionBackendEnum",
                     "vllm.v1.kv_cache_interface.FullAttentionSpec", "vllm.v1.kv_cache_interface.MambaSpec"],
}
ENGINE = EngineInfo.from_json(ENGINE_JSON)


def _text(default_matrix, trace: Trace) -> str:
    return render(trace, default_matrix, ENGINE, "test_repro.py",
                  {"A": ("/rt/bin/python", "/overlays/a", "build A: fails (the bug)"),
                   "D": ("/rt/bin/python", "/overlays/d", "build D: passes (fixed)")})


def test_the_emitted_test_imports_only_vllm_torch_and_the_standard_library(default_matrix):
    text = _text(default_matrix, read_trace(TRACE))
    tree = ast.parse(text)
    top = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            top.add((node.module or "").split(".")[0])
    assert top - set(sys.stdlib_module_names) == {"vllm", "torch"}
    assert "kvrepro" not in text.split('"""', 2)[2]  # the code; the docstring may name the tool
    assert "def test_offload_hit_behind_partial_local_hit(tmp_path)" in text
    assert any(isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'" for n in tree.body)


def test_the_header_says_how_to_run_it_with_each_build(default_matrix):
    doc = ast.get_docstring(ast.parse(_text(default_matrix, read_trace(TRACE))))
    assert "VLLM_PLUGINS= PYTHONPATH=/overlays/a /rt/bin/python test_repro.py" in doc
    assert "VLLM_PLUGINS= PYTHONPATH=/overlays/d /rt/bin/python test_repro.py" in doc
    assert "OffloadingConnectorScheduler.update_state_after_alloc" in doc
    assert "6 requests" in doc


def test_the_settings_and_groups_vllm_reported_are_written_as_literals(default_matrix):
    text = _text(default_matrix, read_trace(TRACE))
    assert "NUM_GPU_BLOCKS = 96" in text
    assert "SEED = 0" in text
    assert "DRAFT_ACCEPTANCE_RATE = 0.7" in text
    assert "mamba_cache_mode='align'" in text
    assert "SpeculativeConfig(method='mtp', num_speculative_tokens=1" in text
    assert "{'cpu_bytes_to_use': 1073741824.0}" in text
    assert "num_speculative_blocks=1" in text and "num_kv_heads=2" in text and "FullAttentionSpec(" in text


def test_prompts_are_written_as_slices_of_earlier_prompts_and_read_back_exactly():
    shared = list(range(100, 164))
    prompts = [shared + [1, 2, 3], [7], shared[:48], shared + [1, 2, 3, 9], list(range(500, 540))]
    source = "P = []\n" + ast.unparse(ast.fix_missing_locations(ast.Module(_prompt_statements(prompts), [])))
    namespace: dict = {}
    exec(source, namespace)
    assert namespace["P"] == prompts
    assert "P.append(P[0][:48])" in source
    assert "P.append(P[0][:67] + [" in source  # the longest shared prefix, not the first one


def test_the_seed_is_the_repetition_s(default_matrix):
    trace = Trace(TRACE, TraceHeader(rep=2), [TraceRequest(index=0, tokens=(5, 6, 7), max_tokens=3)])
    text = _text(default_matrix, trace)
    assert f"SEED = {default_matrix.matrix.engine.sim.seed + 2}" in text
    assert "REQUESTS = [(3, P[0])]" in text


# --------------------------------------------------------------------------- run with vLLM


@pytest.fixture(scope="module")
def emitted(default_matrix, overlays, tmp_path_factory):
    """The shipped trace emitted and checked the way `kvrepro minimize` does it."""
    return _emit_checked(tmp_path_factory.mktemp("emit") / "test_offload_repro.py", TRACE, default_matrix, "A", "D")


def _emit_checked(path, trace, matrix, failing: str, passing: str):
    """Emit ``trace`` as a pytest at ``path`` and run it on the builds ``failing`` and ``passing``,
    as `kvrepro minimize --emit-pytest` does; the path, the summary and each build's python and path."""
    from kvrepro.minimize.shrink import OfflineEngine, _emit_and_check

    engines = {name: OfflineEngine(matrix, name, 0) for name in (failing, passing)}
    try:
        summary = _emit_and_check(path, read_trace(trace), matrix, failing, engines[failing], passing,
                                  engines[passing], lambda line: None)
    finally:
        for e in engines.values():
            e.close()
    return path, summary, {name: (e.command[0], e.test_pythonpath) for name, e in engines.items()}


def test_the_emitted_test_fails_on_a_with_the_target_assertion_and_passes_on_d(emitted):
    path, summary, _ = emitted
    check = summary.pytest_check
    assert check["A"] == PytestCheck(ok=True, result="fails with the target signature", exit=1), check
    assert check["D"] == PytestCheck(ok=True, result="passes", exit=0), check
    assert summary.pytest == str(path)


def test_the_engine_reported_the_geometry_the_test_rebuilds(emitted):
    path, _, _ = emitted
    text = path.read_text()
    tree = ast.parse(text)
    groups = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "KV_CACHE_GROUPS")
    written = [(ast.literal_eval(g.elts[0]), g.elts[1].func.id) for g in groups.elts]
    # two Mamba groups (3 Gated-DeltaNet layers) and one full-attention group with the MTP layer
    assert (["model.layers.0.linear_attn", "model.layers.2.linear_attn"], "MambaSpec") in written
    assert (["model.layers.1.linear_attn"], "MambaSpec") in written
    assert (["model.layers.3.self_attn.attn", "mtp.layers.4.self_attn.attn"], "FullAttentionSpec") in written
    assert "NUM_GPU_BLOCKS = 96" in text


def _pytest_folder(tmp_path: Path) -> Path:
    """pytest for the runtime env (which has none): links to this environment's pure-Python
    pytest and its dependencies (same Python version)."""
    import _pytest
    import iniconfig
    import pluggy

    folder = tmp_path / "pytest-only"
    folder.mkdir()
    for module in (pytest, _pytest, pluggy, iniconfig):
        source = Path(module.__file__).parent
        (folder / source.name).symlink_to(source)
    py_shim = Path(pytest.__file__).parents[1] / "py.py"
    if py_shim.exists():
        (folder / "py.py").symlink_to(py_shim)
    return folder


def _pytest_on(scripts, run: tuple, path, tmp_path) -> subprocess.CompletedProcess:
    """The emitted test under a plain pytest with one build's python and vllm/ (``run``), as upstream
    would, forked from the worker's shared zygote (conftest's runtime_scripts: torch imported there,
    vLLM not). That the file needs nothing of kvrepro is checked where nothing of it is loaded: its
    imports statically, and a fresh interpreter of the runtime env (the kvrepro-import test below);
    `kvrepro minimize` itself confirms the file in a fresh interpreter (pytest_check)."""
    python, pythonpath = run
    env = {"PATH": "/usr/bin:/bin", "VLLM_PLUGINS": "", "VLLM_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": f"{pythonpath}:{_pytest_folder(tmp_path)}"}
    return scripts.run(python, ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)], cwd=tmp_path, env=env,
                       timeout=600)


@pytest.mark.parametrize("build, outcome", [("A", "1 failed"), ("D", "1 passed")])
def test_under_pytest_it_fails_on_a_and_passes_on_d(emitted, build, outcome, tmp_path, runtime_scripts):
    path, _, runs = emitted
    proc = _pytest_on(runtime_scripts, runs[build], path, tmp_path)
    assert outcome in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    if build == "A":
        assert "AssertionError" in proc.stdout and "update_state_after_alloc" in proc.stdout
        assert "scheduling request 5 of 6" in proc.stdout


def test_the_runtime_env_cannot_import_kvrepro(emitted):
    """The emitted test runs where kvrepro is not importable: what passes there needs no kvrepro."""
    _, _, runs = emitted
    python, pythonpath = runs["A"]
    proc = subprocess.run([python, "-c", "import kvrepro"], env={"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin"},
                          cwd="/", capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "No module named 'kvrepro'" in proc.stderr, json.dumps(proc.__dict__, default=str)


# --------------------------------------------------------------------------- the corruption test

CORRUPT_TRACE = ROOT / "tests" / "data" / "traces" / "minimized-B-corrupt.trace.jsonl"
FA_OFFLOAD = "full_attention+offload"


def _corrupt_text(default_matrix) -> str:
    return render(read_trace(CORRUPT_TRACE), default_matrix, ENGINE, "test_repro.py",
                  {"B": ("/rt/bin/python", "/overlays/b", "build B: fails (the bug)"),
                   "E": ("/rt/bin/python", "/overlays/e", "build E: passes (fixed)")},
                  violation=FA_OFFLOAD, first_violation="request req-3 group 2 (full_attention) block index 43 ...")


def test_the_corruption_test_imports_only_vllm_torch_and_the_standard_library(default_matrix):
    text = _corrupt_text(default_matrix)
    tree = ast.parse(text)
    top = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            top.add((node.module or "").split(".")[0])
    assert top - set(sys.stdlib_module_names) == {"vllm", "torch"}
    assert "def test_no_wrong_kv_read(tmp_path)" in text
    assert "def test_offload_hit_behind_partial_local_hit" not in text
    # every import is at the top (the inlined shadow KV's own imports joined the test's)
    first_def = next(n.lineno for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr)))
    assert all(n.lineno < first_def for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
    assert text.count("import atexit") == 1


def test_the_corruption_test_inlines_the_shadow_kv_verbatim(default_matrix):
    """One source of truth: the code of kvrepro/engine/shadow.py (all of it after its imports) is
    in the emitted file as the same syntax tree, statement for statement and in order, so the test
    checks exactly as the engine does."""
    from kvrepro.engine import shadow

    text = _corrupt_text(default_matrix)
    source = ast.parse(Path(shadow.__file__).read_text())
    ours = [ast.dump(n) for n in source.body if not isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr))]
    tree = ast.parse(text)
    dumped = [ast.dump(n) for n in tree.body]
    start = dumped.index(ours[0])
    assert dumped[start:start + len(ours)] == ours
    for name in ("ShadowKV", "Content", "describe_groups", "_Request", "_extend"):
        assert sum(isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name for n in tree.body) == 1, name
    assert f"sha256 {hashlib.sha256(Path(shadow.__file__).read_bytes()).hexdigest()[:16]}" in text
    doc = ast.get_docstring(ast.parse(text))
    assert "reads wrong KV (full_attention+offload)" in doc and "shadow KV" in doc
    assert "VLLM_PLUGINS= PYTHONPATH=/overlays/e /rt/bin/python test_repro.py" in doc
    assert "request req-3 group 2 (full_attention) block index 43" in doc


def test_the_corruption_test_hooks_the_shadow_where_the_executor_does(default_matrix):
    text = _corrupt_text(default_matrix)
    for hook in ("self.shadow.store(job_id, device_blocks(src_spec), dst_spec)",
                 "self.shadow.load(job_id, src_spec, device_blocks(dst_spec))",
                 "self.shadow.update_requests(so)",
                 "self.shadow.forward(req_id, computed[req_id], so.num_scheduled_tokens[req_id], spec)",
                 "self.shadow.sampled(req_id, out, seq_end)",
                 "ShadowKV(kv_cache_config, blocks_per_chunk=connector_worker.spec.blocks_per_chunk)",
                 "shadow.load_owner = lambda job_id: connector_worker._load_jobs.get(job_id)"):
        assert text.count(hook) == 1, hook
    # the forward is checked before the model samples, as SimRunner._forward does
    assert text.index("self.shadow.forward(") < text.index("if seq_end < len(tokens):")


def test_the_test_steps_the_scheduler_in_the_engine_mode_of_the_run(default_matrix):
    """An asynchronous run's sequence is stepped as EngineCore.step_with_batch_queue steps the
    release's AsyncScheduler (a 4-request cut of 0.26.0's crash, stepped synchronously, reached no
    offload hit at all); a synchronous run's as EngineCore.step does. The docstring says which."""
    trace = read_trace(TRACE)
    runs = {"A": ("/rt/bin/python", "/overlays/a", "build A: fails (the bug)")}
    sync = render(trace, default_matrix, ENGINE, "test_repro.py", runs)
    on = render(trace, default_matrix, EngineInfo.from_json({**ENGINE_JSON, "async_scheduling": True}),
                "test_repro.py", runs)
    assert "ASYNC_SCHEDULING = False" in sync and "Engine mode: synchronous scheduling" in sync
    assert "ASYNC_SCHEDULING = True" in on and "Engine mode: asynchronous scheduling" in on
    assert "AsyncScheduler" in on and "step_with_batch_queue" in on
    for text in (sync, on):
        compile(text, "test_repro.py", "exec")
        # the release picks the scheduler class and the batch queue, as EngineCore does
        assert "vllm_config.scheduler_config.get_scheduler_cls()(" in text
        assert "batch_queue_size = vllm_config.max_concurrent_batches" in text
        assert "async_scheduling=ASYNC_SCHEDULING)" in text
    corrupt = render(read_trace(CORRUPT_TRACE), default_matrix,
                     EngineInfo.from_json({**ENGINE_JSON, "async_scheduling": True}), "test_repro.py", runs,
                     violation=FA_OFFLOAD, first_violation="...")
    compile(corrupt, "test_repro.py", "exec")
    # the shadow KV follows a request re-read from the scheduler, as the executor's runner does
    assert corrupt.count("self.shadow.resync(req_id, tokens)") == 1
    assert "Engine mode: asynchronous scheduling" in corrupt


def test_the_crash_test_has_no_shadow_kv(default_matrix):
    text = _text(default_matrix, read_trace(TRACE))
    assert "ShadowKV" not in text and "self.shadow" not in text


@pytest.fixture(scope="module")
def emitted_corruption(default_matrix, overlays, tmp_path_factory):
    """The shipped corrupt trace (4 requests, minimized from a default-matrix B run) emitted and
    checked the way `kvrepro minimize --violation full_attention+offload` does it: on B, and on
    E when matrix.yaml has it."""
    from kvrepro.minimize.shrink import OfflineEngine, _emit_and_check

    path = tmp_path_factory.mktemp("emit-corrupt") / "test_offload_corruption.py"
    names = ["B"] + (["E"] if "E" in default_matrix.matrix.builds else [])
    engines = {name: OfflineEngine(default_matrix, name, 0) for name in names}
    try:
        summary = _emit_and_check(path, read_trace(CORRUPT_TRACE), default_matrix, "B", engines["B"],
                                  names[-1] if len(names) > 1 else None, engines.get("E"), lambda line: None,
                                  FA_OFFLOAD, "request req-3 group 2 (full_attention) ...")
    finally:
        for e in engines.values():
            e.close()
    return path, summary, {name: (e.command[0], e.test_pythonpath) for name, e in engines.items()}


def test_the_corruption_test_fails_on_b_naming_the_stale_block(emitted_corruption):
    _, summary, _ = emitted_corruption
    check = summary.pytest_check["B"]
    assert check.ok is True and check.exit == 1, check
    assert check.result.startswith("fails with the shadow KV's assertion on a full_attention+offload violation: "
                                      "[full_attention+offload] step ")
    assert check.message.startswith("a forward read wrong KV: ")
    line = next(x for x in check.message.splitlines() if x.startswith("[full_attention+offload] "))
    assert line in check.result
    # request, group, block index, GPU block, positions, what the block holds
    assert "request req-3 group 2 (full_attention) block index 43 (GPU block " in line
    assert "positions 688-703 expected with this request's tokens; stale KV: " in line


def test_the_corruption_test_passes_on_e(emitted_corruption):
    _, summary, _ = emitted_corruption
    require("E" in summary.pytest_check, "matrix.yaml has no build E (the backports of #48425/#50344)")
    assert summary.pytest_check["E"] == PytestCheck(ok=True, result="passes", exit=0)


def test_under_pytest_the_corruption_test_fails_on_b_with_the_message(emitted_corruption, tmp_path, runtime_scripts):
    path, _, runs = emitted_corruption
    proc = _pytest_on(runtime_scripts, runs["B"], path, tmp_path)
    assert "1 failed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "AssertionError: a forward read wrong KV" in proc.stdout
    assert "[full_attention+offload] step " in proc.stdout and "(GPU block " in proc.stdout


def test_a_corruption_without_offload_hit_does_not_require_one(default_matrix):
    """A Mamba state read from the null block happens on requests without an offload hit: the
    clean build passes without one (the reach check is for `+offload` kinds)."""
    offload = _corrupt_text(default_matrix)
    plain = render(read_trace(CORRUPT_TRACE), default_matrix, ENGINE, "test_repro.py", {}, violation="mamba")
    assert "assert hits, " in offload and "assert hits, " not in plain
    assert "assert not shadow.violations, wrong_kv(shadow)" in plain
    assert ast.get_docstring(ast.parse(plain)).startswith("Regression test: vLLM 0.26.0 reads wrong KV (mamba)")


# --------------------------------------------------------------------------- the queued-abort test (#49118)

QUEUED_ABORT_TRACE = ROOT / "tests" / "data" / "traces" / "minimized-queued-abort-49118.trace.jsonl"


@pytest.fixture(scope="module")
def queued_abort_matrix():
    from kvrepro.spec.matrix import load_matrix

    return load_matrix(ROOT / "examples" / "queued-abort.yaml")


def test_a_minimized_queued_abort_keeps_its_abort_in_the_emitted_test(queued_abort_matrix):
    """The shipped #49118 trace (2 requests, from `kvrepro minimize` of examples/queued-abort.yaml's
    `released`): its rider is still a queued abort, and the emitted test aborts it and tells that
    story, not the offload-hit one (which it has no check for)."""
    trace = read_trace(QUEUED_ABORT_TRACE)
    assert [r.events.abort if r.events else None for r in trace.requests] == [None, "queued"]
    text = render(trace, queued_abort_matrix, EngineInfo.from_json({**ENGINE_JSON, "speculative": None}),
                  "test_repro.py", {})
    assert "REQUESTS = [(16, P[0]), (1, P[1], 'abort-queued')]" in text
    doc = ast.get_docstring(ast.parse(text))
    assert "still queued (never scheduled" in doc and "offload hit sits behind" not in doc
    assert "offload-hit-behind" not in doc and "no offload hit behind a local prefix hit" not in text


@pytest.fixture(scope="module")
def emitted_queued_abort(queued_abort_matrix, runtime_python, tmp_path_factory):
    """The shipped #49118 trace emitted and run the way `kvrepro minimize --emit-pytest` does it, with
    0.26.0 as released (`released`) and with pr-49146 (`fixed`)."""
    return _emit_checked(tmp_path_factory.mktemp("emit-abort") / "test_queued_abort.py", QUEUED_ABORT_TRACE,
                         queued_abort_matrix, "released", "fixed")


def test_the_queued_abort_test_fails_on_0_26_0_and_passes_with_pr_49146(emitted_queued_abort):
    _, summary, _ = emitted_queued_abort
    assert summary.pytest_check["released"] == PytestCheck(ok=True, result="fails with the target signature",
                                                           exit=1), summary.pytest_check
    assert summary.pytest_check["fixed"] == PytestCheck(ok=True, result="passes", exit=0), summary.pytest_check


def test_under_pytest_the_queued_abort_test_fails_in_build_store_jobs(emitted_queued_abort, tmp_path,
                                                                      runtime_scripts):
    path, _, runs = emitted_queued_abort
    proc = _pytest_on(runtime_scripts, runs["released"], path, tmp_path)
    assert "1 failed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "_build_store_jobs" in proc.stdout and "len(offload_keys) == len(offload_block_ids)" in proc.stdout
