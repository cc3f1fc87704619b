"""Match a log's failure and configuration against the known-defect catalogue (defects/).

An entry fits when its kind and signature are the failure's (a crash: the same crash signature
from kvrepro/classify/signatures/; a stall: `stall`), the log's release is not one the catalogue
says is fixed, and every ``triage.requires`` facet holds for the deployed configuration. Entries
with the right signature that fail the release or a requirement are near misses, each with its
why-not. Fitting entries are ranked: release listed in ``present_in`` over a release that merely
predates the fix over no claim; requirements that say more (fewer allowed values) and log
evidence (``triage.evidence``) rank higher; ties go to the entry fixed earliest after the log's
release (the fix it most plainly lacks). Nothing is matched on resemblance alone: a crash no
signature knows, or one no entry names, is unknown.
"""

from __future__ import annotations

import dataclasses

import itertools
import re

from ..suite.catalogue import Entry, expected_state, parse_build_key
from ..versions import version_tuple
from .records import DeployedConfig, Failure, Match

_PULL = re.compile(r"/pull/(\d+)")


def _release_keys(keys: tuple[str, ...]) -> list[str]:
    return [k for k in keys if not parse_build_key(k)[1]]


def backports(entry: Entry, base: str | None) -> tuple[tuple[str, ...], ...]:
    """The patch stacks ``fixed_in`` names on ``base`` (e.g. ('pr-48425',), ('pr-52807',))."""
    if base is None:
        return ()
    out = []
    for key in entry.fixed_in:
        release, patches = parse_build_key(key)
        if patches and release == base:
            out.append(patches)
    return tuple(out)


def upstream_fix(entry: Entry, base: str | None) -> tuple[str, ...] | None:
    """The backport of the fix upstream names first (its first ``/pull/N`` that has a pr-N stack)."""
    stacks = backports(entry, base)
    for link in entry.upstream:
        m = _PULL.search(link)
        if m:
            for stack in stacks:
                if f"pr-{m[1]}" in stack:
                    return stack
    return stacks[0] if stacks else None


def _release_state(entry: Entry, release: str) -> tuple[str, str]:
    # the code's state: masked_in only says where the suite cannot tell this defect from another
    state = expected_state(dataclasses.replace(entry, masked_in=()), release)
    fixed = _release_keys(entry.fixed_in)
    if state == "present":
        return "present", f"{release} is a release it is present in ({', '.join(_release_keys(entry.present_in))})"
    if state == "fixed":
        return "fixed", f"fixed from {min(fixed, key=version_tuple)} on, and {release} is that or later"
    mine = version_tuple(release)
    if fixed and all(version_tuple(f) > mine for f in fixed):  # type: ignore[operator]
        present = _release_keys(entry.present_in)
        if present and all(version_tuple(p) > mine for p in present):  # type: ignore[operator]
            return "no claim", (f"{release} is older than any release it is known in ({min(present, key=version_tuple)}); "
                                "no claim")
        return "before-fix", f"{release} predates its fix ({min(fixed, key=version_tuple)})"
    return "no claim", f"the catalogue makes no claim for {release}"


_RELEASE_SCORE = {"present": 30.0, "before-fix": 20.0, "no claim": 5.0}


def match_entries(entries: list[Entry], failure: Failure, config: DeployedConfig, release: str | None,
                  base: str | None, config_known: bool) -> tuple[list[Match], list[Match]]:
    """(matches best first, near misses best first) for the log's failure."""
    fits: list[tuple[tuple, Match]] = []
    misses: list[tuple[tuple, Match]] = []
    facets = config.facets()
    for entry in entries:
        if failure.kind == "crash":
            if entry.kind != "crash" or failure.pattern is None or entry.signature != failure.pattern:
                continue
            why = [f"crash signature {failure.pattern}"]
        elif failure.kind == "stall":
            if entry.kind != "stall":
                continue
            why = ["a stall (nothing running, requests waiting, no throughput)"]
        else:
            continue
        why_not: list[str] = []
        score = 100.0
        state = "no claim"
        if release is not None:
            state, said = _release_state(entry, release)
            (why_not if state == "fixed" else why).append(said)
            score += _RELEASE_SCORE.get(state, 0.0)
        for facet, allowed in entry.triage_requires:
            value = facets.get(facet)
            if not config_known:
                why.append(f"needs {facet} {'/'.join(allowed)} (the log's args were not readable: not checked)")
            elif value in allowed:
                why.append(f"{facet} {value} (needs {'/'.join(allowed)})")
                score += 10.0 / len(allowed)
            else:
                why_not.append(f"needs {facet} {'/'.join(allowed)}, the log has {value}")
        for pattern in entry.triage_evidence:
            found = re.search(pattern, failure.evidence_text)
            if found:
                why.append(f"the log shows {found.group(0)!r}")
                score += 15.0
        fixed_releases = tuple(sorted(_release_keys(entry.fixed_in), key=version_tuple))
        match = Match(entry=entry.name, title=entry.title, kind=entry.kind, fits=not why_not, score=score,
                      why=tuple(why), why_not=tuple(why_not), upstream=entry.upstream,
                      fixed_in_releases=fixed_releases, backports=backports(entry, base), release_state=state)
        first_fix = version_tuple(fixed_releases[0]) if fixed_releases else (999, 0, 0)
        key = (-score, first_fix, entry.name)
        (fits if match.fits else misses).append((key, match))
    return [m for _, m in sorted(fits, key=lambda x: x[0])], [m for _, m in sorted(misses, key=lambda x: x[0])]


def minimal_clean_set(entries: list[Entry], base: str) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """The smallest backport stack on ``base`` that leaves no catalogue entry present (of those a
    backport can fix), and the entries present on ``base`` that no backport in the catalogue fixes.

    Candidates are the patches ``fixed_in`` names on ``base``, in the order first named; a stack
    keeps that order (a patch that needs another comes after it there). None when no stack does."""
    present = [e for e in entries if expected_state(e, base) == "present"]
    unfixable = tuple(e.name for e in present if not backports(e, base))
    candidates: list[str] = []
    for entry in entries:
        for stack in backports(entry, base):
            candidates.extend(p for p in stack if p not in candidates)
    considered = [e for e in entries if e.name not in unfixable]
    for size in range(0, len(candidates) + 1):
        for stack in itertools.combinations(candidates, size):
            if all(expected_state(e, base, stack) != "present" for e in considered):
                return stack, unfixable
    return None, unfixable


def expected_verdict(entries: list[Entry], base: str, stack: tuple[str, ...], target_entry: Entry,
                     groups: tuple[str, ...] | None = None) -> str:
    """What the catalogue expects of a build of ``stack`` on ``base`` for an emitted matrix.

    ``groups``: the kinds of KV group the emitted engine has (``mamba``, ``full_attention``); a
    corruption defect that needs a kind the engine lacks (the hybrid holes need a Mamba group:
    the signature's ``needs_groups``) cannot occur there and is not expected (None: not known)."""
    from ..classify.corruption import known_corruptions

    if expected_state(target_entry, base, stack) == "present":
        return "STALL" if target_entry.kind == "stall" else "CRASH(target)"
    needs = {c.name: set(c.needs_groups) for c in known_corruptions()}
    corrupt = sorted(e.signature for e in entries
                     if e.kind == "corruption" and e.testable and expected_state(e, base, stack) == "present"
                     and (groups is None or needs.get(e.signature, set()) <= set(groups)))
    if corrupt and stack:
        return f"CORRUPT({', '.join(dict.fromkeys(corrupt))})"
    return "SURVIVED|UNREACHED"
