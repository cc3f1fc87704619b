"""The docker target's launch plan (which container gets which `vllm serve` flags), checked
against vLLM 0.26.0's OWN argument parser: every node's argv is parsed by
``make_arg_parser(FlexibleArgumentParser())`` from the base's code, so a misspelt or renamed
flag fails here, not on a GPU cluster. No Docker is needed: the plan is pure data.

Faked: the machine has no GPU, so vLLM's platform is set to its CPU platform before the parser
is built (the parser's defaults ask the platform for a device type); the hosts are GB200 nodes
that exist only as data (no daemon is contacted).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvrepro.deploy.docker.launch import PLACEMENT_FLAGS, plan_launch
from kvrepro.errors import SpecError
from kvrepro.deploy.docker.settings import DockerSpec, HostSpec
from kvrepro.spec.matrix import SimSettings, parse_matrix

_PARSE = r"""
import json, sys
# No GPU here: the parser's defaults ask the platform for a device, so name the CPU platform
# (the one fake of this test). Every flag and its parsing are vLLM's own.
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform
vllm.platforms.current_platform = CpuPlatform()
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.openai.cli_args import make_arg_parser

request = json.load(sys.stdin)
parser = make_arg_parser(FlexibleArgumentParser())
known = sorted(parser._option_string_actions)
out = []
def plain(v):  # JSON-able: plain values and parsed JSON as they are, an enum by its name
    if isinstance(v, (str, int, float, bool, type(None), dict)):
        return v
    name = getattr(v, "name", None)
    return name if isinstance(name, str) else repr(type(v))

for argv in request:
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    out.append({k: plain(v) for k, v in vars(ns).items()})
print("RESULT " + json.dumps({"parsed": out, "options": known}))
"""


def _serve_args() -> list[str]:
    loaded = parse_matrix("builds: {A: []}\n", Path("/tmp/matrix.yaml"))
    return loaded.matrix.engine.serve_args("/kvrepro/model/qwen3-next-tiny", include_sim=True)


def _hosts(n: int, gpus: int = 4) -> list[HostSpec]:
    return [HostSpec(name=f"gb200-{i}", docker=f"ssh://ops@gb200-{i}", gpus=gpus, address=f"10.0.0.{10 + i}")
            for i in range(n)]


def _single():
    return plan_launch(_serve_args(), _hosts(1, gpus=0), DockerSpec(), head_address="127.0.0.1", api_port=None,
                       bind_ip="127.0.0.1")


def _nnodes():
    return plan_launch(_serve_args() + ["--tensor-parallel-size", "16"], _hosts(4),
                       DockerSpec(multi_node="nnodes", rendezvous_port=29600),
                       head_address="10.0.0.10", api_port=8100, bind_ip="0.0.0.0")


def _data_parallel():
    return plan_launch(_serve_args(), _hosts(3, gpus=4), DockerSpec(multi_node="data-parallel", rendezvous_port=13345),
                       head_address="10.0.0.10", api_port=8000, bind_ip="0.0.0.0")


def _gpu_path():
    """A real vLLM on GPUs (docker.gpu_free: no) serving the shipped weightless model."""
    from kvrepro.deploy.docker.target import gpu_path_args

    engine = parse_matrix("builds: {A: []}\n", Path("/tmp/matrix.yaml")).matrix.engine
    args = gpu_path_args(engine.serve_args("/kvrepro/model/qwen3-next-tiny", include_sim=False), engine,
                         DockerSpec(), weights=False)
    return plan_launch(args, _hosts(1, gpus=1), DockerSpec(), head_address="127.0.0.1", api_port=None,
                       bind_ip="127.0.0.1")


SCENARIOS = {"single": _single, "nnodes": _nnodes, "data_parallel": _data_parallel, "gpu_path": _gpu_path}


@pytest.fixture(scope="module")
def vllm(runtime_python: Path, runtime_scripts, pristine_vllm: Path) -> dict:
    """Every scenario's argvs parsed by vLLM's own `vllm serve` parser, in one subprocess
    (importing vLLM takes most of the time), plus the parser's option strings."""
    argvs = {name: [list(n.argv) for n in build()] for name, build in SCENARIOS.items()}
    flat = [argv for name in SCENARIOS for argv in argvs[name]]
    env = dict(os.environ, PYTHONPATH=str(pristine_vllm), VLLM_LOGGING_LEVEL="ERROR")
    proc = runtime_scripts.run(runtime_python, ["-c", _PARSE], input=json.dumps(flat), env=env, timeout=600)
    assert proc.returncode == 0, f"vLLM's parser rejected an argv:\n{proc.stderr[-3000:]}"
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    parsed, i = {}, 0
    for name in SCENARIOS:
        parsed[name] = result["parsed"][i:i + len(argvs[name])]
        i += len(argvs[name])
    return {"parsed": parsed, "options": set(result["options"])}


def test_placement_flags_exist_in_vllm(vllm):
    """Every flag the launch plan sets or refuses (long and short) is one vLLM 0.26.0 defines."""
    options = vllm["options"]
    for long, shorts in PLACEMENT_FLAGS.items():
        assert long in options, long
        for short in shorts:
            assert short in options, short


