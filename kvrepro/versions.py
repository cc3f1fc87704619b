"""Everything kvrepro knows about vLLM releases, in one table.

kvrepro runs vLLM's own code; what differs between releases is only how the GPU-free engine
plugs into it (the executor answers to worker RPCs, the platform), which torch its scheduler
runs on, how a flag or a variable was named, and which release is the default base. All of
that lives here, so supporting a new release is one entry in ``RELEASES``. This module is
stdlib-only: the engine (in the runtime env) and the CLI both import it.

A release newer than the newest entry (same major version) needs no code change to be tried: it
runs with the newest entry's settings and is marked *unported* in every output (:func:`settings_for`,
:func:`is_unported`). What breaks is then named by the porting step it needs, with the vLLM
file:line, by ``kvrepro release port X`` (kvrepro/release/porting.py), which does the checklist:

1. Fetch ``X``'s wheel and read it against this table (static: every worker RPC its EngineCore
   and executor call, the platform checks of its CPU platform, the executor interface the sim
   imports, the target signature's statement).
2. Run one build with no patches on ``X`` (the default engine and load, few requests), with the
   newest entry's settings.
3. ``NotImplementedError: collective_rpc('name')``: **a new worker RPC**. Decide what a single GPU
   worker answers and put it in ``X``'s ``rpc_answers`` (a constant, or ``Computed("method")``
   when the executor must compute it with vLLM's own code).
4. An exception raised in ``vllm/platforms/``: **a platform check**. The sim platform
   (kvrepro/engine/platform.py) answers it with a platform method, never a version branch.
5. An ImportError, AttributeError or TypeError between kvrepro's executor and vLLM: **an executor
   interface** moved. Adapt ``kvrepro/engine/executor.py`` behind a check of the interface
   (``hasattr``, ``find_spec``), not of the version, and note it under ``notes``.
6. The target crash's statement is in the source with other names (or a crash classified
   ``other`` at it): **a renamed identifier in a signature**. Add the pair to
   ``IDENTIFIER_ALIASES``.
7. Requirements the runtime envs lack: nothing to do (a layer, kvrepro/builds/runtime.py); note a
   torch pin other than ``DEFAULT_TORCH``.
8. Add ``Release("X", ...)`` to ``RELEASES`` (the command prints the entry) and record the sweep's
   verdict in the release table of docs/engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_BASE = "0.26.0"
# The CPU build of torch that every supported release's scheduler runs on here; a plain `torch`
# from the index is a multi-GB CUDA build. Releases pin other torches (0.26.0: 2.11, 0.33.0:
# 2.14); the scheduler, KV-cache manager and connector do not use what changed between them.
DEFAULT_TORCH = "torch==2.13.0"

# Worker RPCs the executor answers for every release: (method -> the one worker's answer).
_COMMON_RPC_ANSWERS: dict[str, Any] = {
    "get_supported_tasks": ("generate",),
    "check_health": None,
    "shutdown": None,
    "update_max_model_len": None,
    "reset_mm_cache": None,
    "reset_encoder_cache": None,
    # data parallel: an idle rank runs a dummy forward so its collectives stay in step with the
    # busy ranks' (EngineCore.execute_dummy_batch); the sim has no model and no collectives
    "execute_dummy_batch": None,
}


@dataclass(frozen=True)
class Computed:
    """An RPC answer the executor computes with vLLM's own code (its method ``name``)."""

    name: str


@dataclass(frozen=True)
class Release:
    """One vLLM release on PyPI that the GPU-free engine runs."""

    version: str
    torch: str = DEFAULT_TORCH
    # worker RPCs this release's EngineCore makes beyond the common ones (method -> answer)
    rpc_answers: dict[str, Any] = field(default_factory=dict)
    notes: str = ""
    unported_from: str | None = None  # set by settings_for: an unported release runs with this entry's settings

    def worker_rpc_answers(self) -> dict[str, Any]:
        return {**_COMMON_RPC_ANSWERS, **self.rpc_answers}


