"""What a campaign composes runs from: one knob per row of :data:`KNOBS`.

A knob is a place in matrix.yaml (a dotted path) and the values a campaign may put there. A run
changes a few knobs of the base matrix (kvrepro/explore/generator.py); everything else stays as the
base has it, so a finding is always "the base, and these changes". Profile knobs (``profile=``)
only apply when the run's load profile is that one; they are the profile's own settings as its
``Settings`` in kvrepro/loadgen/profiles/ validates them.

New vocabulary is a new row (load.events is one: aborts, priorities, prefix-cache resets); offload-tier
faults become knobs the same way once the engine knows them (docs/explore.md).
Values are plain YAML data (what the matrix file would hold), so a run spec is saved and read back
as JSON without a schema of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Union

# a knob's value as matrix.yaml holds it (None: the key is removed, the spec's default applies)
Value = Union[None, bool, int, float, str, list, dict]


@dataclass(frozen=True)
class Knob:
    path: str  # dotted path in matrix.yaml: load.concurrency, engine.sim.load_steps
    values: tuple[Value, ...]
    profile: str | None = None  # only with this load profile (one of the profile's own settings)
    why: str = ""

    def key(self, value: Value) -> str:
        """How a (knob, value) pair is named in weights and coverage: ``engine.sim.load_steps=4``."""
        return setting_key(self.path, value)


def value_text(value: Value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


PROFILE_PATH = "load.profile"

KNOBS: tuple[Knob, ...] = (
    Knob(PROFILE_PATH, ("partial-prefix", "multi-turn", "shared_prefix"), why="the traffic's shape"),
    Knob("load.concurrency", (1, 2, 4), why="requests in flight: 1 is sequential, more interleave in one step"),
    Knob("load.max_tokens", (4, 8, 16), why="decode steps per request: MTP drafts and finish timing"),
    Knob("engine.num_speculative_tokens", (1, 2, 3), why="MTP draft tokens per step"),
    Knob("engine.max_num_seqs", (2, 4, 8), why="requests scheduled per step"),
    # not 64: with the default geometry and max_model_len 1024 vLLM refuses to start on 64 blocks
    # (_check_enough_kv_cache_memory), 7 of the first 62 runs of a 30-minute campaign on 0.26.0 lost
    # that way (explore-20261202-155324-aa7f); 80 is cross-group-eviction-assert's measured pressure
    Knob("engine.sim.num_gpu_blocks", (80, 96, 160), why="GPU KV pool: eviction pressure"),
    Knob("engine.connector", ("offloading", "capable"),
         why="capable: the OffloadingConnector declaring supports_divergent_local_hybrid_hits, the only way "
             "the scheduler takes get_computed_blocks_for_connector and its divergent-hit reconcile (0.28.0+; "
             "measured: the plain connector never runs them on 0.30.0)"),
    Knob("engine.sim.load_steps", (1, 2, 4), why="steps an offload load takes: async-load windows"),
    Knob("engine.sim.draft_acceptance_rate", (0.0, 0.7, 1.0), why="how many MTP drafts are accepted"),
    Knob("engine.geometry", (None, {"offload_chunk_tokens": 32}, {"mamba_groups": 1},
                             {"offload_chunk_tokens": 64}),
         why="KV-cache groups and offload chunk (kvrepro/spec/geometry.py)"),
    # after engine.geometry (changes apply in this order): merged into whatever geometry the run has
    Knob("engine.geometry.hash_block_size", (None, 8),
         why="the prefix-match unit (`--prefix-match-unit`, vLLM 0.26.0+) below the 16-token block: a local "
             "hit may end inside a KV block (#51468's lagging-Mamba truncation needs it)"),
    # the family's events (load.events, docs/load.md): what a client does besides sending a request
    Knob("load.events", (
        None,
        [{"at": 1, "every": 5, "abort": "queued", "abort_after_s": 0.1}],
        [{"at": 2, "every": 4, "abort": "first_token"}],
        [{"at": 3, "every": 6, "abort": "tokens", "after_tokens": 2}],
        [{"at": 1, "every": 3, "priority": -1}],
        [{"at": 10, "every": 20, "reset_prefix_cache": "local"}],
        [{"at": 12, "every": 24, "reset_prefix_cache": "external"}],
    ), why="aborts (queued, at the first token, mid-stream), priorities, prefix-cache resets (GPU, and the "
           "offload tier too)"),
    # partial-prefix's own settings
    Knob("load.schedule", ("revisit", "random"), profile="partial-prefix"),
    Knob("load.family_share", (0.35, 0.6, 0.9), profile="partial-prefix", why="a body / the GPU prefix cache"),
    Knob("load.align", ("block", "chunk", "none"), profile="partial-prefix", why="where reused parts end"),
    Knob("load.suffix_tokens", ([1, 8], [0, 32], [16, 64]), profile="partial-prefix"),
    # multi-turn's
    Knob("load.pressure", (1.0, 2.0, 4.0), profile="multi-turn", why="open sessions' context / GPU cache"),
    Knob("load.system_prompt_tokens", (0, 64, 256), profile="multi-turn"),
    # shared_prefix's
    Knob("load.documents", (2, 6, 12), profile="shared_prefix"),
    Knob("load.document_tokens", (200, 400, 800), profile="shared_prefix"),
)


def setting_key(path: str, value: Value) -> str:
    """``path=value`` as weights and coverage name it, for a knob or a corpus entry's own setting."""
    return f"{path}={value_text(value)}"


def knob(path: str) -> Knob:
    for k in KNOBS:
        if k.path == path:
            return k
    raise KeyError(path)


def general_knobs() -> list[Knob]:
    return [k for k in KNOBS if k.profile is None]


def profile_knobs(profile: str) -> list[Knob]:
    return [k for k in KNOBS if k.profile == profile]
