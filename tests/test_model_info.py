"""A sim engine inspects its model classes in its own process (kvrepro/engine/model_info.py).

Against vLLM 0.26.0's own registry and plugin loading, in the runtime env: once vLLM has called
kvrepro's plugin with ``KVREPRO_SIM=1``, the inspection with an empty ``VLLM_CACHE_ROOT`` starts no
interpreter and leaves the same ``modelinfos`` files, byte for byte, as vLLM's own fresh-interpreter
inspection (whether vLLM's registry was imported before the plugin ran or after); without the flag
vLLM's is left in place.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.vllm

# the two classes every default engine inspects: the hybrid model and its MTP drafter
ARCHS = ("Qwen3NextForCausalLM", "Qwen3NextMTP")

INSPECT = """
import json, os, subprocess, sys
{before}
from vllm.platforms import current_platform
platform = type(current_platform).__name__  # vLLM calls the plugins' register() here
from vllm.model_executor.models import registry
from kvrepro.engine import model_info
started = []
real_run = subprocess.run
def watching(cmd, *a, **kw):
    started.append(" ".join(map(str, cmd)))
    return real_run(cmd, *a, **kw)
subprocess.run = watching
infos = {{arch: registry.ModelRegistry._try_inspect_model_cls(arch) is not None for arch in {archs!r}}}
print("RESULT " + json.dumps({{"platform": platform, "here": registry._run_in_subprocess is model_info.run_here,
    "infos": infos, "started": started}}))
"""


def _inspect(scripts, python: Path, overlay: Path, cache: Path, sim: bool, archs=ARCHS, before: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVREPRO_SIM")}
    env.update(PYTHONPATH=os.pathsep.join(map(str, (overlay, ROOT))), VLLM_CACHE_ROOT=str(cache))
    if sim:
        env["KVREPRO_SIM"] = "1"
    code = textwrap.dedent(INSPECT.format(before=before, archs=tuple(archs)))
    proc = scripts.run(python, ["-c", code], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])


def _files(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((cache / "modelinfos").glob("*.json"))}


@pytest.fixture(scope="module")
def vllm_way(runtime_python, runtime_scripts, overlays, tmp_path_factory) -> dict[str, bytes]:
    """vLLM's own inspection of the model class (a fresh interpreter, ~7 CPU s: one class only)."""
    cache = tmp_path_factory.mktemp("vllm-cache")
    result = _inspect(runtime_scripts, runtime_python, overlays["A"], cache, sim=False, archs=ARCHS[:1])
    # without the sim flag nothing changes: vLLM starts its registry interpreter for the class
    assert result["platform"] != "SimCpuPlatform" and result["here"] is False
    assert result["infos"] == {ARCHS[0]: True}
    assert len(result["started"]) == 1 and "vllm.model_executor.models.registry" in result["started"][0]
    return _files(cache)


@pytest.mark.parametrize("before", ["", "import vllm.model_executor.models.registry"],
                         ids=["registry-imported-later", "registry-imported-before"])
def test_a_sim_engine_inspects_here_and_writes_what_vllms_own_subprocess_writes(
        runtime_python, runtime_scripts, overlays, tmp_path, before, vllm_way):
    sim_way = _inspect(runtime_scripts, runtime_python, overlays["A"], tmp_path / "sim", sim=True, before=before)
    assert sim_way["platform"] == "SimCpuPlatform" and sim_way["here"] is True
    assert sim_way["infos"] == dict.fromkeys(ARCHS, True)
    assert sim_way["started"] == []  # no interpreter started
    ours = _files(tmp_path / "sim")
    assert len(vllm_way) == 1 and len(ours) == len(ARCHS)
    for name, theirs in vllm_way.items():  # vLLM's own answer, byte for byte
        assert ours[name] == theirs
    model = json.loads(ours["vllm-model_executor-models-qwen3_next-Qwen3NextForCausalLM.json"])["modelinfo"]
    assert model["is_hybrid"] is True and model["has_inner_state"] is True
    drafter = json.loads(ours["vllm-model_executor-models-qwen3_next_mtp-Qwen3NextMTP.json"])["modelinfo"]
    assert drafter["architecture"] == "Qwen3NextMTP"