# 0.27.1+: EngineCore asks workers to compile and capture graphs; the executor's own
# compile_or_warm_up_model() does nothing (no model, no compilation time to report).
_WARM_UP: dict[str, Any] = {}
_DRAFT_WEIGHTS: dict[str, Any] = {"supports_draft_weight_updates": False}  # 0.28.0+
_KV_LAYOUTS: dict[str, Any] = {  # 0.29.0+
    **_DRAFT_WEIGHTS,
    # what a GPU worker running FlashAttention reports (vLLM's own get_supported_kv_cache_layouts)
    "get_supported_kv_cache_layouts": Computed("gpu_kv_cache_layouts"),
    "set_kv_cache_layout": None,
    "synchronize_device": None,
}

RELEASES: tuple[Release, ...] = (
    Release("0.25.1", notes="the target assertion names the block size `gpu_block_size`"),
    Release("0.26.0", notes="the production base of the original report; the default"),
    Release("0.27.0"),
    Release("0.27.1", rpc_answers=_WARM_UP),
    Release("0.28.0", rpc_answers={**_WARM_UP, **_DRAFT_WEIGHTS}),
    Release("0.29.0", rpc_answers={**_WARM_UP, **_KV_LAYOUTS}),
    Release("0.30.0", rpc_answers={**_WARM_UP, **_KV_LAYOUTS}, notes="carries the boundary fix (PR 52807)"),
    Release("0.31.0", rpc_answers={**_WARM_UP, **_KV_LAYOUTS}),
    Release("0.32.0", rpc_answers={**_WARM_UP, **_KV_LAYOUTS}),
    Release("0.33.0", rpc_answers={**_WARM_UP, **_KV_LAYOUTS},
            notes="pins torch 2.14.0, whose wheel on the index is the CUDA build; runs on 2.13.0 CPU"),
    Release("0.34.0", rpc_answers={**_WARM_UP, **_KV_LAYOUTS},
            notes="pins torch 2.14.0 (runs on 2.13.0 CPU); its CPU platform refuses x86 without Triton, "
                  "which the sim platform answers as a GPU host (kvrepro/engine/platform.py)"),
)
SUPPORTED_RELEASES: tuple[str, ...] = tuple(r.version for r in RELEASES)

# Identifiers renamed between releases in statements that crash signatures compare
# (old name -> the name patterns and matrices use). See kvrepro.classify.source.canonical.
IDENTIFIER_ALIASES: dict[str, str] = {
    "gpu_block_size": "tokens_per_block",  # offloading scheduler, 0.25.1 -> 0.26.0
}


# -- KV geometry (engine.geometry in matrix.yaml) -------------------------------------------------
# What kvrepro/geometry.py needs to know about how vLLM lays out the KV cache, checked by reading
# 0.25.1-0.30.0's code (kv_cache_utils, the offloading connector's config, interface.py).

# The OffloadingConnector's offload chunk, in tokens: kv_connector_extra_config["block_size"]
# (0.26.0+: distributed/kv_transfer/kv_connector/v1/offloading/config.py; 0.25.1:
# v1/kv_offload/base.py). It must be a multiple of the GPU block size; the alternative key
# "blocks_per_chunk" (0.26.0+) says the same in blocks and may not be given with it.
OFFLOAD_CHUNK_EXTRA_KEY = "block_size"

# The prefix-match unit (vLLM's `hash_block_size`: the token step at which request block hashes are
# computed, so a prefix-cache hit can end inside a KV block). `vllm serve --prefix-match-unit N`
# sets CacheConfig.prefix_match_unit from 0.26.0 (engine/arg_utils.py: 0.26.0 :1201, 0.27.0 :1236,
# 0.28.0 :1243, 0.33.0 :1434). 0.25.1's CacheConfig has a `hash_block_size` field (config/cache.py:56)
# but no serve flag for it. Every KV group's block size must be a multiple of it (the field's docs).
PREFIX_MATCH_UNIT_FLAG = "--prefix-match-unit"

