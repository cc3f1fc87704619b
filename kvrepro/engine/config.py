"""From a `vllm serve` argument list to vLLM's own ``VllmConfig``, on a machine without a GPU.

The configuration is built the way `vllm serve` builds it: vLLM's ``FlexibleArgumentParser``
with ``EngineArgs.add_cli_args`` parses the argv, ``EngineArgs.from_cli_args`` and
``create_engine_config()`` make the ``VllmConfig``. Only these things are done by hand, each
because a CPU-only process cannot do it the normal way:

* **Platform.** The CUDA wheel finds no GPU and no CPU build, so vLLM cannot infer a device.
  We install ``SimCpuPlatform`` (a subclass of vLLM's ``CpuPlatform``) as
  ``vllm.platforms.current_platform`` before anything asks for it. It differs from the CPU
  platform in two ways, both to keep the KV-cache geometry what a CUDA GPU would produce:
  (1) it keeps ``mamba_ssm_cache_dtype`` as configured (the CPU platform forces float32 on
  AMX machines, which would change the Mamba page size and with it the geometry, depending
  on the host CPU); (2) when vLLM asks for the model's attention backend to align hybrid
  block sizes, it answers with ``FlashAttentionBackend`` (what a CUDA GPU uses for this
  model) instead of looking at loaded model layers, which the sim never builds.
* **Scheduling mode.** The CPU platform turns asynchronous scheduling off, so ``EngineCore``
  uses the synchronous ``Scheduler`` and ``step()``. On a GPU 0.26.0 would enable async
  scheduling with MTP; the scheduler/connector allocation path under test is the same code
  in both modes.
* **Tokenizer.** ``skip_tokenizer_init=True``: the model directory holds only config.json.
* **Executor.** ``distributed_executor_backend`` is the sim executor class (an
  ``Executor`` subclass), which vLLM's ``Executor.get_class`` accepts like any backend.

`vllm serve` flags of the HTTP frontend (``--api-key`` ...) are not engine arguments and are
rejected with a clear error; ``--host`` and ``--port`` are understood.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

TESTED_VLLM_VERSIONS = ("0.26.0",)


class EngineSetupError(Exception):
    """The engine cannot start: a message for a person (bad argument, incompatible vLLM)."""


@dataclass(frozen=True)
class SimKnobs:
    """What has no `vllm serve` flag: the fake model's behaviour (from KVREPRO_SIM_* env vars)."""

    acceptance_rate: float = 0.7
    seed: int = 0
    step_delay_ms: float = 0.0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "SimKnobs":
        env = os.environ if environ is None else environ

        def number(name: str, default, kind, lo, hi=None):
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise EngineSetupError(f"{name}={raw!r}: not a {kind.__name__}") from None
            if value < lo or (hi is not None and value > hi):
                bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
                raise EngineSetupError(f"{name}={raw!r}: must be {bound}")
            return value

        return cls(
            acceptance_rate=number("KVREPRO_SIM_ACCEPTANCE_RATE", 0.7, float, 0.0, 1.0),
            seed=number("KVREPRO_SIM_SEED", 0, int, 0),
            step_delay_ms=number("KVREPRO_SIM_STEP_DELAY_MS", 0.0, float, 0.0),
        )


@dataclass(frozen=True)
class ServeOptions:
    host: str
    port: int
    model_dir: Path
    served_model_name: str


