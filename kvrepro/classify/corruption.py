"""The table of known silent-KV-corruption defects: what the shadow KV's violation classes mean.

The GPU-free engine's shadow KV (:mod:`kvrepro.engine.shadow`) classifies every wrong read as
``<group kind>[+offload]/<read>/<region>`` (its module docstring says what each part means).
A class says *what* went wrong; a :class:`CorruptionSignature` says *which defect* that is: the
name a verdict, ``expect:`` and the per-defect statistics use, a title in words, why it happens,
the upstream issue and pull requests, and a test log (``tests/data/logs/``) the tests replay.

Like the crash signatures (:mod:`.patterns`), each known defect is one module under
``kvrepro/classify/corruptions/`` defining ``CORRUPTION``; adding a defect is adding one file
and its log. A class no signature matches is attributed to :data:`UNKNOWN`, so an unrecognised
corruption still makes the run CORRUPT, under a title that says it is not a known defect.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

UNKNOWN = "unknown"
# the defect name `expect:` and reports use for a class no signature knows
UNKNOWN_TITLE = "silent KV corruption of no known kind"


@dataclass(frozen=True)
class ViolationClass:
    """One shadow-KV violation class, parsed; parts an older log did not record are ``""``."""

    group: str
    offload: bool
    read: str = ""
    region: str = ""

    @classmethod
    def parse(cls, key: str) -> "ViolationClass":
        """``full_attention+offload/missing/hit`` (or an older log's ``full_attention+offload``)."""
        head, *rest = key.split("/")
        group, plus, _ = head.partition("+offload")
        return cls(group=group, offload=bool(plus), read=rest[0] if rest else "",
                   region=rest[1] if len(rest) > 1 else "")

    @property
    def key(self) -> str:
        head = self.group + ("+offload" if self.offload else "")
        return "/".join(part for part in (head, self.read, self.region) if part)


@dataclass(frozen=True)
class ClassPattern:
    """Which violation classes a defect produces.

    Each of ``groups``, ``reads`` and ``regions`` lists the values a class may have (empty: any);
    ``offload`` is whether the request had an offload hit (None: either way).
    """

    groups: tuple[str, ...] = ()
    offload: bool | None = None
    reads: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()

    def matches(self, cls: ViolationClass) -> bool:
        return ((not self.groups or cls.group in self.groups)
                and (self.offload is None or cls.offload is self.offload)
                and (not self.reads or cls.read in self.reads)
                and (not self.regions or cls.region in self.regions))

    @property
    def specificity(self) -> int:
        """More constrained patterns win over looser ones that match the same class."""
        return sum((bool(self.groups), self.offload is not None, bool(self.reads), bool(self.regions)))


@dataclass(frozen=True)
class CorruptionSignature:
    """One known corruption defect: its name, its words, and the violation classes it produces.

    ``classes``: one :class:`ClassPattern` per way the defect shows (e.g. the wrong read itself
    and a later request inheriting it through the prefix cache). ``upstream`` links the issue
    and pull requests; ``fixed_by`` names the patches (as ``matrix.yaml`` and ``builds/`` call
    them) that remove it; ``test_log`` is its log under ``tests/data/logs/``.
    """

    name: str
    title: str
    why: str
    classes: tuple[ClassPattern, ...]
    upstream: tuple[str, ...] = ()
    fixed_by: tuple[str, ...] = ()
    test_log: str | None = None
    # kinds of KV group the engine must have for this defect to exist (the hybrid holes need a
    # Mamba group); checked when the log says which groups the engine had
    needs_groups: tuple[str, ...] = ()

    def specificity(self, cls: ViolationClass) -> int | None:
        """How specifically this defect matches a class (None: not at all)."""
        found = [p.specificity for p in self.classes if p.matches(cls)]
        return max(found) if found else None


@functools.lru_cache(maxsize=1)
def known_corruptions() -> tuple[CorruptionSignature, ...]:
    """Every signature under kvrepro/classify/corruptions/, by name."""
    from . import corruptions

    from .tables import table_entries

    return table_entries(corruptions, "CORRUPTION", CorruptionSignature, "corruption", reserved=(UNKNOWN,))


def by_name(name: str) -> CorruptionSignature | None:
    return next((s for s in known_corruptions() if s.name == name), None)


def title_of(name: str) -> str:
    signature = by_name(name)
    return signature.title if signature is not None else UNKNOWN_TITLE


def match_class(key: str, groups: Iterable[str] = ()) -> CorruptionSignature | None:
    """The most specific signature for a class key (ties: the first by name), or None.
    ``groups``: the kinds of the engine's KV groups (empty: unknown, no signature is ruled out)."""
    cls = ViolationClass.parse(key)
    present = set(groups)
    best: tuple[int, CorruptionSignature] | None = None
    for signature in known_corruptions():
        if present and not present.issuperset(signature.needs_groups):
            continue
        how = signature.specificity(cls)
        if how is not None and (best is None or how > best[0]):
            best = (how, signature)
    return best[1] if best else None


def attribute(violations_by_class: Mapping[str, int], groups: Iterable[str] = ()) -> dict[str, int]:
    """Violations per defect name (``unknown`` for classes no signature knows), largest first."""
    out: dict[str, int] = {}
    for key, n in violations_by_class.items():
        signature = match_class(key, groups)
        name = signature.name if signature is not None else UNKNOWN
        out[name] = out.get(name, 0) + int(n)
    return dict(sorted(out.items(), key=lambda item: (-item[1], item[0])))


def defects_of(violations: int, violations_by_class: Mapping[str, int], first_class: str | None,
               groups: Iterable[str] = ()) -> dict[str, int]:
    """A run's violations per defect. When the counts line was cut off (violations counted from
    the described lines only), the first violation's class stands for all of them. ``groups``:
    the kinds of the engine's KV groups, as the shadow KV's ``installed`` line lists them."""
    if not violations:
        return {}
    by_class = dict(violations_by_class)
    if not by_class:
        by_class = {first_class or "?": violations}
    return attribute(by_class, groups)


def first_request(defect: str, first_by_class: Mapping[str, int], groups: Iterable[str] = ()) -> int | None:
    """The first request (1-based) in which ``defect`` was seen, from a run's first request per
    violation class (``RunResult.kv_first_request_by_class``); None when no described violation of
    it named a request (the shadow KV describes the first few violations only)."""
    groups = tuple(groups)
    numbers = [n for cls, n in first_by_class.items()
               if (sig := match_class(cls, groups)) is not None and sig.name == defect]
    return min(numbers) if numbers else None
