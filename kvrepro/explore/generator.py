"""Seeded run specs: which knobs of the base matrix a run changes, and to what.

Run 0 of every campaign is the base matrix as it is (the seed input, as a fuzzer starts from its
corpus): a campaign on a release where the base load already fails says so first. Run ``i > 0``
changes 1 to :data:`MAX_CHANGES` general knobs and up to two of its load profile's own settings,
and draws fresh load and engine seeds. The spec is a pure function of (campaign seed, index,
weights): a resumed campaign makes the same runs the interrupted one would have.

``weights`` (guided campaigns, kvrepro/explore/coverage.py) map ``knob=value`` to a weight >= 1;
a knob is chosen by its best value's weight and a value by its own weight. None: every choice
uniform (``--unguided``).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..spec.matrix import LoadSpec
from .vocabulary import KNOBS, PROFILE_PATH, Knob, Value, general_knobs, knob, profile_knobs, value_text

MAX_CHANGES = 4
SEED_RANGE = 2**31
ALL, LOAD = "all", "load"
VOCABULARIES = (ALL, LOAD)
LOAD_KNOBS = ("load.concurrency", "load.max_tokens")  # the general knobs a generic load changes


@dataclass(frozen=True)
class RunSpec:
    """One generated run: the base matrix with ``changes`` applied, and its seeds (None: the base's)."""

    index: int
    changes: tuple[tuple[str, Value], ...] = ()
    load_seed: int | None = None
    sim_seed: int | None = None

    def keys(self) -> list[str]:
        """The ``knob=value`` names of this run's changes (what coverage credits)."""
        return [knob(path).key(value) for path, value in self.changes]

    def describe(self) -> str:
        if not self.changes:
            return "base matrix as is"
        return ", ".join(f"{path}={value_text(value)}" for path, value in self.changes)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "changes": [[p, v] for p, v in self.changes],
                "load_seed": self.load_seed, "sim_seed": self.sim_seed}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> "RunSpec":
        return cls(index=int(value["index"]), changes=tuple((str(p), v) for p, v in value.get("changes") or ()),
                   load_seed=value.get("load_seed"), sim_seed=value.get("sim_seed"))


def _weighted(rng: random.Random, items: list[Any], weights: list[float]) -> Any:
    # random.choices with explicit weights consumes one random() call: deterministic per rng state
    return rng.choices(items, weights=weights, k=1)[0]


def _value_weight(weights: Mapping[str, float] | None, k: Knob, value: Value) -> float:
    return 1.0 if weights is None else float(weights.get(k.key(value), 1.0))


def _pick_value(rng: random.Random, k: Knob, weights: Mapping[str, float] | None) -> Value:
    values = list(k.values)
    return copy.deepcopy(_weighted(rng, values, [_value_weight(weights, k, v) for v in values]))


def _pick_knobs(rng: random.Random, knobs: list[Knob], count: int, weights: Mapping[str, float] | None) -> list[Knob]:
    chosen: list[Knob] = []
    left = list(knobs)
    while left and len(chosen) < count:
        k = _weighted(rng, left, [max(_value_weight(weights, k, v) for v in k.values) for k in left])
        chosen.append(k)
        left.remove(k)
    return chosen