def install_sim_platform() -> None:
    """Make vLLM see the sim's CPU platform (see the module docstring for why)."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    class SimCpuPlatform(CpuPlatform):
        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            configured = vllm_config.cache_config.mamba_ssm_cache_dtype
            super().check_and_update_config(vllm_config)
            if vllm_config.cache_config.mamba_ssm_cache_dtype != configured:
                from vllm.logger import init_logger

                init_logger("vllm.kvrepro_engine.config").info(
                    "kvrepro sim: keeping mamba_ssm_cache_dtype=%s as configured (the CPU "
                    "platform's AMX override would change the Mamba page size a GPU sees).",
                    configured,
                )
                vllm_config.cache_config.mamba_ssm_cache_dtype = configured

        @classmethod
        def _find_non_ssm_backend(cls, vllm_config):
            from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

            return FlashAttentionBackend

    platforms.current_platform = SimCpuPlatform()


def check_vllm_api() -> str:
    """The vLLM version, after checking it has every API the sim uses (clear error if not)."""
    import importlib

    import vllm

    needed = {
        "vllm.v1.engine.core": ["EngineCore.add_request", "EngineCore.preprocess_add_request",
                                "EngineCore.step", "EngineCore.post_step"],
        "vllm.v1.executor.abstract": ["Executor.execute_model", "Executor.sample_tokens",
                                      "Executor.take_draft_token_ids"],
        "vllm.v1.worker.kv_connector_model_runner_mixin": [
            "KVConnectorModelRunnerMixin.maybe_get_kv_connector_output",
            "KVConnectorModelRunnerMixin.kv_connector_no_forward"],
        "vllm.distributed.kv_transfer.kv_transfer_state": ["_KV_CONNECTOR_AGENT"],
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker": [
            "OffloadingConnectorWorker.start_kv_transfers", "OffloadingConnectorWorker.get_finished"],
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler": [
            "OffloadingConnectorScheduler.update_state_after_alloc"],
        "vllm.v1.kv_offload.base": ["OffloadingWorker", "TransferResult"],
        "vllm.platforms.interface": ["Platform.update_block_size_for_backend",
                                     "Platform._find_non_ssm_backend"],
        "vllm.engine.arg_utils": ["EngineArgs.add_cli_args", "EngineArgs.create_engine_config"],
    }
    missing = []
    for module_name, attrs in needed.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing.append(f"{module_name} ({exc})")
            continue
        for dotted in attrs:
            obj = module
            for part in dotted.split("."):
                if not hasattr(obj, part):
                    missing.append(f"{module_name}.{dotted}")
                    break
                obj = getattr(obj, part)
    version = getattr(vllm, "__version__", "?")
    if missing:
        raise EngineSetupError(
            f"vLLM {version} (from {Path(vllm.__file__).parent}) lacks what the sim engine drives: "
            + ", ".join(missing)
            + f". The sim engine was written against vLLM {', '.join(TESTED_VLLM_VERSIONS)}; "
            "use that base (matrix.yaml: base) or adapt kvrepro/engine to this version."
        )
    return version


_SECRET_FLAG = re.compile(r"(?:^|-)(?:key|token|secret|password|credentials?)(?:$|-)", re.IGNORECASE)


def redact(argv: list[str]) -> list[str]:
    """argv with the values of secret-looking flags (``--api-key``, ``--hf-token`` ...) masked."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:
            out.append("***")
            mask_next = False
        elif arg.startswith("--") and _SECRET_FLAG.search(arg.split("=", 1)[0][2:]):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=***")
            else:
                out.append(arg)
                mask_next = True
        else:
            out.append(arg)
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit(2); say it our way
        raise EngineSetupError(f"bad engine argument: {message}")


def parse_args(argv: list[str]):
    """(EngineArgs, ServeOptions) from `vllm serve` style arguments; EngineSetupError if bad."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(_Parser, FlexibleArgumentParser):
        pass

    parser = Parser(prog="python -m kvrepro.engine", add_help=False)
    parser.add_argument("model_tag", nargs="?", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    EngineArgs.add_cli_args(parser)
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        raise EngineSetupError(
            "unsupported argument(s) for the sim engine: " + " ".join(redact(unknown))
            + " (it accepts vLLM engine arguments plus --host/--port; `vllm serve` frontend "
            "flags have no meaning here)"
        )
    model = namespace.model_tag or namespace.model
    if not model:
        raise EngineSetupError("give the model directory as the first argument")
    model_dir = Path(model)
    if not (model_dir / "config.json").is_file():
        raise EngineSetupError(
            f"{model_dir}: no config.json there; the sim engine needs a directory with an "
            "HF-style config.json (no weights), e.g. kvrepro/data/models/qwen3-next-tiny"
        )
    namespace.model = str(model_dir)
    engine_args = EngineArgs.from_cli_args(namespace)
    engine_args.skip_tokenizer_init = True
    served = engine_args.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    options = ServeOptions(host=namespace.host, port=namespace.port, model_dir=model_dir,
                           served_model_name=served or str(model_dir))
    return engine_args, options


def build_vllm_config(engine_args, executor_class):
    """vLLM's own create_engine_config(), with the sim executor as the executor backend."""
    engine_args.distributed_executor_backend = executor_class
    try:
        return engine_args.create_engine_config()
    except (ValueError, TypeError) as exc:
        raise EngineSetupError(f"vLLM rejected the engine arguments: {exc}") from exc
