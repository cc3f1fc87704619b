"""`kvrepro triage LOG`: from a production log, or what a report pasted of one, to the known
defect, its fix and a reproduction.

A large log is read in one streaming pass (:mod:`.reader` hands on only the lines that matter, so a
GB log takes seconds and constant memory); a small text (a report from a tracker) is read whole and
mended first (:mod:`.pasted`: fences, quote markers, prefixes, tracebacks starting mid-way). Three
readers go side by side: the deployed configuration (:mod:`.deployed`, with :mod:`.sources` for
what a report gives instead of vLLM's start-up lines), the stall detector (:mod:`.failure`) and
kvrepro.classify's one log parser (:func:`kvrepro.classify.parse_log`: the classification and the
traceback it rests on, as a run's engine log gets them; no signature table here). The first two
are triage's own because what they read is a production server's (its configuration lines, the
API server's periodic stats), which kvrepro's engine logs never need read; they take the lines of
the same pass, never the file again. A pasted report is mended into log lines (:mod:`.pasted`)
before the same parser reads them; pasted.py's own patterns undo the paste (quote markers,
fences, prefixes), they decide nothing about what the log means. Where the
text lacks the engine's markers, :mod:`.failure` picks the traceback, tells a serving engine from
one starting by its frames, and matches partial evidence to a signature piece by piece. Then
:mod:`.matching` ranks the catalogue's entries against the failure and configuration, :mod:`.emit`
writes a matrix.yaml reproducing the configuration, and :mod:`.run` runs it.

Only what is not text (a binary file, a damaged gzip, an empty file) raises BadInputError; any
text is triaged, and what could not be read is said in the warnings.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from ..classify import is_target_crash, parse_log
from ..classify.classifier import classify_traceback, excerpt
from ..classify.infra import infra_keywords, match_infra
from ..classify.lines import split_line
from ..classify.logfile import open_log_bytes
from ..classify.patterns import Pattern, match_pattern
from ..classify.tracebacks import Traceback
from ..errors import BadInputError
from ..classify.records import Classification
from ..records import Outcome, Signature
from ..spec.matrix import DEFAULT_MATRIX, TargetSignature
from ..suite.catalogue import Catalogue, Entry
from ..untrusted import quote
from ..versions import SUPPORTED_RELEASES, nearest_supported, version_tuple
from .deployed import ConfigReader
from .failure import StallReader, infer_assert, loose_evidence, match_partial, phase, pick_traceback
from .matching import match_entries, minimal_clean_set, tie_of
from .pasted import normalise, read_whole, repair
from .reader import Prefixed, ReadStats, select_stream
from .records import DeployedConfig, Failure, Match, Stall, Tie, Triage

__all__ = ["DeployedConfig", "Failure", "Match", "Stall", "Tie", "Triage", "triage_file"]

# a text up to this size (a file, compressed or not, or a pipe) is read whole and mended as pasted
# text (kvrepro/triage/pasted.py):
# a report from a tracker is kilobytes; a production log this small (the seed's lines and 8,200
# access lines, 0.98 MB) took 0.8 s whole against 0.2 s through grep, at load average 15 (2026-12-04)
WHOLE_TEXT_MAX = 1 << 20


def _release_of(config: DeployedConfig, release: str | None,
                warnings: list[str]) -> tuple[DeployedConfig, str | None, str | None]:
    """The vLLM release the triage reads claims for (``release``, given, over the log's), as X.Y.Z, and
    the supported release it reproduces on; what does not fit is said in ``warnings``."""
    version = release or config.release
    base = exact = None
    if version is not None and version_tuple(version) is None:
        warnings.append(f"{version[:40]!r} is not a vLLM version; release claims not checked")
        version = None
    if version is not None:
        vt = version_tuple(version)
        assert vt is not None
        exact = f"{vt[0]}.{vt[1]}.{vt[2]}"
        base = nearest_supported(version)
        if base is None:
            warnings.append(f"vLLM {version} is not near the releases kvrepro runs ({SUPPORTED_RELEASES[0]}-"
                            f"{SUPPORTED_RELEASES[-1]}): triaged against the catalogue's claims, no reproduction")
        elif base != exact:
            warnings.append(f"vLLM {version} is not a release kvrepro runs; reproduced on the nearest, {base}")
        if "dev" in version or "+" in version:
            warnings.append(f"vLLM {version} is a development build: it may hold fixes of {exact} or lack "
                            "some of the release before; release claims read as for " + exact)
    else:
        warnings.append("no vLLM version in the text (no banner, engine line, collect_env/pip output, image tag "
                        "or version line): release claims not checked; say it with --release X.Y.Z")
    if release and config.release and version_tuple(release) != version_tuple(config.release):
        warnings.append(f"--release {release} given; the log says {config.release} ({config.source('release')})")
    if config.version_note:
        warnings.append(config.version_note)
    sources = dict(config.sources)
    if release:
        sources["release"] = "--release"
    return replace(config, release=version, sources=sources), exact, base


def triage_file(path: Path, catalogue: Catalogue, release: str | None = None) -> Triage:
    """Triage the log at ``path`` (anything kvrepro/classify/logfile.py opens: plain, compressed, a
    pipe; a whole server log or what a report pasted) against ``catalogue``; ``release`` overrides the version the log shows (or says it when the
    log does not). Only what is not text (a binary file, an empty one) is refused."""
    stats = ReadStats()
    with open_log_bytes(path, require_text=True) as (stream, info):  # the one opener (issue 44)
        raw, head = read_whole(stream, info, stats, WHOLE_TEXT_MAX)
        whole = raw is not None
        reader = ConfigReader(whole_text=whole)
        stalls = StallReader()
        numbers = array("q")  # the file's line number of each line classify sees (it numbers them 1, 2, ...)
        target = _target()
        texts: list[str] = []
        keywords = infra_keywords()
        saw_infra = False
        if raw is not None:
            for number, line in raw:
                if "throughput:" in line:
                    stalls.feed(number, line)
                stalls.end(line)  # a paste may end in a fence or prose: the last line with a time ends a stall
            repaired = [(n, t) for n, t in repair(raw) if t is not None]
            for number, text in repaired:
                parts = split_line(number, text)
                reader.feed(number, parts)
                numbers.append(number)
                texts.append(text)
                if not saw_infra and any(k in text for k in keywords) and match_infra(parts.body) is not None:
                    saw_infra = True
            reader.feed_text(repaired)
            parsed = parse_log(texts, target=target)
        else:
            def tapped() -> Iterator[str]:
                nonlocal saw_infra
                stats_lines = 0
                for number, raw_line in select_stream(Prefixed(head, stream), info, path, stats):
                    if "throughput:" in raw_line:
                        # a stats line (most of what is selected in a long log): the stall reader's alone,
                        # but for the first, which tells classify the server was up
                        stalls.feed(number, raw_line)
                        stats_lines += 1
                        if stats_lines > 1:
                            continue
                    line = normalise(raw_line)
                    parts = split_line(number, line)
                    reader.feed(number, parts)
                    numbers.append(number)
                    if not saw_infra and any(k in line for k in keywords) and match_infra(parts.body) is not None:
                        saw_infra = True
                    yield line

            parsed = parse_log(tapped(), target=target)  # the one parser, fed as the stream is read
        cls, tb = parsed.classification, parsed.traceback
    if not whole:
        stalls.end(stats.last_line)
    if stats.bytes_read == 0:
        raise BadInputError(f"{quote(path, 200)}: is empty; give the vLLM server's log or the text of the report")
    warnings: list[str] = list(stats.notices)  # lines cut to the bound, a UTF-16 log (triage/reader.py)
    config, exact, base = _release_of(reader.config(), release, warnings)
    warnings.extend(f"configuration: {p}" for p in config.problems)

    file_line = (lambda n: numbers[n - 1] if 0 < n <= len(numbers) else n)
    failure = _failure(cls, tb, parsed.tracebacks, texts, stalls.stall(), file_line, target, saw_infra)
    if failure.kind == "none" and not reader.vllm_lines_seen and not any("vllm" in t.lower() for t in texts):
        warnings.append("nothing in this text is vLLM's (no version, no engine lines, no vLLM frames); "
                        "give the server's log or the report's pasted lines")
    if failure.fits:
        warnings.append(f"the text fits crash signatures {', '.join(failure.fits)} equally; the failing statement "
                        "(the traceback's last frame and its line) would tell them apart")
    entries: list[Entry] = list(catalogue.entries)
    matches, misses = match_entries(entries, failure, config, exact, base)
    clean, unfixable = minimal_clean_set(entries, base) if base is not None else (None, ())
    return Triage(log=str(path), lines=stats.lines, bytes_read=stats.bytes_read, config=config, failure=failure,
                  matches=tuple(matches), near_misses=tuple(misses), base=base, warnings=tuple(warnings),
                  minimal_clean_set=clean, still_present=unfixable, tie=tie_of(matches, entries, config, exact))


@functools.lru_cache(maxsize=1)
def _target() -> TargetSignature:
    """The crash kvrepro was built for, as the default matrix names it (its statement included): a
    crash is ``target`` only when it is that statement, not another assertion of the function."""
    import yaml

    try:
        data = yaml.safe_load(DEFAULT_MATRIX.read_text()) or {}
        return TargetSignature(**(data.get("target_signature") or {}))
    except Exception:  # noqa: BLE001 - a damaged matrix.yaml must not stop triage: the bare target
        return TargetSignature()


def _is_target(pattern: Pattern | None, target: TargetSignature) -> bool:
    """Partial evidence (no whole traceback) is the target only through the known pattern it
    fits, and only when the target names a statement that pattern's is; the comparison is the
    one rule (:func:`kvrepro.classify.is_target_crash`) on the pattern's signature."""
    if pattern is None or pattern.never_target or not pattern.expressions or not target.expression:
        return False
    return is_target_crash(Signature(pattern.exception, pattern.function, pattern.file, None,
                                     pattern.expressions[0]), target, pattern)


def _failure(cls: Classification, tb: Traceback | None, tracebacks: tuple[Traceback, ...], texts: list[str],
             stall: Stall | None,
             file_line: Callable[[int], int], target: TargetSignature, saw_infra: bool) -> Failure:
    infra_cause = cls.outcome is Outcome.INFRA and saw_infra
    evidence = "the traceback the engine announced" if tb is not None and tb.marker else "a traceback"
    if (tb is None or cls.outcome is Outcome.NONE) and texts:
        picked = pick_traceback(list(tracebacks))  # every traceback the one parse saw
        if picked is not None:
            tb, evidence = picked, "a traceback (the engine's own markers are not in the text)"
    if tb is not None:
        return _crash_failure(cls, tb, evidence, file_line, target, infra_cause)
    if texts and cls.outcome is Outcome.NONE and (loose := loose_evidence(
            [(i, split_line(i, t).body) for i, t in enumerate(texts, 1)])) is not None:
        pattern, fits, said = match_partial(loose.signature, loose.message)
        how = ("an assert statement (no exception line in the text)" if loose.inferred
               else "the exception line (no traceback in the text)")
        sig = loose.signature
        where = sig.function or (sig.file.rsplit("/", 1)[-1] if sig.file else "")
        title = (pattern.render_title(sig) if pattern is not None else
                 f"{sig.exception}{' in ' + where if where else ''}: {sig.expression or loose.message or ''}".rstrip(": "))
        return Failure(kind="crash", title=title[:240], outcome="target" if _is_target(pattern, target) else "other_crash",
                       signature=loose.signature, pattern=pattern.name if pattern else None,
                       line=file_line(loose.line), exception_line=loose.exception_line[:240],
                       evidence=f"{how}{'; matched on ' + said if pattern else ''}", fits=fits)
    if cls.outcome is Outcome.INFRA and not infra_cause and texts and _says_death(texts):
        # an engine that died was running: its death reported without the cause is no failed start
        return Failure(kind="crash", title=f"the engine died; its cause is not in the text ({_death_line(texts)})"[:240],
                       outcome="other_crash", phase="runtime", evidence="a report of the engine's death")
    if cls.outcome is Outcome.INFRA:
        return Failure(kind="infra", title=cls.title, outcome=cls.outcome.value, signature=cls.signature,
                       phase="startup" if not infra_cause else "unknown",
                       evidence="an infrastructure cause" if infra_cause else "the engine's start-up")
    if cls.outcome is Outcome.OTHER_CRASH:
        return Failure(kind="crash", title=cls.title, outcome=cls.outcome.value, signature=cls.signature,
                       phase="runtime", evidence="the engine's death, its cause not in the text")
    if stall is not None:
        title = (f"engine {stall.engine} ran nothing with {stall.waiting} request(s) waiting"
                 f"{f' ({stall.deferred} deferred)' if stall.deferred else ''} for {stall.seconds:.0f} s")
        return Failure(kind="stall", title=title, line=stall.line, stall=stall, evidence="vLLM's stats lines")
    return Failure(kind="none", title="no crash and no stall in the text")


_DEATH = ("EngineDeadError", "Engine loop is not running", "EngineCore encountered an issue", "died unexpectedly")


def _says_death(texts: list[str]) -> bool:
    return any(any(d in t for d in _DEATH) for t in texts)


def _death_line(texts: list[str]) -> str:
    return next(split_line(0, t).body.strip() for t in texts if any(d in t for d in _DEATH))


def _crash_failure(cls: Classification, tb: Traceback, evidence: str, file_line: Callable[[int], int],
                   target: TargetSignature, infra_cause: bool) -> Failure:
    when = phase(tb)
    inferred = None if tb.complete else infer_assert(tb)
    read = inferred or tb
    crash = classify_traceback(read, target)
    sig = crash.signature
    root = read.root()
    message = root.message if root.complete else None
    pattern = match_pattern(sig, root.message) if sig is not None and root.complete else None
    fits: tuple[str, ...] = ()
    said = ""
    if pattern is None and sig is not None:
        # the whole signature names no pattern: what the text gives may still (a statement cut
        # short, a frame without its line; or, cut off before the exception, its last statement)
        pattern, fits, said = match_partial(sig, message, need_statement=not root.complete)
    if inferred is not None:
        evidence += "; cut off after its last frame, an assert: AssertionError"
    elif not tb.complete and root.complete:
        evidence += "; the exception it raised in turn is cut off"
    elif not tb.complete:
        evidence += "; cut off before its exception line"
    if said:
        evidence += f"; matched on {said} (not the whole signature)"
        if not root.complete and pattern is not None:
            evidence += f": its last frame is the statement of {pattern.name}"
    if pattern is not None and sig is not None and not sig.exception:
        sig = replace(sig, exception=pattern.exception)
    exception_line = ""
    if root.exception:
        exception_line = root.exception + (f": {root.message_lines[0]}" if root.message_lines else "")
    title = pattern.render_title(sig) if pattern is not None and sig is not None else crash.title
    kind = "crash"
    if infra_cause:
        kind, title = "infra", cls.title
    elif when == "startup" and pattern is None:
        kind, title = "infra", f"engine did not start: {title}"
    outcome = "infra" if kind == "infra" else "target" if _is_target(pattern, target) else "other_crash"
    return Failure(kind=kind, title=title, outcome=outcome, signature=sig, pattern=pattern.name if pattern else None,
                   line=file_line(tb.first_line), exception_line=exception_line, excerpt=tuple(excerpt(read)),
                   phase=when, evidence=evidence, fits=fits)
