"""engine.geometry -> the model config.json that makes vLLM lay out that KV cache.

vLLM forms KV-cache groups from the model's layers (``kvrepro.versions.hybrid_kv_groups``): each
kind of layer (Gated-DeltaNet = Mamba ``align``, full attention; the MTP draft layer counts as
full attention) is split into groups of the smaller kind's layer count. So the number of groups
is set by the number of layers of each kind, which is all this module changes in the template
config (``engine.model``'s config.json, a Qwen3-Next style ``layer_types`` model): the tiny
dimensions stay, because the GPU-free engine never computes with them.

Block size: with the tiny dimensions a Gated-DeltaNet state (3 KiB) fits in any attention page of
16 tokens or more, so vLLM keeps the ``--block-size`` it is given (and pads the Mamba page up to
it) instead of raising it, as it would with production dimensions; the production block size is
therefore given, not derived (see docs/geometry.md).

The generated folder lives under ``$KVREPRO_HOME/models/`` and is named by the hash of its
contents, so every run of the same geometry serves the same folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .. import paths, versions
from ..errors import SpecError

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class LayerPlan:
    """How many layers of each kind the generated model has, and the groups vLLM makes of them."""

    linear_layers: int
    full_layers: int  # of the target model
    draft_layers: int  # MTP layers (full attention, grouped with the target's)
    groups: dict  # kind -> KV-cache groups vLLM forms (versions.hybrid_kv_groups)

    @property
    def layer_types(self) -> list[str]:
        """Linear layers spread evenly between full-attention ones, each run ending in one (as
        Qwen3-Next's ``full_attention_interval`` lays them out)."""
        types: list[str] = []
        runs = self.full_layers
        for i in range(runs):
            lo, hi = self.linear_layers * i // runs, self.linear_layers * (i + 1) // runs
            types += [LINEAR] * (hi - lo) + [FULL]
        return types or [LINEAR] * self.linear_layers


def layer_plan(mamba_groups: int, full_attention_groups: int, draft_layers: int) -> LayerPlan:
    """The fewest layers that make vLLM form ``mamba_groups`` + ``full_attention_groups`` groups
    with no padding layer, given ``draft_layers`` MTP layers (0 or 1) joining full attention."""
    if mamba_groups == 0:
        full = 1
        linear = 0
    elif full_attention_groups == 1:
        # the full-attention kind is the smaller one: group size = its layer count
        group = 1 + draft_layers
        full, linear = 1, mamba_groups * group
    else:
        # the Mamba kind is the smaller one (one group of one layer): group size 1
        full, linear = full_attention_groups - draft_layers, 1
        if full < 1:
            raise SpecError(f"engine.geometry: {full_attention_groups} full-attention groups with "
                            f"{draft_layers} MTP layer(s) leave no target full-attention layer")
    groups = versions.hybrid_kv_groups({"mamba": linear, "full_attention": full + draft_layers})
    groups.setdefault("mamba", 0)
    return LayerPlan(linear_layers=linear, full_layers=full, draft_layers=draft_layers, groups=groups)


def generated_config(template: dict, engine) -> tuple[dict, LayerPlan]:
    """The template config rewritten for ``engine.geometry`` (an EngineSpec with geometry)."""
    g = engine.geometry
    if "layer_types" not in template:
        raise SpecError("engine.geometry needs a Qwen3-Next style model config (with `layer_types` of "
                        "'linear_attention' and 'full_attention'); engine.model's config.json has none")
    draft = 1 if engine.speculative_method == "mtp" and engine.num_speculative_tokens > 0 else 0
    plan = layer_plan(g.mamba_groups, g.full_attention_groups, draft)
    config = dict(template)
    config["layer_types"] = plan.layer_types
    config["num_hidden_layers"] = len(plan.layer_types)
    if plan.full_layers:
        config["full_attention_interval"] = max(1, len(plan.layer_types) // plan.full_layers)
    config["num_nextn_predict_layers"] = 1  # the MTP module; used only when MTP is on
    # vLLM refuses a --max-model-len beyond the model's positions
    config["max_position_embeddings"] = max(int(template.get("max_position_embeddings", 0)), engine.max_model_len)
    config["_comment"] = (
        f"kvrepro: generated from {template.get('model_type', '?')} config for engine.geometry: "
        f"{plan.linear_layers} Gated-DeltaNet + {plan.full_layers} full-attention layers (+ {plan.draft_layers} MTP), "
        f"so vLLM forms {plan.groups['mamba']} Mamba + {plan.groups['full_attention']} full-attention KV-cache "
        f"groups; block {engine.block_size}, offload chunk {engine.offload_chunk_tokens}. Tiny dimensions, no weights."
    )
    return config, plan


def materialize(template_dir: Path, engine, root: Path | None = None) -> Path:
    """Write (once) the generated model folder for ``engine.geometry``; its path."""
    try:
        template = json.loads((template_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"engine.model: cannot read {template_dir / 'config.json'}: {exc}") from None
    config, _ = generated_config(template, engine)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    others = sorted(p for p in template_dir.iterdir() if p.is_file() and p.name != "config.json")
    digest = hashlib.sha256(text.encode())
    for p in others:
        digest.update(p.name.encode() + b"\0" + p.read_bytes())
    root = root or paths.home() / "models"
    folder = root / f"{template_dir.name}-geometry-{digest.hexdigest()[:12]}"
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        for p in others:  # the tokenizer files
            shutil.copy2(p, tmp / p.name)
        (tmp / "config.json").write_text(text)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process made it first: same contents
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def describe(engine) -> str:
    """One line for `matrix validate`: what the engine will look like."""
    g = engine.geometry
    draft = 1 if engine.speculative_method == "mtp" and engine.num_speculative_tokens > 0 else 0
    plan = layer_plan(g.mamba_groups, g.full_attention_groups, draft)
    chunk = engine.offload_chunk_tokens
    return (f"{plan.groups['mamba']} Mamba + {plan.groups['full_attention']} full-attention KV groups "
            f"({plan.linear_layers} GDN + {plan.full_layers} attention layers + {plan.draft_layers} MTP), "
            f"block {engine.block_size}, offload chunk {chunk} ({chunk // engine.block_size} block(s)), "
            f"{engine.num_speculative_tokens} speculative token(s), {g.data_parallel_size} DP rank(s)")


# The GPU-free engine's line (kvrepro/engine/executor.py:_log_geometry) saying what vLLM built;
# parse_geometry_line is its one parser (the load's capacity and the run's check both read it)
GEOMETRY_TAG = "kvrepro-sim: geometry "
_BUILT_RE = re.compile(r"kvrepro-sim: geometry (?:kv_cache_groups=(?P<groups>\S+) )?.*?\bblock_size=(?P<block>\d+) "
                       r"offload_chunk_tokens=(?P<chunk>\d+|-)(?:\s.*?\bdata_parallel_size=(?P<dp>\d+))?")


@dataclass(frozen=True)
class BuiltGeometry:
    """One ``kvrepro-sim: geometry`` line: the KV geometry vLLM built in one rank."""

    groups: str | None  # ``<index>:<kind>/<block>,...`` as logged (None: an older line without it)
    block_size: int
    offload_chunk_tokens: str  # digits, or ``-`` (no offloading connector)
    data_parallel_size: int | None

    @property
    def chunk_tokens(self) -> int | None:
        return int(self.offload_chunk_tokens) if self.offload_chunk_tokens.isdigit() else None


def parse_geometry_line(text: str) -> BuiltGeometry | None:
    """The geometry a log line states, or None when it is not such a line."""
    if GEOMETRY_TAG not in text:
        return None
    m = _BUILT_RE.search(text)
    if m is None:
        return None
    return BuiltGeometry(groups=m["groups"], block_size=int(m["block"]), offload_chunk_tokens=m["chunk"],
                         data_parallel_size=int(m["dp"]) if m["dp"] else None)


def geometry_lines(log_text: str) -> list[BuiltGeometry]:
    """Every geometry line of a log's text, in order."""
    return [g for line in log_text.splitlines() if (g := parse_geometry_line(line)) is not None]


def built_mismatch(engine, built: Iterable[BuiltGeometry] | str) -> str | None:
    """What the engine log says vLLM built (its geometry lines, or the log's text), against
    ``engine.geometry``: None when they agree or the log says nothing (an engine that is not the
    GPU-free one), else a title for an INFRA verdict: a run on another geometry than the matrix
    describes says nothing about it."""
    g = engine.geometry
    if g is None:
        return None
    for one in geometry_lines(built) if isinstance(built, str) else built:
        if one.groups is None or one.data_parallel_size is None:
            continue
        kinds = [part.split(":", 1)[1].split("/", 1)[0] for part in one.groups.split(",") if ":" in part]
        got = (kinds.count("mamba"), kinds.count("full_attention"), one.block_size, one.offload_chunk_tokens,
               one.data_parallel_size)
        asked = (g.mamba_groups, g.full_attention_groups, engine.block_size, str(engine.offload_chunk_tokens),
                 g.data_parallel_size)
        if got != asked:
            return (f"the engine built another geometry than engine.geometry: {got[0]} Mamba + {got[1]} "
                    f"full-attention groups ({one.groups}), block {got[2]}, offload chunk {got[3]}, "
                    f"{got[4]} DP rank(s); asked: {asked[0]} + {asked[1]} groups, block {asked[2]}, "
                    f"chunk {asked[3]}, {asked[4]} rank(s) (vLLM's grouping rule: kvrepro/versions.py)")
    return None
