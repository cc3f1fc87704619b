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

Run with a build's overlay first on PYTHONPATH (or under pytest: `python -m pytest {name}`):
{run_lines}
"""

import os

ENGINE_ARGS = {engine_args}
SIM_SEED = {sim_seed}
DRAFT_ACCEPTANCE_RATE = {acceptance}

# before vLLM resolves its platform: kvrepro's plugin then names the GPU-free CPU platform
os.environ["KVREPRO_SIM"] = "1"
os.environ["KVREPRO_SIM_SEED"] = str(SIM_SEED)
os.environ["KVREPRO_SIM_ACCEPTANCE_RATE"] = repr(DRAFT_ACCEPTANCE_RATE)

# (max_tokens, prompt token ids), in the order they are sent
REQUESTS = [
{requests_literal}
]


def _engine_core():
    from kvrepro.engine.offline import build_engine_factory  # `vllm serve ENGINE_ARGS`'s EngineCore

    return build_engine_factory(ENGINE_ARGS)()


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


def emit(path: Path, trace: Trace, loaded: LoadedMatrix, build: str, fixed: str | None,
         runs: dict[str, tuple[str, str]] | None = None) -> None:
    """``runs``: build -> (python, PYTHONPATH) of that build's runtime, for the header."""
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
        run_lines="\n".join(
            f"    # build {name} ({'fails: the bug' if name == build else 'passes: fixed'})\n"
            f"    PYTHONPATH={pythonpath} {python} {path.name}"
            for name, (python, pythonpath) in (runs or {build: ("python", f"<overlay>:{paths.SOURCE_ROOT}")}).items()),
        name=path.name,
        engine_args=json.dumps(args), sim_seed=matrix.engine.sim.seed + rep,
        acceptance=repr(matrix.engine.sim.draft_acceptance_rate), requests_literal=requests_literal,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
