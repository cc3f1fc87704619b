"""Feedback: what a run reached, and the weights that steer the next runs toward what was new.

A run reaches *features* (AFL's idea, in kvrepro's own terms): each path counter of
kvrepro/suite/catalogue.py ``COUNTERS`` that is non-zero, in a log2 bucket (so reaching a path far
more often than before is new too), each group kind a request read a hit of (``kv_hit_reads``) or
the offload tier stored (``kv_stored``), each shadow-KV violation class, each failure key and the
verdict. A run that reaches a feature no earlier run of the campaign reached credits every
``knob=value`` it changed with one point per new feature; the generator then picks knobs and values
in proportion to ``1 + points``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..records import RunResult
from ..suite.catalogue import COUNTERS, counter_value


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


def credit(weights: Mapping[str, float], keys: Iterable[str], new_features: int) -> dict[str, float]:
    """``weights`` with each of ``keys`` raised by ``new_features`` (weights start at 1)."""
    out = dict(weights)
    if new_features > 0:
        for key in keys:
            out[key] = out.get(key, 1.0) + new_features
    return out