# `vllm serve --data-parallel-size N` starts N API-server processes by default (0.25.1-0.33.0:
# entrypoints/cli/serve.py, "Defaulting api_server_count to data_parallel_size"), each a *spawned*
# interpreter that imports torch & co. again (~9 CPU s each, before the first /health). The code
# under test is in the EngineCores; one API server routes to every rank (the X-data-parallel-rank
# header included), so a geometry's DP ranks sit behind one, as its docs say, unless the matrix's
# extra_args name the flag.
API_SERVER_COUNT_FLAG = "--api-server-count"
PREFIX_MATCH_UNIT_SINCE = "0.26.0"


def prefix_match_unit_problem(release: str) -> str | None:
    """Why ``release``'s `vllm serve` cannot take a hash block size finer than the KV block (None: it can)."""
    have, since = version_tuple(release), version_tuple(PREFIX_MATCH_UNIT_SINCE)
    if have is None or since is None or have >= since:
        return None
    return (f"vLLM {release} has no {PREFIX_MATCH_UNIT_FLAG} (first in {PREFIX_MATCH_UNIT_SINCE}); "
            f"run it on {PREFIX_MATCH_UNIT_SINCE} or later, or remove the field")


# FlashAttention's kernel block sizes are MultipleOf(16); the sim platform answers FlashAttention
# for hybrid block alignment, so a --block-size must be a multiple of this.
KERNEL_BLOCK_ALIGNMENT = 16


def block_size_problem(block_size: int, mamba_cache_mode: str, max_num_batched_tokens: int) -> tuple[str, str] | None:
    """(field, what is wrong) when vLLM would refuse this block size at start-up, else None."""
    if block_size % KERNEL_BLOCK_ALIGNMENT:
        return ("block_size", f"{block_size} is not a multiple of {KERNEL_BLOCK_ALIGNMENT} (FlashAttention's "
                              f"kernel block sizes, which hybrid models are aligned to)")
    # VllmConfig.validate_block_size: in Mamba cache mode `align` a block must fit one step
    if mamba_cache_mode == "align" and block_size > max_num_batched_tokens:
        return ("max_num_batched_tokens", f"{max_num_batched_tokens} is below the block size {block_size}; "
                                          "vLLM's Mamba cache mode `align` needs block_size <= max_num_batched_tokens")
    return None