def test_single_node_passes_matrix_args_verbatim(vllm):
    args = _serve_args()
    [node] = _single()
    assert node.head and node.network == "bridge" and node.container_port == 8000
    assert list(node.argv[: len(args)]) == args  # verbatim, in order, model first
    [ns] = vllm["parsed"]["single"]
    assert ns["model_tag"] == "/kvrepro/model/qwen3-next-tiny"
    assert (ns["host"], ns["port"]) == ("0.0.0.0", 8000)
    assert ns["block_size"] == 16 and ns["mamba_cache_mode"] == "align"
    assert ns["enable_prefix_caching"] is True and ns["num_gpu_blocks_override"] == SimSettings().num_gpu_blocks
    assert ns["kv_offloading_backend"] == "native" and ns["headless"] is False


def test_the_gpu_path_caps_the_pool_and_pins_one_backend_for_target_and_drafter(vllm):
    """docker.gpu_free: no (docs/docker.md): the pool the load was made for (a 139 GiB GPU evicts
    nothing), FlashAttention for the target AND the MTP drafter (vLLM 0.26.0's drafter never inherits
    the target's backend: llm_base_proposer.py:1292), dummy weights for a weightless model folder,
    and vLLM's own scheduling mode (nothing passed: async on with MTP). Parsed by vLLM's parser."""
    [ns] = vllm["parsed"]["gpu_path"]
    assert ns["num_gpu_blocks_override"] == SimSettings().num_gpu_blocks
    assert ns["attention_backend"] == "FLASH_ATTN"
    assert ns["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "FLASH_ATTN"}
    assert ns["load_format"] == "dummy"
    assert ns["async_scheduling"] is None  # vLLM decides, as on any GPU node
    from kvrepro.deploy.docker.target import gpu_path_args

    engine = parse_matrix("builds: {A: []}\nengine: {extra_args: [--kv-cache-memory-bytes, '8G']}\n",
                          Path("/tmp/matrix.yaml")).matrix.engine
    own_pool = gpu_path_args(engine.serve_args("m", include_sim=False), engine,
                             DockerSpec(gpu_kv_blocks="matrix", gpu_attention_backend=None), weights=True)
    assert "--num-gpu-blocks-override" not in own_pool and "--attention-backend" not in own_pool
    assert "--load-format" not in own_pool
    with pytest.raises(ValueError, match="attention backend name"):
        DockerSpec(gpu_attention_backend="flash; rm -rf /")


def test_nnodes_plan_head_serves_others_headless(vllm):
    plan = _nnodes()
    assert [n.host for n in plan] == ["gb200-0", "gb200-1", "gb200-2", "gb200-3"]
    assert all(n.network == "host" and n.gpus == 4 for n in plan)
    parsed = vllm["parsed"]["nnodes"]
    for rank, ns in enumerate(parsed):
        assert ns["nnodes"] == 4 and ns["node_rank"] == rank
        assert ns["master_addr"] == "10.0.0.10" and ns["master_port"] == 29600
        assert ns["tensor_parallel_size"] == 16
        assert ns["headless"] is (rank > 0)
    assert parsed[0]["port"] == 8100 and parsed[0]["host"] == "0.0.0.0"
    assert plan[0].head and not any(n.head for n in plan[1:])


def test_data_parallel_plan_start_ranks(vllm):
    plan = _data_parallel()
    assert [n.head for n in plan] == [True, False, False]
    parsed = vllm["parsed"]["data_parallel"]
    for rank, ns in enumerate(parsed):
        assert ns["data_parallel_size"] == 12 and ns["data_parallel_size_local"] == 4
        assert ns["data_parallel_address"] == "10.0.0.10" and ns["data_parallel_rpc_port"] == 13345
        assert ns["headless"] is (rank > 0)
        assert ns["data_parallel_start_rank"] == (None if rank == 0 else 4 * rank)
    assert parsed[0]["port"] == 8000


def test_data_parallel_uneven_hosts_need_explicit_local_size():
    hosts = [HostSpec(name="a", gpus=4), HostSpec(name="b", gpus=2)]
    with pytest.raises(SpecError, match="data_parallel_size_local"):
        plan_launch(_serve_args(), hosts, DockerSpec(multi_node="data-parallel"), head_address="a",
                    api_port=8000, bind_ip="0.0.0.0")
    plan = plan_launch(_serve_args(), hosts, DockerSpec(multi_node="data-parallel", data_parallel_size_local=2),
                       head_address="a", api_port=8000, bind_ip="0.0.0.0")
    assert "--data-parallel-start-rank" in plan[1].argv


@pytest.mark.parametrize("extra", [["--port", "9000"], ["--node_rank=1"], ["-n", "2"], ["--headless"],
                                   ["--data-parallel-address=x"]])
def test_matrix_may_not_set_placement_flags(extra):
    with pytest.raises(SpecError, match="engine.extra_args"):
        plan_launch(_serve_args() + extra, _hosts(2), DockerSpec(), head_address="h", api_port=8000,
                    bind_ip="0.0.0.0")
