"""engine.geometry: validated like every field, turned into a model config and `vllm serve` flags,
and what vLLM builds from them (KV-cache groups, block, offload chunk) is what was asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT
from kvrepro.errors import SpecError
from kvrepro.spec.geometry import generated_config, layer_plan, materialize
from kvrepro.loadgen.capacity import engine_capacity
from kvrepro.spec.matrix import LoadSpec, load_matrix
from kvrepro.versions import hybrid_kv_groups

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

TEMPLATE = ROOT / "kvrepro" / "data" / "models" / "qwen3-next-tiny"
EXAMPLE = ROOT / "examples" / "production-geometry.yaml"
HEAD = 'base: "0.26.0"\nbuilds:\n  A: []\nengine:\n'


def _error(text: str, tmp_path: Path) -> str:
    path = tmp_path / "matrix.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_matrix(path)
    return str(info.value)


def _problems(msg: str) -> list[str]:
    return [line.strip() for line in msg.splitlines()[1:] if line.strip()]


# -- validation: one bad value, one line naming file:line and the field ------------------------------

@pytest.mark.parametrize("geometry, line, field, words", [
    ("    offload_chunk_tokens: 3000\n", 8, "engine.geometry.offload_chunk_tokens", "not a multiple of the block size 2128"),
    ("    mamba_groups: -1\n", 8, "engine.geometry.mamba_groups", "greater than or equal to 0"),
    ("    mamba_groups: 3\n    full_attention_groups: 2\n", 9, "engine.geometry.full_attention_groups",
     "one kind forms exactly one group"),
    ("    data_parallel_size: 0\n", 8, "engine.geometry.data_parallel_size", "greater than or equal to 1"),
    ("    num_speculative_tokens: many\n", 8, "engine.geometry.num_speculative_tokens", "integer"),
    ("    mamba_grups: 3\n", 8, "engine.geometry.mamba_grups", "unknown field; allowed here: block_size"),
])
def test_a_bad_geometry_value_is_one_error_line(tmp_path, geometry, line, field, words):
    text = HEAD + "  max_num_batched_tokens: 8192\n  geometry:\n    block_size: 2128\n" + geometry
    problems = _problems(_error(text, tmp_path))
    assert len(problems) == 1, problems
    where = f"{tmp_path / 'matrix.yaml'}:{line}: {field}: "
    assert problems[0].startswith(where), problems[0]
    assert words in problems[0], problems[0]


def test_block_size_against_vllms_own_limits(tmp_path):
    msg = _error(HEAD + "  geometry:\n    block_size: 2128\n", tmp_path)  # max_num_batched_tokens 2048
    assert ": engine.max_num_batched_tokens: 2048 is below the block size 2128" in msg
    msg = _error(HEAD + "  geometry:\n    block_size: 100\n", tmp_path)
    assert ":6: engine.geometry.block_size: 100 is not a multiple of 16" in msg


def test_one_value_in_one_place(tmp_path):
    msg = _error(HEAD + "  block_size: 16\n  geometry:\n    block_size: 32\n", tmp_path)
    assert ":7: engine.geometry.block_size: 32, but engine.block_size says 16" in msg
    msg = _error(HEAD + "  extra_args: [--data-parallel-size, '2']\n  geometry:\n    mamba_groups: 3\n", tmp_path)
    assert ":5: engine.extra_args.0: --data-parallel-size is set by engine.geometry" in msg


def test_geometry_values_become_the_engines_and_its_flags():
    engine = load_matrix(EXAMPLE).matrix.engine
    assert engine.block_size == 2128 and engine.num_speculative_tokens == 1
    assert engine.offload_chunk_tokens == 2128 and engine.data_parallel_size == 4
    args = engine.serve_args("m", include_sim=True)
    assert args[args.index("--block-size") + 1] == "2128"
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer == {"kv_connector_extra_config": {"block_size": 2128}}
    assert args[args.index("--data-parallel-size") + 1] == "4"
    # the four ranks behind one API server: vLLM would spawn four, each importing torch again
    assert args[args.index("--api-server-count") + 1] == "1"
    own = engine.model_copy(update={"extra_args": ["--api-server-count=2"]})  # the matrix's own choice wins
    assert own.serve_args("m", include_sim=True)[-1] == "--api-server-count=2"
    assert "--api-server-count" not in own.serve_args("m", include_sim=True)


def test_without_geometry_nothing_changes():
    loaded = load_matrix(ROOT / "matrix.yaml")
    engine = loaded.matrix.engine
    assert engine.geometry is None and engine.offload_chunk_tokens == engine.block_size == 16
    args = engine.serve_args("m", include_sim=True)
    assert "--kv-transfer-config" not in args and "--data-parallel-size" not in args
    assert loaded.model_dir() == TEMPLATE.resolve()


# -- the layer layout ------------------------------------------------------------------------------

@pytest.mark.parametrize("mamba, full, draft", [
    (m, 1, d) for m in range(0, 7) for d in (0, 1)] + [(1, f, d) for f in range(2, 6) for d in (0, 1)])
def test_layer_plan_gives_the_requested_groups_by_vllms_rule(mamba, full, draft):
    plan = layer_plan(mamba, full, draft)
    groups = hybrid_kv_groups({"mamba": plan.linear_layers, "full_attention": plan.full_layers + draft})
    assert groups.get("mamba", 0) == mamba and groups["full_attention"] == full
    assert plan.layer_types.count("linear_attention") == plan.linear_layers
    assert plan.layer_types.count("full_attention") == plan.full_layers >= 1


def test_the_rule_reproduces_the_shipped_tiny_model():
    # qwen3-next-tiny: 3 GDN layers, 1 attention + 1 MTP layer -> 2 Mamba groups (one padded) + 1
    assert hybrid_kv_groups({"mamba": 3, "full_attention": 2}) == {"mamba": 2, "full_attention": 1}


def test_generated_config_and_folder(tmp_path):
    engine = load_matrix(EXAMPLE).matrix.engine
    template = json.loads((TEMPLATE / "config.json").read_text())
    config, plan = generated_config(template, engine)
    assert config["layer_types"] == ["linear_attention"] * 6 + ["full_attention"]
    assert config["num_hidden_layers"] == 7 and config["max_position_embeddings"] >= engine.max_model_len
    folder = materialize(TEMPLATE, engine, root=tmp_path)
    assert json.loads((folder / "config.json").read_text())["layer_types"] == config["layer_types"]
    assert (folder / "tokenizer.json").is_file()
    assert materialize(TEMPLATE, engine, root=tmp_path) == folder  # same geometry, same folder


def test_capacity_block_and_chunk_come_from_the_engine_log():
    log = ("(EngineCore_DP0 pid=1) INFO [kv_cache_utils.py:2177] GPU KV cache size: 34,048 tokens\n"
           "(EngineCore_DP0 pid=1) INFO [executor.py:364] kvrepro-sim: geometry kv_cache_groups=0:mamba/2128,"
           "1:full_attention/2128 block_size=2128 offload_chunk_tokens=4256 num_gpu_blocks=32 "
           "num_speculative_tokens=1 data_parallel_rank=0 data_parallel_size=2\n")
    cap = engine_capacity(LoadSpec(), log, block_size=16, max_model_len=19152, chunk_tokens=16)
    assert (cap.block_tokens, cap.chunk_tokens, cap.gpu_tokens) == (2128, 4256, 34048)
    # no such line (another engine): the engine spec's values
    cap = engine_capacity(LoadSpec(), "", block_size=2128, chunk_tokens=4256)
    assert (cap.block_tokens, cap.chunk_tokens) == (2128, 4256)


# -- what vLLM really builds -----------------------------------------------------------------------

_GROUPS_SCRIPT = r"""
import json, sys, types
import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
out = []
for linear, full in json.loads(sys.argv[1]):
    mamba = MambaSpec(shapes=((3, 128), (4, 16, 16)), dtypes=(torch.bfloat16, torch.bfloat16), block_size=16,
                      page_size_padded=attn.page_size_bytes, mamba_cache_mode="align")
    specs = {f"l{i}": mamba for i in range(linear)}
    specs.update({f"f{i}": attn for i in range(full)})
    cfg = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False))
    groups = get_kv_cache_groups(cfg, specs)
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    out.append({"mamba": kinds.count("MambaSpec"), "full_attention": kinds.count("FullAttentionSpec")})
print("GROUPS " + json.dumps(out))
"""


@pytest.mark.vllm
def test_vllms_own_grouping_agrees_with_the_layer_plans(runtime_python, runtime_scripts, pristine_vllm):
    """vLLM 0.26.0's get_kv_cache_groups on the layer counts layer_plan chooses."""
    from kvrepro.builds import prepare_runtime
    from kvrepro.secrets import scrubbed_environ

    asked = [(m, 1, 1) for m in (1, 2, 3, 5)] + [(3, 1, 0), (1, 3, 1), (0, 1, 1)]
    counts = []
    for mamba, full, draft in asked:
        plan = layer_plan(mamba, full, draft)
        counts.append((plan.linear_layers, plan.full_layers + draft))
    env = scrubbed_environ()
    env.update(PYTHONPATH=prepare_runtime("0.26.0").pythonpath(pristine_vllm), VLLM_LOGGING_LEVEL="ERROR")
    proc = runtime_scripts.run(runtime_python, ["-c", _GROUPS_SCRIPT, json.dumps(counts)], env=env, timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("GROUPS ")]
    assert line, proc.stderr[-3000:]
    built = json.loads(line[0].removeprefix("GROUPS "))
    assert built == [{"mamba": m, "full_attention": f} for m, f, _ in asked]


