"""Match a log's failure and configuration against the known-defect catalogue (defects/).

An entry fits when its kind and signature are the failure's (a crash: the same crash signature
from kvrepro/classify/signatures/; a stall: `stall`), the log's release is not one the catalogue
says is fixed, and every ``triage.requires`` facet can hold for the deployed configuration (a
facet the log does not say is not held against it, nor counted for it). Entries with the right
signature that fail the release or a requirement are near misses, each with its why-not. Fitting
entries are ranked: release listed in ``present_in`` over a release that merely predates the fix
over no claim; requirements the log confirms that say more (fewer allowed values) and log
evidence (``triage.evidence``) rank higher. Entries left level are a tie (:func:`tie_of` says
what would decide it), listed with the entry fixed earliest after the log's release first (the
fix it most plainly lacks), or, the release unknown, the one present in the most releases.
Nothing is matched on resemblance alone: a crash no signature knows, or one no entry names, is
unknown, and only its near misses (the entries of its function or file) are listed.
"""

from __future__ import annotations

import dataclasses

import itertools
import re

from ..suite.catalogue import TRIAGE_FACETS, Entry, expected_state, parse_build_key
from ..versions import version_tuple
from .records import DeployedConfig, Failure, Match, Tie
from ..classify.patterns import known_patterns

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
    # the code's state: masked_in/unreached_in only say what the suite's own runs can show there
    state = code_state(entry, release)
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
                  base: str | None) -> tuple[list[Match], list[Match]]:
    """(matches best first, near misses best first) for the log's failure.

    A facet the log does not say (``unknown``) is not held against an entry that requires it, nor
    counted for it: the requirement is listed as not checked. An unknown release checks no release
    claim. A crash no entry's signature names gets as near misses the entries whose signature is
    in the same function or file (or that the text fits equally), each with what differs."""
    fits: list[tuple[tuple, Match]] = []
    misses: list[tuple[tuple, Match]] = []
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
        else:
            why.append("the log's release is unknown: release claims not checked")
        for facet, allowed in entry.triage_requires:
            can = config.possible(facet, TRIAGE_FACETS[facet])
            overlap = [v for v in can if v in allowed]
            members = facet == "connector" and len(config.connectors()) > 1 and config.known("kv_connector")
            if (len(can) == 1 or members) and overlap:
                # one value the log says, or a MultiConnector one of whose members it needs
                said = f"{overlap[0]} (in a MultiConnector with {'+'.join(can)})" if members else can[0]
                why.append(f"{facet} {said} (needs {'/'.join(allowed)})")
                score += 10.0 / len(allowed)
            elif not overlap:
                has = can[0] if len(can) == 1 else "+".join(can) if members else f"vLLM's default ({' or '.join(can)})"
                why_not.append(f"needs {facet} {'/'.join(allowed)}, the log has {has}")
            elif can == TRIAGE_FACETS[facet]:
                why.append(f"needs {facet} {'/'.join(allowed)} (not in the log: not checked)")
            else:
                why.append(f"needs {facet} {'/'.join(allowed)}; the log leaves it at vLLM's default "
                           f"({' or '.join(can)}): not decided")
        for pattern in entry.triage_evidence:
            found = re.search(pattern, failure.evidence_text)
            if found:
                why.append(f"the log shows {found.group(0)!r}")
                score += 15.0
        match = _match(entry, base, fits=not why_not, score=score, why=why, why_not=why_not, state=state)
        (fits if match.fits else misses).append((_key(entry, score, release is not None), match))
    if failure.kind == "crash" and not fits and failure.pattern is None:
        misses.extend(_near_unknown(entries, failure, base))
    return [m for _, m in sorted(fits, key=lambda x: x[0])], [m for _, m in sorted(misses, key=lambda x: x[0])]


def code_state(entry: Entry, release: str, patches: tuple[str, ...] = ()) -> str | None:
    """What the code of a build holds ("present", "fixed", None): the catalogue's claim without what only
    the suite's own runs can show there (masked_in, unreached_in)."""
    return expected_state(dataclasses.replace(entry, masked_in=(), unreached_in=()), release, patches)


def _key(entry: Entry, score: float, release_known: bool = True) -> tuple:
    """Best first: the score; between equals, with the log's release known, the entry fixed
    earliest (the fix it most plainly lacks); with it unknown, the entry present in the most
    releases first (an entry present in no release but a patched stack is the least likely)."""
    fixed = sorted(_release_keys(entry.fixed_in), key=version_tuple)
    first_fix = version_tuple(fixed[0]) if fixed else (999, 0, 0)
    present = 0 if release_known else -len(_release_keys(entry.present_in))
    return (-score, present, first_fix, entry.name)


