"""Feedback: what a run reached, and the weights that steer the next runs toward what was new.

A run reaches *features* (AFL's idea, in kvrepro's own terms): each arc of the code under test
that the engine executed (kvrepro/engine/arcs.py: line-to-line transitions in vLLM's scheduler,
KV-cache manager and offloading connector, read from the run's engine.log), each path counter of
kvrepro/suite/catalogue.py ``COUNTERS`` that is non-zero, in a log2 bucket (so reaching a path far
more often than before is new too), each group kind a request read a hit of (``kv_hit_reads``) or
the offload tier stored (``kv_stored``), each shadow-KV violation class, each failure key and the
verdict. A run that reaches a feature no earlier run of the campaign reached credits every
``knob=value`` it changed (:func:`points`): one point per new feature other than an arc, log2 of
the new arcs (hundreds of them come with any new path; they must not drown the rest), and
:data:`TARGET_POINTS` per new arc in the campaign's *target*: the lines its ``--patch`` patches
change (:func:`patch_targets`), the code a campaign on a patched build is about (AFLGo's directed
fuzzing, without its distance metric). The generator then picks knobs and values in proportion to
``1 + points``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..engine.arcs import parse_line
from ..records import RunResult
from ..suite.catalogue import COUNTERS, counter_value
from .vocabulary import KNOBS

ARC = "arc:"
TARGET_POINTS = 4.0  # per new arc in the patched lines
TARGET_MARGIN = 3  # lines around a hunk's changed lines that count as the target
ENGINE_LOG = "engine.log"
_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@")

# file (as arcs.py names it: below vllm/) -> line ranges (first, last), both numberings of a hunk
Targets = dict[str, list[tuple[int, int]]]


def patch_targets(patch_texts: Iterable[str]) -> Targets:
    """The lines the patches change, per file of the code under test: each hunk's changed lines
    (removed ones by their old numbers, added ones by their new) widened by :data:`TARGET_MARGIN`."""
    out: Targets = {}
    for text in patch_texts:
        name = None
        old = new = 0
        for line in text.splitlines():
            if line.startswith("+++ "):
                path = line[4:].split("\t")[0].strip()
                at = path.find("vllm/")
                name = path[at + len("vllm/"):] if at >= 0 else None
                continue
            if line.startswith("--- "):
                continue
            m = _HUNK.match(line)
            if m:
                old, new = int(m[1]), int(m[2])
                continue
            if name is None or not line:
                continue
            if line[0] == "-":
                out.setdefault(name, []).append((old - TARGET_MARGIN, old + TARGET_MARGIN))
                old += 1
            elif line[0] == "+":
                out.setdefault(name, []).append((new - TARGET_MARGIN, new + TARGET_MARGIN))
                new += 1
            elif line[0] == " ":
                old += 1
                new += 1
    return out


def in_target(targets: Targets, feature: str) -> bool:
    """Is ``feature`` an arc that starts or ends in the target lines?"""
    if not feature.startswith(ARC):
        return False
    name, _, arc = feature[len(ARC):].rpartition(":")
    ranges = targets.get(name)
    if not ranges:
        return False
    a, _, b = arc.partition(">")
    try:
        lines = (abs(int(a)), abs(int(b)))
    except ValueError:
        return False
    return any(lo <= n <= hi for n in lines for lo, hi in ranges)


def run_arcs(run_dir: Path | None) -> set[str]:
    """The arcs the run's engine reported (engine.log's ``kvrepro-arcs:`` lines) as features."""
    if run_dir is None:
        return set()
    found: set[str] = set()
    for log in sorted(run_dir.rglob(ENGINE_LOG)):
        try:
            with log.open(errors="replace") as f:
                for line in f:
                    if "kvrepro-arcs:" in line:
                        found.update(f"{ARC}{name}:{a}>{b}" for name, a, b in parse_line(line))
        except OSError:
            continue  # an unreadable log: the run's other features still count
    return found


def points(new: Iterable[str], targets: Targets) -> float:
    """What a run's new features are worth to the knobs it changed (see the module docstring)."""
    new = list(new)
    arcs = [f for f in new if f.startswith(ARC)]
    aimed = sum(1 for f in arcs if in_target(targets, f))
    return (len(new) - len(arcs)) + math.log2(1 + len(arcs)) + TARGET_POINTS * aimed


def _bucket(n: int) -> int:
    return n.bit_length()  # 1 -> 1, 2-3 -> 2, 4-7 -> 3, ...


def features(run: RunResult, failure_keys: Iterable[str] = ()) -> set[str]:
    found = {f"verdict:{run.verdict.value}"}
    for name in COUNTERS:
        value = counter_value(run, name)
        if value > 0:
            found.add(f"{name}:2^{_bucket(value)}")
    for field in ("kv_hit_reads", "kv_stored"):
        for kind, value in getattr(run, field).items():
            if value > 0:
                found.add(f"{field}.{kind}")
    for cls, value in run.kv_violations_by.items():
        if value > 0:
            found.add(f"violation:{cls}")
    found.update(f"failure:{k}" for k in failure_keys)
    return found


def steering(weights: Mapping[str, float], tried: Iterable[str]) -> dict[str, float]:
    """The weights a guided run is drawn with: the credited ones, and every ``knob=value`` the
    campaign has not tried yet raised to the best credited weight (optimism toward the untried: a
    value nobody ran cannot have earned points, and a campaign of a few runs must try it before it
    reruns what was merely first to earn)."""
    out = dict(weights)
    top = max(out.values(), default=1.0)
    done = set(tried)
    for k in KNOBS:
        for value in k.values:
            key = k.key(value)
            if key not in done:
                out[key] = max(out.get(key, 1.0), top)
    return out


def credit(weights: Mapping[str, float], keys: Iterable[str], new_features: float) -> dict[str, float]:
    """``weights`` with each of ``keys`` raised by ``new_features`` points (weights start at 1)."""
    out = dict(weights)
    if new_features > 0:
        for key in keys:
            out[key] = out.get(key, 1.0) + new_features
    return out