@pytest.mark.vllm
@pytest.mark.slow
def test_the_engine_builds_the_production_geometry(overlays, tmp_path):
    """`vllm serve` (GPU-free) on examples/production-geometry.yaml with one DP rank: the groups,
    block and offload chunk vLLM built, read from its log."""
    from kvrepro.deploy.sim import SimTarget
    from kvrepro.spec.matrix import LoadedMatrix

    loaded = load_matrix(EXAMPLE)
    m = loaded.matrix
    geometry = m.engine.geometry.model_copy(update={"data_parallel_size": 1})
    m = m.model_copy(update={"engine": m.engine.model_copy(update={"geometry": geometry})})
    target = SimTarget(LoadedMatrix(m, loaded.path, loaded.text))
    try:
        plan = next(p for p in target.loaded.plans() if p.name == "A")
        artifact = target.prepare(plan)
        assert artifact.ok, artifact.error
        handle = target.start(artifact, tmp_path, 0)
        handle.stop()
    finally:
        target.close()
    log = handle.log_path.read_text(errors="replace")
    line = next((x for x in log.splitlines() if "kvrepro-sim: geometry" in x), None)
    assert line is not None, log[-3000:]
    assert ("kv_cache_groups=0:mamba/2128,1:mamba/2128,2:mamba/2128,3:full_attention/2128 "
            "block_size=2128 offload_chunk_tokens=2128 num_gpu_blocks=32 num_speculative_tokens=1") in line, line


