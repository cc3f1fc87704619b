"""Seeded run specs: which knobs of the base matrix a run changes, and to what.

Run 0 of every campaign is the base matrix as it is (the seed input, as a fuzzer starts from its
corpus): a campaign on a release where the base load already fails says so first. Run ``i > 0``
changes 1 to :data:`MAX_CHANGES` general knobs and up to two of its load profile's own settings,
and draws fresh load and engine seeds. The spec is a pure function of (campaign seed, index,
weights): a resumed campaign makes the same runs the interrupted one would have.

``weights`` (guided campaigns, kvrepro/explore/coverage.py) map ``knob=value`` to a weight >= 1;
a knob is chosen by its best value's weight and a value by its own weight. None: every choice
uniform (``--unguided``).

Guided campaigns also start from a *seed corpus* (syzkaller's corpus, AFL's seed inputs): the
engine and load fragments of the known-defect catalogue's entries (:func:`seed_corpus`). A family
of defects shares its preconditions, so a new member is likeliest near a known member's trigger:
runs 1.. replay each entry once (:func:`replay`, with fresh seeds unless the entry pins its own)
before the campaign goes on mutating whichever run came closest. A replayed entry or a mutation of
one carries the entry's name (``RunSpec.seed_entry``): a finding that descends from a catalogue
entry says so.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..spec.matrix import LoadSpec
from .vocabulary import KNOBS, PROFILE_PATH, Knob, Value, general_knobs, knob, profile_knobs, setting_key, value_text

MAX_CHANGES = 4
SEED_RANGE = 2**31
SEED_JOIN = "+"  # between the names of catalogue entries that share one seed (RunSpec.seed_entries)
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
    seed_entry: str | None = None  # the catalogue entry this run replays or descends from (seed corpus)

    @property
    def seed_entries(self) -> tuple[str, ...]:
        """The catalogue entries named by ``seed_entry`` (entries sharing one fragment are one seed)."""
        return tuple(self.seed_entry.split(SEED_JOIN)) if self.seed_entry else ()

    def keys(self) -> list[str]:
        """The ``knob=value`` names of this run's changes (what coverage credits); a seed corpus
        entry's settings outside the vocabulary are named the same way."""
        return [setting_key(path, value) for path, value in self.changes]

    def describe(self) -> str:
        text = ", ".join(setting_key(path, value) for path, value in self.changes) or "base matrix as is"
        return f"from {self.seed_entry}: {text}" if self.seed_entry else text

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "changes": [[p, v] for p, v in self.changes],
                "load_seed": self.load_seed, "sim_seed": self.sim_seed, "seed_entry": self.seed_entry}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> "RunSpec":
        return cls(index=int(value["index"]), changes=tuple((str(p), v) for p, v in value.get("changes") or ()),
                   load_seed=value.get("load_seed"), sim_seed=value.get("sim_seed"),
                   seed_entry=value.get("seed_entry"))


_POSITION = {k.path: i for i, k in enumerate(KNOBS)}


def _order(path: str) -> int:
    # changes apply in vocabulary order (profile first, engine.geometry before its own keys); a corpus
    # entry's settings outside the vocabulary come after, in the entry's order (sorted() is stable)
    return _POSITION.get(path, len(KNOBS))


def _profile_setting(path: str) -> bool:
    """A load profile's own setting (it means nothing to another profile)."""
    try:
        return knob(path).profile is not None
    except KeyError:
        return path.startswith("load.") and path.split(".", 1)[1] not in LoadSpec.model_fields


def _flatten(prefix: str, data: Mapping[str, Any]) -> list[tuple[str, Value]]:
    out: list[tuple[str, Value]] = []
    for key, value in data.items():
        path = f"{prefix}.{key}"
        if isinstance(value, Mapping) and value:
            out.extend(_flatten(path, value))
        else:
            out.append((path, copy.deepcopy(value)))
    return out


def seed_corpus(fragments: Iterable[tuple[str, Mapping[str, Any]]]) -> tuple[RunSpec, ...]:
    """The seed corpus of ``(entry name, matrix fragment)`` pairs (the catalogue's ``matrix:``): each
    fragment's ``engine:`` and ``load:`` settings as changes (leaves, so a mutation can change one
    and keep the rest; ``runs:`` is the campaign's own), its pinned seeds as the spec's. A fragment
    that changes nothing (the base matrix: run 0) is left out, and entries with the same fragment
    are one seed."""
    out: dict[tuple[Any, ...], RunSpec] = {}
    for name, fragment in fragments:
        changes = [c for part in ("engine", "load") if isinstance(fragment.get(part), Mapping)
                   for c in _flatten(part, fragment[part])]
        seeds = dict(changes)
        load_seed, sim_seed = seeds.get("load.seed"), seeds.get("engine.sim.seed")
        changes = [(p, v) for p, v in changes if p not in ("load.seed", "engine.sim.seed")]
        changes.sort(key=lambda c: _order(c[0]))
        key = (value_text(changes), load_seed, sim_seed)
        if not changes and load_seed is None and sim_seed is None:
            continue
        if key in out:  # entries that share a trigger: one seed, named after all of them
            name = f"{out[key].seed_entry}{SEED_JOIN}{name}"
        out[key] = RunSpec(index=-1, changes=tuple(changes), load_seed=load_seed, sim_seed=sim_seed, seed_entry=name)
    return tuple(out.values())


def replay(seed: int, index: int, entry: RunSpec) -> RunSpec:
    """Run ``index``: the corpus ``entry`` as it is, with its own seeds where it pins them, fresh ones
    (a pure function of the campaign seed and index) where it does not."""
    rng = random.Random(f"kvrepro-explore/{seed}/{index}")
    load_seed, sim_seed = rng.randrange(SEED_RANGE), rng.randrange(SEED_RANGE)
    return RunSpec(index=index, changes=entry.changes, seed_entry=entry.seed_entry,
                   load_seed=entry.load_seed if entry.load_seed is not None else load_seed,
                   sim_seed=entry.sim_seed if entry.sim_seed is not None else sim_seed)


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
    changes.sort(key=lambda c: _order(c[0]))
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
        if k.profile is not None and k.profile != profile:
            # picked among the parent's profile's settings, and the profile changed before it: it
            # means nothing to the new one (the run would be INVALID: 4 of 330 runs of
            # explore-20261205-034215-3680 were, cross-group-eviction-assert's partial-prefix mutated
            # to shared_prefix with load.schedule kept)
            continue
        # another value than the parent's (or than the base's, None, for a knob the parent left
        # alone): a mutation that changes nothing would only rerun the parent with other seeds
        current = changes.get(k.path)
        values = [v for v in k.values if v != current] or list(k.values)
        value = copy.deepcopy(_weighted(rng, values, [_value_weight(weights, k, v) for v in values]))
        if k.path == PROFILE_PATH and value != profile:
            # another profile: the parent's settings of the old one mean nothing to it
            changes = {p: v for p, v in changes.items() if not _profile_setting(p)}
            profile = str(value)
        changes[k.path] = value
    return RunSpec(index=index, changes=tuple(sorted(changes.items(), key=lambda c: _order(c[0]))),
                   load_seed=rng.randrange(SEED_RANGE), sim_seed=rng.randrange(SEED_RANGE),
                   seed_entry=parent.seed_entry)


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