def hybrid_kv_groups(layers_by_kind: dict[str, int]) -> dict[str, int]:
    """How many KV-cache groups vLLM forms per kind of layer (kind -> layer count, draft layers
    included): ``_get_kv_cache_groups_uniform_page_size`` (0.25.1-0.30.0) splits every kind into
    groups of ``group_size`` layers, where group_size is the smallest kind's layer count, or the
    largest's when that is below 1.5 times the smallest (padding the last group of a kind).
    One kind alone is one group. 0.33.0 restructured this code: verify its groups in the engine
    log (the ``kvrepro-sim: geometry`` line) before relying on this."""
    counts = {kind: n for kind, n in layers_by_kind.items() if n > 0}
    if len(counts) <= 1:
        return {kind: 1 for kind in counts}
    smallest, largest = min(counts.values()), max(counts.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    return {kind: -(-n // group_size) for kind, n in counts.items()}


# -- the capable connector (engine.connector: capable; kvrepro/engine/capable.py) -----------------
# An OffloadingConnector subclass that declares `supports_divergent_local_hybrid_hits`, loaded by
# vLLM's connector factory from a module path (KVConnectorFactory.get_connector_class: the module path
# wins over the registry, 0.25.1-0.34.0 factory.py:102-120).
CAPABLE_CONNECTOR_CLASS = "CapableOffloadingConnector"
CAPABLE_CONNECTOR_MODULE = "kvrepro.engine.capable"
# The scheduler reads the declaration from 0.28.0 (#50344: Scheduler._get_local_prefix_cache_hit,
# scheduler.py:447 in 0.28.0, :472 0.29.0, :532 0.30.0, :533 0.31.0, :562 0.32.0, :668 0.33.0; the
# default False is KVConnectorBase_V1's, base.py:177 in 0.28.0). 0.25.1 and 0.26.0 hand every connector
# max(per-group hits), 0.27.0/0.27.1 hand every connector the full-attention hit
# (get_computed_blocks_for_connector whenever a connector is set): no release before 0.28.0 has the
# property, so the declaration would change nothing there. A 0.26.0 stack with the backport has it.
DIVERGENT_HITS_FLAG_SINCE = "0.28.0"
DIVERGENT_HITS_FLAG_PATCH = "pr-50344"


def divergent_hits_flag_problem(version: str, patches: tuple[str, ...] | list[str] = ()) -> str | None:
    """Why the capable connector means nothing on ``version`` + ``patches`` (None: the scheduler reads
    its declaration there)."""
    got = version_tuple(version)
    if got is not None and got >= version_tuple(DIVERGENT_HITS_FLAG_SINCE) or DIVERGENT_HITS_FLAG_PATCH in patches:
        return None
    return (f"vLLM {version} does not read supports_divergent_local_hybrid_hits (from "
            f"{DIVERGENT_HITS_FLAG_SINCE}, or with {DIVERGENT_HITS_FLAG_PATCH}): the capable connector would be the "
            "plain OffloadingConnector there")


# Prints the option strings of `vllm serve` (one JSON line after KVREPRO-FLAGS), run in the runtime
# env with a release's vllm/ on PYTHONPATH; `matrix validate` checks engine.extra_args with it.
# 0.26.0+ build the serve parser in ServeSubcommand.subparser_init; older layouts expose
# make_arg_parser. The CPU platform stands in for a GPU so config classes that look at the
# device can be built.
SERVE_FLAGS_SCRIPT = r"""
import json, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm")
try:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    serve = ServeSubcommand().subparser_init(parser.add_subparsers())
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    serve = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
sys.stdout.write("\nKVREPRO-FLAGS " + json.dumps(sorted(serve._option_string_actions)) + "\n")
# options whose destination names a secret (hf_token, api_key, ...; not long_prefill_token_threshold)
# and take a value: kvrepro masks their values in every spelling the parser accepts (kvrepro/secrets.py)
SECRET_WORDS = {"token", "key", "secret", "password", "passwd", "passphrase", "credential", "credentials", "auth"}
secret = {}
for option, action in serve._option_string_actions.items():
    if action.nargs == 0 or not option.startswith("--"):
        continue
    if str(action.dest).lower().split("_")[-1] in SECRET_WORDS:
        secret[option] = action.nargs if action.nargs in ("+", "*") else None
sys.stdout.write("\nKVREPRO-SECRET-OPTIONS " + json.dumps(secret, sort_keys=True) + "\n")
"""


class UnsupportedRelease(Exception):
    """A vLLM version the GPU-free engine has no adapter for yet; the message says what to do."""


def release(version: str) -> Release | None:
    """The table's entry for ``version`` (None for a release not in the table, unported ones too)."""
    for entry in RELEASES:
        if entry.version == version:
            return entry
    return None


_PLAIN_RELEASE = r"^(\d+)\.(\d+)\.(\d+)$"


def is_unported(version: str) -> bool:
    """A release newer than the newest entry, of the same major version: tried with the newest
    entry's settings (:func:`settings_for`) and marked unported wherever it is shown. A release
    between two entries, an older one or another major version (1.0.0, 9.9.9: another engine
    generation, or a typo) is not: it is refused as before."""
    import re

    m = re.match(_PLAIN_RELEASE, str(version))
    top = version_tuple(newest())
    if m is None or top is None or version in SUPPORTED_RELEASES:
        return False
    got = (int(m[1]), int(m[2]), int(m[3]))
    return got[0] == top[0] and got > top


def settings_for(version: str) -> Release:
    """The entry the GPU-free engine runs ``version`` with: its own, or for an unported release the
    newest entry's settings under its version (``unported_from`` says whose)."""
    entry = release(version)
    if entry is not None:
        return entry
    if is_unported(version):
        base = RELEASES[-1]
        return Release(version, torch=base.torch, rpc_answers=dict(base.rpc_answers),
                       notes=f"unported: tried with {base.version}'s settings", unported_from=base.version)
    raise UnsupportedRelease(unsupported(version) or f"vLLM {version}: not a release kvrepro can run")


def label(version: str) -> str:
    """How an output names a release: ``0.34.0``, or ``0.35.0 (unported)``."""
    return f"{version} (unported)" if is_unported(version) else version


def unported_note(version: str) -> str | None:
    """The one line every output carries for an unported release (None for a table entry)."""
    if not is_unported(version):
        return None
    return (f"vLLM {version} is unported: tried with {newest()}'s settings (kvrepro/versions.py); "
            f"`kvrepro release port {version}` names what it needs")


def require(version: str) -> Release:
    """The release entry (an unported one too), or UnsupportedRelease naming the supported ones."""
    try:
        return settings_for(version)
    except UnsupportedRelease:
        raise UnsupportedRelease(
            f"vLLM {version} has no GPU-free engine adapter in kvrepro (supported: "
            f"{', '.join(SUPPORTED_RELEASES)}, and unported releases newer than {newest()}); add it to "
            "kvrepro/versions.py following the porting checklist there"
        ) from None


def unsupported(version: str, unported_ok: bool = True) -> str | None:
    """Why ``version`` cannot be a base (None if it can): one message for matrix.yaml's ``base:``,
    ``--base``, the catalogue's present_in / fixed_in, so that 9.9.9 is bad input before anything
    is recorded, never a build that fails later. An unported release (:func:`is_unported`) can be
    a base; the catalogue, which states what was read and measured, passes ``unported_ok=False``."""
    if version in SUPPORTED_RELEASES or (unported_ok and is_unported(version)):
        return None
    newer = f", or an unported release newer than {newest()}" if unported_ok else ""
    return (f"{str(version)[:40]!r} is not a vLLM release kvrepro supports; supported: "
            f"{', '.join(SUPPORTED_RELEASES)}{newer}")


def newest() -> str:
    return SUPPORTED_RELEASES[-1]


# -- triage: a production log's release -----------------------------------------------------------
# `kvrepro triage` reads logs of releases kvrepro cannot run, too: one within this many minor
# versions of the supported range is reproduced on the nearest supported release (with a warning);
# one further away (another engine generation, a typo) is refused.
TRIAGE_NEAREST_MINORS = 3
_VERSION_HEAD = r"(\d+)\.(\d+)\.(\d+)"


def version_tuple(version: str) -> tuple[int, int, int] | None:
    """``0.26.0`` / ``0.26.0rc1`` / ``0.26.1.dev12+g1234`` -> (0, 26, 0); None if it is not a version."""
    import re

    m = re.match(_VERSION_HEAD, version.strip().lstrip("v"))
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def nearest_supported(version: str) -> str | None:
    """The supported release to reproduce a log of ``version`` on: itself when supported, else the
    closest one (same major, at most TRIAGE_NEAREST_MINORS minors outside the range), else None."""
    got = version_tuple(version)
    if got is None:
        return None
    exact = f"{got[0]}.{got[1]}.{got[2]}"
    if exact in SUPPORTED_RELEASES:
        return exact
    tuples = {r: version_tuple(r) for r in SUPPORTED_RELEASES}
    oldest, newest = tuples[SUPPORTED_RELEASES[0]], tuples[SUPPORTED_RELEASES[-1]]
    assert oldest is not None and newest is not None
    if got[0] != oldest[0] or not oldest[1] - TRIAGE_NEAREST_MINORS <= got[1] <= newest[1] + TRIAGE_NEAREST_MINORS:
        return None
    same_minor = [r for r, t in tuples.items() if t is not None and t[:2] == got[:2] and t <= got]
    if same_minor:
        return same_minor[-1]  # a patch release we lack: the newest supported one of its series below it
    return min(SUPPORTED_RELEASES, key=lambda r: (abs(tuples[r][1] - got[1]), tuples[r]))  # type: ignore[index]


# -- offload-tier faults (engine.sim.offload_faults; docs/faults.md) -------------------------------
# A fault is injected only where the release's connector can produce it, and does there what that
# connector does. Read from the release wheels (0.25.1-0.34.0):
# * vLLM's OffloadingConnector (engine.connector: offloading, and capable, its subclass): its worker
#   asserts that every finished transfer succeeded ("we currently do not support job failures";
#   OffloadingConnectorWorker.get_finished, OFFLOAD_WORKER_FILE, lines below) in 0.25.1-0.33.0, so
#   there a failed load or store kills the engine on that assertion, as it would on a GPU whose copy
#   failed. From 0.34.0 the worker reports a failed load per request (worker.py 306-315, collected by
#   OffloadingConnector.get_transfer_results, offloading_connector.py 154-160) and the scheduler side
#   marks the request `load_failed`: its later lookups, after a recompute or a preemption, never read
#   the tier again (offloading/scheduler.py 376-378, 1411, 2487); a failed store drops its chunks
#   from the CPU cache instead of publishing them (scheduler.py 2467-2478).
# * Connectors with a load-failure report, modelled over the OffloadingConnector by
#   kvrepro/engine/load_failures.py (the scheduler side stays vLLM's): Mooncake store
#   (mooncake-store-like) reports a failed load per request on a hybrid model from 0.31.0
#   (`_report_load_error` -> set_failed_request: mooncake/store/worker.py 0.31.0:1206-1208, 0.32.0 and
#   0.33.0:1111-1113, 0.34.0:1281-1283) and per block in 0.30.0 (`_add_load_error_block_ids`, worker.py
#   0.30.0:1468, 1480), and looks the request up again on the retry (store/scheduler.py
#   get_num_new_matched_tokens: 0.33.0:210-265, 0.34.0:230-280); NIXL (nixl-like) reports a failed
#   receive per request (nixl/base_worker.py 0.30.0:2655-2664, 0.31.0:2931, 0.33.0:3227,
#   0.34.0:3293) and triggers one transfer per request (`params["do_remote_prefill"] = False`,
#   nixl/pull_scheduler.py 0.30.0:188-189, 0.31.0-0.33.0:188, 0.34.0:191), so its retry is no
#   asynchronous load. Both need the scheduler's per-request path (KVConnectorOutput.failed_recving ->
#   Scheduler._handle_failed_recving), which exists from FAILED_RECVING_FROM; kvrepro models neither
#   connector's store failures (NIXL stores nothing; Mooncake's failed puts are not modelled).
# * ``kv_load_failure_policy`` (``fail``, the default, or ``recompute``) is a KVTransferConfig field in
#   every release (config/kv_transfer.py): what the scheduler does with a reported failed load.
FAILED_RECVING_FROM = "0.30.0"
OFFLOADING_REPORTS_FAILURES_FROM = "0.34.0"
MOONCAKE_PER_REQUEST_FROM = "0.31.0"
OFFLOAD_TRANSFER_ASSERT_LINE: dict[str, int] = {  # worker.py line of `assert transfer_result.success`
    "0.25.1": 319, "0.26.0": 343, "0.27.0": 361, "0.27.1": 361, "0.28.0": 361, "0.29.0": 277,
    "0.30.0": 285, "0.31.0": 288, "0.32.0": 288, "0.33.0": 301,
}
OFFLOAD_WORKER_FILE = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py"

# engine.connector -> (class, module) of the connectors vLLM loads from kvrepro by module path
# (KVConnectorFactory.get_connector_class: a module path wins over the registry, 0.25.1-0.34.0)
OUT_OF_TREE_CONNECTORS: dict[str, tuple[str, str]] = {
    "capable": (CAPABLE_CONNECTOR_CLASS, CAPABLE_CONNECTOR_MODULE),
    "mooncake-store-like": ("MooncakeStoreLikeConnector", "kvrepro.engine.load_failures"),
    "nixl-like": ("NixlLikeConnector", "kvrepro.engine.load_failures"),
}
# what each engine.connector reports a failed load as, and what its retry is
CONNECTOR_FAULT_MODELS: dict[str, str] = {
    "offloading": "vLLM's OffloadingConnector",
    "capable": "vLLM's OffloadingConnector",
    "mooncake-store-like": "Mooncake store (per-request report, re-lookup on the retry)",
    "nixl-like": "NIXL (per-request report, no asynchronous load on the retry)",
}


def _at_least(version: str, since: str) -> bool:
    got, first = version_tuple(version), version_tuple(since)
    return got is not None and first is not None and got >= first


def connector_of(class_name: str | None) -> str | None:
    """engine.connector for a --kv-transfer-config connector class (None: not one kvrepro drives)."""
    if class_name == "OffloadingConnector":
        return "offloading"
    return next((key for key, (cls, _) in OUT_OF_TREE_CONNECTORS.items() if cls == class_name), None)


def reports_failed_loads(version: str) -> bool:
    """Whether this release's scheduler takes a failed load per request (failed_recving)."""
    return _at_least(version, FAILED_RECVING_FROM)


def mooncake_reports_per_request(version: str) -> bool:
    """Whether Mooncake store reports a hybrid model's failed load per request (else per block)."""
    return _at_least(version, MOONCAKE_PER_REQUEST_FROM)


def offload_fault_effect(version: str, kind: str, connector: str = "offloading") -> str:
    """What a failed ``kind`` job does on ``version`` with ``connector`` (assumes it is allowed)."""
    if connector in ("offloading", "capable"):
        if _at_least(version, OFFLOADING_REPORTS_FAILURES_FROM):
            return ("the OffloadingConnector reports the failed load; the request never reads the tier again"
                    if kind == "load" else "the OffloadingConnector drops the store's chunks")
        line = OFFLOAD_TRANSFER_ASSERT_LINE.get(version)
        return f"the engine dies on assert transfer_result.success ({OFFLOAD_WORKER_FILE}:{line or '?'})"
    if connector == "mooncake-store-like":
        how = "per request (failed_recving)" if mooncake_reports_per_request(version) else \
            "per block (invalid_block_ids)"
        return f"reported {how} as Mooncake store does; the retry looks the tier up again"
    return "reported per request (failed_recving) as NIXL does; the retry loads nothing asynchronously"


def offload_fault_problem(version: str, kind: str, connector: str = "offloading") -> str | None:
    """Why a ``kind`` ("load" or "store") fault cannot be injected on ``version`` with ``connector``
    (None: it can; :func:`offload_fault_effect` says what it does)."""
    if connector in ("offloading", "capable"):
        return None  # every release's connector has a way to end on it: an assertion, or (0.34.0+) a report
    if connector not in CONNECTOR_FAULT_MODELS:
        return f"engine.connector {connector!r}: kvrepro injects offload faults only through {', '.join(CONNECTOR_FAULT_MODELS)}"
    model = CONNECTOR_FAULT_MODELS[connector]
    if kind == "store":
        return (f"{connector} models {model.split(' (')[0]}'s failed loads only (NIXL stores nothing; Mooncake's "
                "failed puts are not modelled); remove store_fail_rate/store_fail_at, or use engine.connector: "
                "offloading")
    if not reports_failed_loads(version):
        return (f"vLLM {version}'s scheduler takes no per-request load failure (KVConnectorOutput.failed_recving "
                f"is from {FAILED_RECVING_FROM}), which {connector} reports; use base >= {FAILED_RECVING_FROM}, "
                "or engine.connector: offloading (its worker asserts: the engine dies)")
    return None
