"""Write a matrix.yaml that reproduces the log's configuration on the GPU-free engine.

Built like a suite case (kvrepro/suite/run.py's entry_matrix): the default matrix.yaml with the
matched entry's fragment (its load and runs) merged over it, then the log's geometry: its release
(or the nearest supported one), attention block, offload chunk, MTP tokens, data parallelism and
Mamba cache mode. Builds: ``as-deployed`` (the release as shipped), ``upstream-fix`` (the backport
of the fix upstream names first, when it is not the clean set) and ``minimal-clean-set`` (the
smallest backport stack after which the catalogue expects no defect present). The patch files
are copied next to it (``builds/``), so the folder is self-contained.

A log is data, never a program (issue 44). What the matrix takes from the log (block, chunk, MTP
tokens, DP ranks, Mamba cache mode) is checked against matrix.yaml's own bounds (the spec's
fields, :func:`checked_log_values`) and a value out of them is the log's line, exit 2. The matrix
is plain data dumped by the YAML library; its comment header quotes each log value on one line
(:func:`kvrepro.untrusted.quote`: line breaks escaped, 80 characters at most); the text is read
back and must give exactly the data meant and a header that is only comments. It names only the
shipped matrix's patches (never a file outside the folder) and no `vllm serve` option that loads
code (:data:`CODE_LOADING_FLAGS`), whatever the catalogue fragment says. Files are written
through :class:`kvrepro.untrusted.WriteFolder`: never through a link that leaves the folder.

Scaled, as examples/production-geometry.yaml is (docs/geometry.md): GPU blocks per rank are few
(eviction pressure is what reaches the crash), TP is not modelled (it shards heads inside a rank;
the scheduler sees the same block tables), dimensions are tiny. The KV groups of a hybrid model
are Qwen3-Next/Qwen3.5's (3 linear-attention : 1 full-attention layers: 3 Mamba groups and 1
full-attention group), the family the catalogue's defects were reported on.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..errors import BadInputError
from ..secrets import redact
from ..spec.matrix import DEFAULT_MATRIX, SHIPPED_MODELS, EngineSpec, GeometrySpec
from ..spec.yamltext import StrictLoader
from ..untrusted import WriteFolder, one_line, quote, writing
from ..suite.catalogue import Entry
from ..versions import KERNEL_BLOCK_ALIGNMENT
from .matching import expected_verdict, upstream_fix
from .records import Triage

HYBRID_GROUPS = {"mamba_groups": 3, "full_attention_groups": 1}
LARGE_BLOCK = 256  # from this block size on, the pool and the prompts are sized in blocks
MAX_DP = 16
# `vllm serve` options that make the engine import, load or run code or read a file named by the
# value (normalised: no dashes, '_' as '-'); an emitted matrix never has one (module docstring)
CODE_LOADING_FLAGS = frozenset({
    "worker-extension-cls", "worker-cls", "chat-template",
    "trust-remote-code", "tokenizer", "logits-processors", "logits-processor-pattern", "tool-parser-plugin",
    "reasoning-parser-plugin", "io-processor-plugin", "middleware", "model-loader-extra-config", "load-format",
    "speculative-config", "config", "hf-overrides", "allowed-local-media-path", "code-revision", "ssl-keyfile",
    "ssl-certfile", "ssl-ca-certs", "model-impl", "compilation-config", "structured-outputs-config",
})


# JSON-valued options that load code only through some keys (kv_connector_module_path, an offloading
# spec's spec_module_path, a class by name): their JSON is read, and refused when it has such a key
# (the catalogue's multi-tier entries pass --kv-transfer-config with spec_name: TieringOffloadingSpec)
JSON_CONFIG_FLAGS = frozenset({"kv-transfer-config", "kv-events-config"})
_CODE_KEY = re.compile(r"module_path|_cls$|_class$|^class_name$", re.I)


def _code_keys(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [k for k in value if _CODE_KEY.search(str(k))] + [c for v in value.values() for c in _code_keys(v)]
    if isinstance(value, list):
        return [c for v in value for c in _code_keys(v)]
    return []


def checked_log_values(triage: Triage) -> None:
    """Every value the emitted matrix takes from the log, against the bounds matrix.yaml's own
    fields have (GeometrySpec, EngineSpec): BadInputError naming the log's line otherwise."""
    cfg = triage.config
    checks: list[tuple[str, str, type, Any]] = [
        ("block_size", "block_size", GeometrySpec, cfg.block_size),
        ("offload_chunk_tokens", "offload_chunk_tokens", GeometrySpec, cfg.offload_chunk_tokens),
        ("mamba_cache_mode", "mamba_cache_mode", EngineSpec, cfg.mamba_cache_mode),
    ]
    if cfg.speculative_method and cfg.num_speculative_tokens is not None:
        checks.append(("num_speculative_tokens", "num_speculative_tokens", GeometrySpec, cfg.num_speculative_tokens))
    if cfg.data_parallel_size < 1:
        checks.append(("data_parallel_size", "data_parallel_size", GeometrySpec, cfg.data_parallel_size))
    for what, field, model, value in checks:
        if value is None:
            continue
        try:
            model.model_validate({field: value})
        except ValidationError as exc:
            err = exc.errors()[0]
            msg = str((err.get("ctx") or {}).get("error") or err["msg"]).removeprefix("Value error, ")
            line = cfg.lines.get(what)
            where = f"{triage.log}:{line}" if line else triage.log
            spec = "engine.geometry" if model is GeometrySpec else "engine"
            raise BadInputError(f"{where}: {what} {quote(value)}: {quote(msg, 160)} (the bound {spec}.{field} has in "
                                "matrix.yaml, docs/reliability.md); no matrix written: correct the value in a copy "
                                "of the log, or write the matrix by hand") from None


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
    checked_log_values(triage)
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
        notes.append(f"data parallel size {quote(cfg.data_parallel_size)} reproduced with {MAX_DP} ranks")
    mtp = cfg.num_speculative_tokens if cfg.speculative_method and cfg.num_speculative_tokens else 0
    if cfg.speculative_method and (cfg.speculative_method or "").lower() != "mtp":
        notes.append(f"speculative method {quote(cfg.speculative_method)}: the GPU-free engine drafts with MTP only; "
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
    runs["repetitions"] = entry.absent_after  # the repetitions a fixed build needs to show ABSENT (1 mostly)
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
    # an attention-only deployment has no Mamba group, so no hybrid hole can be expected of it
    groups = ("mamba", "full_attention") if geometry["mamba_groups"] else ("full_attention",)
    data["expect"] = {name: _plain_expect(expected_verdict(entries, base, tuple(stack), entry, groups))
                      for name, stack in builds.items()}
    return data, notes


def _plain_expect(verdict: str) -> str:
    # a named CORRUPT(...) needs every named defect in every run; the emitted matrix asks for CORRUPT
    return "CORRUPT" if verdict.startswith("CORRUPT(") else verdict


def _shipped_only(data: dict[str, Any]) -> None:
    """What no log or catalogue fragment may bring into an emitted matrix (module docstring)."""
    shipped = (yaml.safe_load(DEFAULT_MATRIX.read_text()) or {}).get("patches") or {}
    for name, spec in data["patches"].items():
        if shipped.get(name) != spec or "/" in str(spec.get("file", "/")) or spec.get("outside_matrix_folder"):
            raise BadInputError(f"patch {quote(name)}: not one of the shipped matrix's patches; a triaged matrix "
                                "names only those")
    engine = data.get("engine") or {}
    args = [str(a) for a in engine.get("extra_args") or []]
    for i, arg in enumerate(args):
        name = arg.lstrip("-").split("=", 1)[0].split(".", 1)[0].replace("_", "-").lower()
        if not arg.startswith("--"):
            continue
        if name in JSON_CONFIG_FLAGS:
            text = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            try:
                keys = _code_keys(json.loads(text)) if "." not in arg.split("=", 1)[0] else [arg]
            except ValueError:
                keys = ["(not JSON)"]
            if keys:
                raise BadInputError(f"engine.extra_args: {quote(arg)} names code to load ({quote(', '.join(keys))}); "
                                    "a triaged matrix never passes it to the engine")
        elif name in CODE_LOADING_FLAGS:
            raise BadInputError(f"engine.extra_args: {quote(arg)} loads code or files; a triaged matrix never "
                                "passes it to the engine (the catalogue fragment must not either)")
    model = str(engine.get("model", ""))
    if model and not (SHIPPED_MODELS / model / "config.json").is_file() or "/" in model:
        raise BadInputError(f"engine.model {quote(model)}: not a model kvrepro ships; a triaged matrix runs only those")


def header_lines(triage: Triage, entry: Entry, notes: list[str]) -> list[str]:
    """The comment header: fixed words and log values, each redacted, then quoted on one line."""
    cfg = triage.config

    def q(value: object, default: str) -> str:
        return quote(redact(str(value))) if value not in (None, "") else default

    spec = q(cfg.speculative_method, "none") + (f" x {q(cfg.num_speculative_tokens, '')}"
                                                 if cfg.num_speculative_tokens else "")
    lines = [
        f"kvrepro triage of {q(Path(triage.log).name, 'the log')}: reproduces {entry.name} ({q(entry.title, '')})",
        f"as deployed: vLLM {q(cfg.release, 'release not in the log')}, {q(cfg.model, 'model not in the log')}"
        f" ({q(cfg.architecture, 'architecture not in the log')}), DP{q(cfg.data_parallel_size, '1')}"
        f" x TP{q(cfg.tensor_parallel_size, '1')}, {q(cfg.kv_connector, 'no KV connector')},"
        f" Mamba cache mode {q(cfg.mamba_cache_mode, 'none')}, block {q(cfg.block_size, 'default')},"
        f" speculative {spec}",
        "builds: as-deployed (the release as shipped), upstream-fix (the backport of the fix upstream names",
        "first), minimal-clean-set (the smallest backport stack after which defects/ expects no defect present)",
        "scaled for the GPU-free engine as kvrepro/triage/emit.py says (pool, dimensions; TP not modelled)",
        *(f"note: {quote(redact(n), 400)}" for n in [*triage.warnings, *notes]),
    ]
    return ["# " + one_line(line) for line in lines]


def matrix_text(data: dict[str, Any], header: list[str]) -> str:
    """The file: the header, then ``data`` dumped by the YAML library; read back, it must be
    ``data`` exactly and the header must hold nothing but comments (else a bug: never written)."""
    body = yaml.safe_dump(data, sort_keys=False, allow_unicode=False, width=100)
    text = "\n".join(header) + "\n\n" + body
    head = "\n".join(header) + "\n"
    if any(not line.startswith("# ") for line in header) or yaml.load(head, Loader=StrictLoader) is not None \
            or yaml.load(text, Loader=StrictLoader) != data:  # noqa: S506 (a SafeLoader subclass)
        raise BadInputError("the matrix triage built does not read back as built; nothing written (a kvrepro bug: "
                            "please report it with the log)")
    return text


def write_matrix(folder: Path, data: dict[str, Any], triage: Triage, entry: Entry, notes: list[str]) -> Path:
    """``folder/matrix.yaml`` and ``folder/builds/`` (the patch files), never through a link that
    leaves ``folder`` (kvrepro/untrusted.py); the header's log values redacted and quoted."""
    if folder.exists() and not folder.is_dir() and not folder.is_symlink():
        raise BadInputError(f"--emit {quote(folder, 200)}: is a file; give a folder to write matrix.yaml into")
    _shipped_only(data)
    text = matrix_text(data, header_lines(triage, entry, notes))
    source_builds = DEFAULT_MATRIX.parent / "builds"
    with writing(f"--emit {quote(folder, 200)}", "give --emit a new folder (nothing overwritten)", prefix="--emit "), \
            WriteFolder(folder) as out:
        if out.exists("matrix.yaml"):
            raise BadInputError(f"--emit {quote(folder, 200)}: already holds a matrix.yaml; give a new folder "
                                "(nothing overwritten)")
        for spec in data["patches"].values():
            out.write(Path("builds") / spec["file"], (source_builds / spec["file"]).read_bytes(), replace=True)
        return out.write("matrix.yaml", text)
