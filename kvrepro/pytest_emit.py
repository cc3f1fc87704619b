"""Write a minimized trace as a pytest that drives vLLM's engine core with that request sequence.

The test builds the same EngineCore the GPU-free engine serves -- vLLM's scheduler, KV-cache
manager and OffloadingConnector (scheduler and worker side) over kvrepro's sim executor, which
fakes only the GPU model and the offload data movement -- adds the requests one at a time and
steps each to completion. It has no assertion of its own: on a build with the bug, vLLM's own
assertion fails inside ``step()``; on a fixed build the sequence runs through.

The file runs under pytest or as a script (``python FILE``: exit 1 with vLLM's traceback when
the bug fires), with the build's overlay and kvrepro's sources on PYTHONPATH (the header says
exactly how). Upstream's offloading_connector unit tests drive ``Scheduler`` with a hand-made
config instead of ``EngineCore``; porting this sequence there means replacing the sim executor
with their ``RequestRunner`` (not done here).
"""

from __future__ import annotations

import json
from pathlib import Path

from . import paths
from .loadgen.trace import Trace
from .spec import LoadedMatrix

_TEMPLATE = '''"""Regression test: vLLM {base} {signature}.

Emitted by `kvrepro minimize` from {source}
({requests} requests, {tokens} prompt tokens, sent one at a time). It drives vLLM's EngineCore
(scheduler, KV-cache manager, OffloadingConnector) over kvrepro's GPU-free executor, which fakes
only the GPU model and the offload data movement, and has no assertion of its own: with the bug,
vLLM's assertion fails inside step(); with the fix the sequence runs through.

Run (build {build} fails, {fixed_note}):
    PYTHONPATH=<overlay>:{src} {python} -m pytest {name}
    PYTHONPATH=<overlay>:{src} {python} {name}
<overlay> is the build's folder under ~/.cache/kvrepro/overlays (see results/.../build.json).
"""

import os

ENGINE_ARGS = {engine_args}
SIM_SEED = {sim_seed}
DRAFT_ACCEPTANCE_RATE = {acceptance}

# (max_tokens, prompt token ids), in the order they are sent
REQUESTS = [
{requests_literal}
]


def _engine_core():
    os.environ["KVREPRO_SIM_SEED"] = str(SIM_SEED)
    os.environ["KVREPRO_SIM_ACCEPTANCE_RATE"] = repr(DRAFT_ACCEPTANCE_RATE)
    from kvrepro.engine import config

    config.install_sim_platform()
    engine_args, _ = config.parse_args(ENGINE_ARGS)
    from kvrepro.engine.executor import SimExecutor
    from vllm.v1.engine.core import EngineCore

    return EngineCore(config.build_vllm_config(engine_args, SimExecutor), executor_class=SimExecutor,
                      log_stats=False)


def test_offload_hit_behind_a_partial_local_hit():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    core = _engine_core()
    for i, (max_tokens, prompt) in enumerate(REQUESTS):
        request = EngineCoreRequest(
            request_id=f"req-{{i}}", prompt_token_ids=list(prompt), mm_features=None,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), pooling_params=None,
            arrival_time=float(i), lora_request=None, cache_salt=None, data_parallel_rank=None)
        core.add_request(*core.preprocess_add_request(request))
        while core.scheduler.has_requests():  # one request at a time, to completion
            _, executed = core.step()
            core.post_step(executed)


if __name__ == "__main__":
    test_offload_hit_behind_a_partial_local_hit()
    print("passed: the sequence ran through")
'''


def emit(path: Path, trace: Trace, loaded: LoadedMatrix, build: str, fixed: str | None) -> None:
    matrix = loaded.matrix
    sig = matrix.target_signature
    args = matrix.engine.serve_args(str(loaded.model_dir()), include_sim=True)
    rep = int(trace.header.get("rep", 0))
    requests_literal = "\n".join(f"    ({r.max_tokens}, {json.dumps(list(r.tokens))})," for r in trace.requests)
    text = _TEMPLATE.format(
        base=matrix.base,
        signature=f"{sig.exception} in {sig.function}" + (f": {sig.expression}" if sig.expression else ""),
        source=trace.header.get("minimized_from", trace.path),
        requests=len(trace.requests), tokens=sum(len(r.tokens) for r in trace.requests),
        build=build, fixed_note=f"build {fixed} passes" if fixed else "a fixed build passes",
        src=paths.SOURCE_ROOT, python="<runtime python>", name=path.name,
        engine_args=json.dumps(args), sim_seed=matrix.engine.sim.seed + rep,
        acceptance=repr(matrix.engine.sim.draft_acceptance_rate), requests_literal=requests_literal,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