def _match(entry: Entry, base: str | None, *, fits: bool, score: float, why: list[str], why_not: list[str],
           state: str) -> Match:
    fixed_releases = tuple(sorted(_release_keys(entry.fixed_in), key=version_tuple))
    return Match(entry=entry.name, title=entry.title, kind=entry.kind, fits=fits, score=score, why=tuple(why),
                 why_not=tuple(why_not), upstream=entry.upstream, fixed_in_releases=fixed_releases,
                 backports=backports(entry, base), release_state=state)


def _near_unknown(entries: list[Entry], failure: Failure, base: str | None) -> list[tuple[tuple, Match]]:
    """Entries near a crash no signature names: the same function, the same file, or a signature
    the text fits as well as another."""
    patterns = {p.name: p for p in known_patterns()}
    sig = failure.signature
    function = sig.function.rsplit(".", 1)[-1] if sig is not None and sig.function else ""
    file = sig.file.lstrip("./") if sig is not None and sig.file else ""
    shown = failure.title or "its crash"
    out = []
    for entry in entries:
        pattern = patterns.get(entry.signature) if entry.kind == "crash" else None
        if pattern is None:
            continue
        statement = pattern.expressions[0] if pattern.expressions else pattern.exception
        if entry.signature in failure.fits:
            score, why = 60.0, f"the text fits its signature {pattern.name} as well as another"
        elif function and function == pattern.function:
            score, why = 50.0, f"the same function ({function}), another failure: it is `{statement}`"
        elif file and (pattern.file.endswith(file) or file.endswith(pattern.file)):
            score, why = 30.0, f"the same file ({pattern.file}), another failure: it is {pattern.function}'s `{statement}`"
        else:
            continue
        match = _match(entry, base, fits=False, score=score, why=[why],
                       why_not=[f"its signature is {pattern.name}; the log shows {shown[:120]}"], state="no claim")
        out.append((_key(entry, score), match))
    return out


def tie_of(matches: list[Match], entries: list[Entry], config: DeployedConfig, release: str | None) -> Tie | None:
    """The best matches that score the same, and what would decide between them: a facet they
    require differently (that the log does not say), their release claims (when the log's release
    is unknown), the evidence they look for."""
    if len(matches) < 2 or matches[0].score != matches[1].score:
        return None
    tied = [m for m in matches if m.score == matches[0].score]
    by_name = {e.name: e for e in entries}
    decide: list[str] = []
    facets = config.facets()
    for facet in TRIAGE_FACETS:
        needs = {m.entry: dict(by_name[m.entry].triage_requires).get(facet) for m in tied}
        if len({tuple(v) if v else None for v in needs.values()}) > 1:
            said = "; ".join(f"{name} needs {'/'.join(v) if v else 'any'}" for name, v in needs.items())
            decide.append(f"{facet}, which the log does not say ({said})" if facets.get(facet) == "unknown"
                          else f"{facet} ({said})")
    if release is None:
        claims = {m.entry: (tuple(_release_keys(by_name[m.entry].present_in)), m.fixed_in_releases) for m in tied}
        if len(set(claims.values())) > 1:
            decide.append("the release, which the log does not say (" + "; ".join(
                f"{name} present in {', '.join(p) or 'no listed release'}, fixed in {', '.join(f) or 'none yet'}"
                for name, (p, f) in claims.items()) + ")")
    evidence = {m.entry: by_name[m.entry].triage_evidence for m in tied}
    if len({tuple(v) for v in evidence.values()}) > 1:
        decide.append("log lines: " + "; ".join(f"{name} looks for {', '.join(map(repr, v))}"
                                               for name, v in evidence.items() if v))
    if not decide:
        decide.append("nothing a log can show: the entries claim the same (the catalogue should tell them apart)")
    return Tie(entries=tuple(m.entry for m in tied), would_decide=tuple(decide))


def minimal_clean_set(entries: list[Entry], base: str) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """The smallest backport stack on ``base`` that leaves no catalogue entry present (of those a
    backport can fix), and the entries present on ``base`` that no backport in the catalogue fixes.

    Candidates are the patches ``fixed_in`` names on ``base``, in the order first named; a stack
    keeps that order (a patch that needs another comes after it there). None when no stack does."""
    present = [e for e in entries if code_state(e, base) == "present"]
    unfixable = tuple(e.name for e in present if not backports(e, base))
    candidates: list[str] = []
    for entry in entries:
        for stack in backports(entry, base):
            candidates.extend(p for p in stack if p not in candidates)
    considered = [e for e in entries if e.name not in unfixable]
    for size in range(0, len(candidates) + 1):
        for stack in itertools.combinations(candidates, size):
            if all(code_state(e, base, stack) != "present" for e in considered):
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