def generate(seed: int, index: int, base_profile: str, weights: Mapping[str, float] | None = None,
             vocabulary: str = ALL, parent: RunSpec | None = None) -> RunSpec:
    """Run ``index`` of the campaign seeded ``seed`` over a base whose load profile is ``base_profile``.

    ``vocabulary`` :data:`LOAD`: only the base profile's load settings and the seeds change (a
    generic randomised load on the base engine, what a benchmark client with random settings
    would send), the yardstick the planted-bug benchmark measures the full vocabulary against.

    ``parent`` (guided campaigns: the earlier run that came closest to the code under test,
    campaign.py): the run keeps the parent's changes and changes 1-2 knobs more (AFL's mutation of a
    corpus entry), so a composition that needed several knobs at once is not drawn apart again."""
    if vocabulary not in VOCABULARIES:
        raise ValueError(f"vocabulary {vocabulary!r}: one of {', '.join(VOCABULARIES)}")
    if index == 0:
        return RunSpec(index=0)
    rng = random.Random(f"kvrepro-explore/{seed}/{index}")
    if parent is not None:
        return _mutate(rng, index, parent, base_profile, weights, vocabulary)
    changes: list[tuple[str, Value]] = []
    profile = base_profile
    general = general_knobs() if vocabulary == ALL else [k for k in general_knobs() if k.path in LOAD_KNOBS]
    for k in _pick_knobs(rng, general, rng.randint(1, MAX_CHANGES), weights):
        value = _pick_value(rng, k, weights)
        if k.path == PROFILE_PATH:
            profile = str(value)
        changes.append((k.path, value))
    for k in _pick_knobs(rng, profile_knobs(profile), rng.randint(0, 2), weights):
        changes.append((k.path, _pick_value(rng, k, weights)))
    order = {k.path: i for i, k in enumerate(KNOBS)}
    changes.sort(key=lambda c: order[c[0]])
    return RunSpec(index=index, changes=tuple(changes), load_seed=rng.randrange(SEED_RANGE),
                   sim_seed=rng.randrange(SEED_RANGE))


def _mutate(rng: random.Random, index: int, parent: RunSpec, base_profile: str,
            weights: Mapping[str, float] | None, vocabulary: str) -> RunSpec:
    """``parent``'s changes with 1-2 knobs set anew (a knob the parent left alone, or one of its own
    given another value), and fresh seeds."""
    changes = dict(parent.changes)
    profile = str(changes.get(PROFILE_PATH, base_profile))
    general = general_knobs() if vocabulary == ALL else [k for k in general_knobs() if k.path in LOAD_KNOBS]
    for k in _pick_knobs(rng, general + profile_knobs(profile), rng.randint(1, 2), weights):
        # another value than the parent's (or than the base's, None, for a knob the parent left
        # alone): a mutation that changes nothing would only rerun the parent with other seeds
        current = changes.get(k.path)
        values = [v for v in k.values if v != current] or list(k.values)
        value = copy.deepcopy(_weighted(rng, values, [_value_weight(weights, k, v) for v in values]))
        if k.path == PROFILE_PATH and value != profile:
            # another profile: the parent's settings of the old one mean nothing to it
            changes = {p: v for p, v in changes.items() if knob(p).profile is None}
            profile = str(value)
        changes[k.path] = value
    order = {k.path: i for i, k in enumerate(KNOBS)}
    return RunSpec(index=index, changes=tuple(sorted(changes.items(), key=lambda c: order[c[0]])),
                   load_seed=rng.randrange(SEED_RANGE), sim_seed=rng.randrange(SEED_RANGE))


def _set(data: dict[str, Any], path: str, value: Value) -> None:
    *parents, last = path.split(".")
    node = data
    for part in parents:
        if value is None and not isinstance(node.get(part), dict):
            return  # nothing to remove (an empty engine.geometry would mean a generated model config)
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if value is None:
        node.pop(last, None)
    else:
        node[last] = copy.deepcopy(value)


def apply(spec: RunSpec, data: Mapping[str, Any]) -> dict[str, Any]:
    """The matrix data of ``spec``: ``data`` (a parsed matrix.yaml) with its changes and seeds.

    Another load profile than the base's takes the base's generic load fields (concurrency,
    max_tokens, ...) but none of the base profile's own settings: they mean nothing to it."""
    out = copy.deepcopy(dict(data))
    load = out.setdefault("load", {})
    for path, value in spec.changes:
        if path == PROFILE_PATH and value != load.get("profile", "partial-prefix"):
            out["load"] = load = {k: v for k, v in load.items() if k in LoadSpec.model_fields}
        _set(out, path, value)
    if spec.load_seed is not None:
        load["seed"] = spec.load_seed
    if spec.sim_seed is not None:
        _set(out, "engine.sim.seed", spec.sim_seed)
    return out