def test_a_run_on_another_geometry_than_asked_is_named():
    from kvrepro.spec.geometry import built_mismatch

    engine = load_matrix(EXAMPLE).matrix.engine
    line = ("(EngineCore_DP{r} pid=1) INFO [executor.py:364] kvrepro-sim: geometry kv_cache_groups={g} "
            "block_size=2128 offload_chunk_tokens=2128 num_gpu_blocks=32 num_speculative_tokens=1 "
            "data_parallel_rank={r} data_parallel_size=4\n")
    good = "0:mamba/2128,1:mamba/2128,2:mamba/2128,3:full_attention/2128"
    assert built_mismatch(engine, line.format(r=0, g=good) + line.format(r=1, g=good)) is None
    assert built_mismatch(engine, "no such line") is None  # e.g. a GPU engine: nothing to compare
    bad = built_mismatch(engine, line.format(r=0, g=good) + line.format(r=1, g="0:mamba/2128,1:full_attention/2128"))
    assert bad is not None and "1 Mamba + 1 full-attention groups" in bad and "asked: 3 + 1 groups" in bad
    # the default matrix has no geometry: never a mismatch
    assert built_mismatch(load_matrix(ROOT / "matrix.yaml").matrix.engine, line.format(r=0, g="0:mamba/16")) is None


# -- the prefix-match unit (vLLM's hash_block_size) ------------------------------------------------


def test_hash_block_size_becomes_the_prefix_match_unit_flag(tmp_path):
    path = tmp_path / "matrix.yaml"
    path.write_text('base: "0.27.0"\nbuilds:\n  A: []\nengine:\n  block_size: 32\n  geometry:\n'
                    '    hash_block_size: 16\n')
    loaded = load_matrix(path)
    args = loaded.matrix.engine.serve_args("m", include_sim=False)
    assert args[args.index("--prefix-match-unit") + 1] == "16"
    assert loaded.plans()[0].base == "0.27.0"
    # without the field, no flag: vLLM's default (one block) stays
    assert "--prefix-match-unit" not in load_matrix(EXAMPLE).matrix.engine.serve_args("m", include_sim=False)


def test_hash_block_size_must_divide_the_block(tmp_path):
    msg = _error(HEAD + "  block_size: 32\n  geometry:\n    hash_block_size: 12\n", tmp_path)
    assert ":7: engine.geometry.hash_block_size: 12 does not divide the block size 32" in msg
    msg = _error(HEAD + "  extra_args: [--prefix-match-unit, '8']\n  geometry:\n    mamba_groups: 2\n", tmp_path)
    assert ":5: engine.extra_args.0: --prefix-match-unit is set by engine.geometry" in msg


def test_hash_block_size_is_gated_on_the_release_that_has_the_flag(tmp_path):
    """0.25.1's `vllm serve` has no --prefix-match-unit (kvrepro/versions.py): a plan on it is
    bad input naming the field's line, and the newer bases of the same matrix are fine."""
    from kvrepro.versions import prefix_match_unit_problem

    assert prefix_match_unit_problem("0.26.0") is None and prefix_match_unit_problem("0.33.0") is None
    assert "no --prefix-match-unit (first in 0.26.0)" in prefix_match_unit_problem("0.25.1")
    path = tmp_path / "matrix.yaml"
    path.write_text('base: ["0.27.0", "0.25.1"]\nbuilds:\n  A: []\nengine:\n  block_size: 32\n  geometry:\n'
                    '    hash_block_size: 16\n')
    loaded = load_matrix(path)
    with pytest.raises(SpecError) as info:
        loaded.plans()
    assert f"{path}:7: engine.geometry.hash_block_size: vLLM 0.25.1 has no --prefix-match-unit" in str(info.value)
    assert [p.base for p in loaded.plans(bases=["0.26.0"])] == ["0.26.0"]
