"""Write a matrix.yaml that reproduces the log's configuration on the GPU-free engine.

Built like a suite case (kvrepro/suite/run.py's entry_matrix): the default matrix.yaml with the
matched entry's fragment (its load and runs) merged over it, then the log's geometry: its release
(or the nearest supported one), attention block, offload chunk, MTP tokens, data parallelism and
Mamba cache mode. Builds: ``as-deployed`` (the release as shipped), ``upstream-fix`` (the backport
of the fix upstream names first, when it is not the clean set) and ``minimal-clean-set`` (the
smallest backport stack after which the catalogue expects no defect present). The patch files
are copied next to it (``builds/``), so the folder is self-contained.

Scaled, as examples/production-geometry.yaml is (docs/geometry.md): GPU blocks per rank are few
(eviction pressure is what reaches the crash), TP is not modelled (it shards heads inside a rank;
the scheduler sees the same block tables), dimensions are tiny. The KV groups of a hybrid model
are Qwen3-Next/Qwen3.5's (3 linear-attention : 1 full-attention layers: 3 Mamba groups and 1
full-attention group), the family the catalogue's defects were reported on.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import yaml

from ..errors import BadInputError
from ..secrets import redact
from ..spec.matrix import DEFAULT_MATRIX
from ..suite.catalogue import Entry
from ..versions import KERNEL_BLOCK_ALIGNMENT
from .matching import expected_verdict, upstream_fix
from .records import Triage

HYBRID_GROUPS = {"mamba_groups": 3, "full_attention_groups": 1}
LARGE_BLOCK = 256  # from this block size on, the pool and the prompts are sized in blocks
MAX_DP = 16


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else copy.deepcopy(value)
    return out


def build_matrix(triage: Triage, entry: Entry, entries: list[Entry], pattern_target: dict[str, str] | None
                 ) -> tuple[dict[str, Any], list[str]]:
    """The matrix (plain YAML data) and the notes to print with it."""
    assert triage.base is not None
    notes: list[str] = []
    if not entry.testable:
        notes.append(f"defects/ marks {entry.name} not testable here ({entry.not_testable}); this matrix has the "
                     "log's configuration but may not reach it")
    data = yaml.safe_load(DEFAULT_MATRIX.read_text())
    fragment = entry.fragment
    if isinstance(fragment.get("load"), dict) and fragment["load"].get("profile", data["load"]["profile"]) \
            != data["load"]["profile"]:
        data["load"] = {}
    data = _merge(data, fragment)
    cfg = triage.config
    engine = data["engine"]
    block = cfg.block_size or engine.get("block_size", 16)
    if block % KERNEL_BLOCK_ALIGNMENT:
        rounded = -(-block // KERNEL_BLOCK_ALIGNMENT) * KERNEL_BLOCK_ALIGNMENT
        notes.append(f"block size {block} is not a multiple of {KERNEL_BLOCK_ALIGNMENT}; reproduced with {rounded}")
        block = rounded
    chunk = cfg.offload_chunk_tokens or block
    if chunk % block:
        notes.append(f"offload chunk {chunk} is not a multiple of the block {block}; reproduced with one block")
        chunk = block
    dp = min(MAX_DP, max(1, cfg.data_parallel_size))
    if cfg.data_parallel_size > MAX_DP:
        notes.append(f"data parallel size {cfg.data_parallel_size} reproduced with {MAX_DP} ranks")
    mtp = cfg.num_speculative_tokens if cfg.speculative_method and cfg.num_speculative_tokens else 0
    if cfg.speculative_method and (cfg.speculative_method or "").lower() != "mtp":
        notes.append(f"speculative method {cfg.speculative_method}: the GPU-free engine drafts with MTP only; "
                     f"reproduced with MTP, {mtp or 1} token(s)")
        mtp = mtp or 1
    geometry: dict[str, Any] = {"block_size": block, "offload_chunk_tokens": chunk,
                                **(HYBRID_GROUPS if cfg.hybrid else {"mamba_groups": 0, "full_attention_groups": 1}),
                                "num_speculative_tokens": mtp, "data_parallel_size": dp}
    engine.pop("block_size", None)
    engine.pop("num_speculative_tokens", None)
    engine["geometry"] = geometry
    engine["mamba_cache_mode"] = cfg.mamba_cache_mode or "align"
    engine["speculative_method"] = "mtp" if mtp else "none"
    engine["enable_prefix_caching"] = cfg.prefix_caching
    if block >= LARGE_BLOCK:
        engine["max_num_batched_tokens"] = max(2048, 4 * block)
        engine["max_model_len"] = 9 * block  # prompts of up to 9 chunks, as examples/production-geometry.yaml
        engine.setdefault("sim", {})["num_gpu_blocks"] = 32
        data.setdefault("runs", {}).update(request_timeout_s=120.0, stall_timeout_s=60.0)
    else:
        engine["max_num_batched_tokens"] = max(engine.get("max_num_batched_tokens", 2048), block)
    if dp > 1 and data["load"].get("profile", "partial-prefix") == "partial-prefix":
        # a family's requests on one rank, as a prefix-aware router sends them: with vLLM's own
        # balancing the revisits rarely meet on one rank (docs/geometry.md)
        data["load"]["dp_routing"] = "affinity"
    runs = data.setdefault("runs", {})
    runs["repetitions"] = 1
    runs["start_timeout_s"] = max(float(runs.get("start_timeout_s", 120)), 120.0 * dp)
    runs["duration_s"] = max(float(runs.get("duration_s", 120)), 900.0)
    if pattern_target:
        data["target_signature"] = pattern_target

    base = triage.base
    builds: dict[str, list[str]] = {"as-deployed": []}
    fix = upstream_fix(entry, base)
    clean = triage.minimal_clean_set
    if fix and tuple(fix) != tuple(clean or ()):
        builds["upstream-fix"] = list(fix)
    if clean:
        builds["minimal-clean-set"] = list(clean)
    elif clean is None:
        notes.append(f"no backport stack in the catalogue cures {base}; upgrade to "
                     f"{', '.join(triage.best.fixed_in_releases) if triage.best else 'a fixed release'}")
    used = [p for stack in builds.values() for p in stack]
    data["patches"] = {name: spec for name, spec in (data.get("patches") or {}).items() if name in used}
    data.update(base=base, common=[], builds=builds)
    data["expect"] = {name: _plain_expect(expected_verdict(entries, base, tuple(stack), entry))
                      for name, stack in builds.items()}
    return data, notes


def _plain_expect(verdict: str) -> str:
    # a named CORRUPT(...) needs every named defect in every run; the emitted matrix asks for CORRUPT
    return "CORRUPT" if verdict.startswith("CORRUPT(") else verdict


def write_matrix(folder: Path, data: dict[str, Any], triage: Triage, entry: Entry, notes: list[str]) -> Path:
    """``folder/matrix.yaml`` and ``folder/builds/`` (the patch files); every line redacted."""
    if folder.exists() and not folder.is_dir():
        raise BadInputError(f"--emit {folder}: is a file; give a folder to write matrix.yaml into")
    target = folder / "matrix.yaml"
    if target.exists():
        raise BadInputError(f"--emit {folder}: already holds a matrix.yaml; give a new folder (nothing overwritten)")
    (folder / "builds").mkdir(parents=True, exist_ok=True)
    source_builds = DEFAULT_MATRIX.parent / "builds"
    for spec in data["patches"].values():
        shutil.copyfile(source_builds / spec["file"], folder / "builds" / spec["file"])
    cfg = triage.config
    header = [
        f"# kvrepro triage of {Path(triage.log).name}: reproduces {entry.name} ({entry.title})",
        f"# as deployed: vLLM {cfg.release}, {cfg.model or 'model not in the log'}"
        f" ({cfg.architecture or 'architecture not in the log'}), DP{cfg.data_parallel_size} x TP{cfg.tensor_parallel_size},"
        f" {cfg.kv_connector or 'no KV connector'}, Mamba cache mode {cfg.mamba_cache_mode or 'none'},"
        f" block {cfg.block_size or 'default'}, speculative {cfg.speculative_method or 'none'}"
        f"{' x ' + str(cfg.num_speculative_tokens) if cfg.num_speculative_tokens else ''}",
        "# builds: as-deployed (the release as shipped), upstream-fix (the backport of the fix upstream names",
        "# first), minimal-clean-set (the smallest backport stack after which defects/ expects no defect present)",
        "# scaled for the GPU-free engine as kvrepro/triage/emit.py says (pool, dimensions; TP not modelled)",
        *(f"# note: {n}" for n in [*triage.warnings, *notes]),
        "",
    ]
    text = "\n".join(header) + yaml.safe_dump(data, sort_keys=False)
    target.write_text(redact(text))
    return target
