"""`kvrepro triage LOG`: from a production log to the known defect, its fix and a reproduction.

One streaming pass over the log (:mod:`.reader` hands on only the lines that matter, so a GB log
takes seconds and constant memory) feeds three readers side by side: the deployed configuration
(:mod:`.deployed`), the stall detector (:mod:`.failure`) and kvrepro.classify's own traceback
scan (the crash signature; no signature table here). Then :mod:`.matching` ranks the catalogue's
entries against the failure and configuration, :mod:`.emit` writes a matrix.yaml reproducing the
configuration, and :mod:`.run` runs it.

Bad input (not a vLLM log, an unsupported release, a traceback cut off before its exception, a
binary file) raises BadInputError with one line naming the file and what to do.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

from ..classify.classifier import classify_with_traceback, excerpt
from ..classify.tracebacks import Traceback
from ..classify.lines import split_line
from ..classify.patterns import match_pattern
from ..errors import BadInputError
from ..records import Classification, Outcome
from ..suite.catalogue import Catalogue, Entry
from ..versions import SUPPORTED_RELEASES, nearest_supported, version_tuple
from .deployed import ConfigReader
from .failure import StallReader
from .matching import match_entries, minimal_clean_set
from .reader import ReadStats, read_selected
from .records import DeployedConfig, Failure, Match, Stall, Triage

__all__ = ["DeployedConfig", "Failure", "Match", "Stall", "Triage", "triage_file"]


def triage_file(path: Path, catalogue: Catalogue, release: str | None = None) -> Triage:
    """Triage the log at ``path`` (plain or gzip) against ``catalogue``; ``release`` overrides the
    version the log shows (for a log whose start was cut off)."""
    stats = ReadStats()
    reader = ConfigReader()
    stalls = StallReader()
    numbers = array("q")  # the file's line number of each line classify sees (it numbers them 1, 2, ...)

    def tapped() -> Iterator[str]:
        stats_lines = 0
        for number, raw in read_selected(path, stats):
            if "throughput:" in raw:
                # a stats line (most of what is selected in a long log): the stall reader's alone,
                # but for the first, which tells classify the server was up
                stalls.feed(number, raw)
                stats_lines += 1
                if stats_lines > 1:
                    continue
            reader.feed(number, split_line(number, raw))
            numbers.append(number)
            yield raw

    cls, tb = classify_with_traceback(tapped())
    stalls.end(stats.last_line)
    if stats.bytes_read == 0:
        raise BadInputError(f"{path}: is empty; give the vLLM server's log")
    if not reader.vllm_lines_seen:
        raise BadInputError(f"{path}: not a vLLM server log (no version banner, no non-default args, no "
                            f"EngineCore lines in {stats.lines:,} lines); give the log of `vllm serve` "
                            "(docker logs, the pod's log)")
    config = reader.config()
    warnings: list[str] = list(stats.notices)  # lines cut to the bound, a UTF-16 log (triage/reader.py)
    version = release or config.release
    if version is None:
        raise BadInputError(f"{path}: no vLLM version in the log (the API server's 'vLLM API server version' "
                            "line); give the log from the server's start, or say it with --release X.Y.Z")
    base = nearest_supported(version)
    if base is None:
        raise BadInputError(f"{path}: vLLM {version} is not a release kvrepro can triage (it runs "
                            f"{SUPPORTED_RELEASES[0]}-{SUPPORTED_RELEASES[-1]} and reads logs of releases near "
                            "them); give a log of one of those, or --release X.Y.Z if the banner is wrong")
    vt = version_tuple(version)
    exact = f"{vt[0]}.{vt[1]}.{vt[2]}" if vt else version
    if base != exact:
        warnings.append(f"vLLM {version} is not a release kvrepro runs; reproduced on the nearest, {base}")
    if release and config.release and release != config.release:
        warnings.append(f"--release {release} given; the log says {config.release}")
    config = DeployedConfig(**{**config.__dict__, "release": version})

    failure = _failure(path, cls, tb, stalls.stall(), lambda n: numbers[n - 1] if 0 < n <= len(numbers) else n)
    entries: list[Entry] = list(catalogue.entries)
    config_known = bool(config.args) and config.args_problem is None
    if config.args_problem:
        warnings.append(f"the non-default args line could not be read ({config.args_problem}); "
                        "configuration requirements were not checked")
    elif not config.args:
        warnings.append("no non-default args line in the log; configuration requirements were not checked")
    matches, misses = match_entries(entries, failure, config, exact, base, config_known)
    clean, unfixable = minimal_clean_set(entries, base)
    return Triage(log=str(path), lines=stats.lines, bytes_read=stats.bytes_read, config=config, failure=failure,
                  matches=tuple(matches), near_misses=tuple(misses), base=base, warnings=tuple(warnings),
                  minimal_clean_set=clean, still_present=unfixable)


def _failure(path: Path, cls: Classification, tb: Traceback | None, stall: Stall | None,
             file_line: Callable[[int], int]) -> Failure:
    # an engine that failed to start is infra to a matrix (the build proves nothing), but one that
    # died in vLLM's own code on a known signature (the offloading connector refusing a model's KV
    # spec, vllm#51150) is the defect a production log reports
    known_start_crash = (cls.outcome is Outcome.INFRA and cls.signature is not None
                         and match_pattern(cls.signature) is not None)
    if cls.outcome in (Outcome.TARGET, Outcome.OTHER_CRASH) or known_start_crash:
        if tb is not None and not tb.complete:
            raise BadInputError(f"{path}:{file_line(tb.first_line)}: the traceback there is cut off before its exception "
                                "line; paste the whole traceback (through the 'SomeError: ...' line)")
        sig = cls.signature
        root = tb.root() if tb is not None else None
        pattern = match_pattern(sig, root.message if root else "") if sig is not None else None
        exception_line = ""
        if root is not None and root.exception:
            exception_line = root.exception + (f": {root.message_lines[0]}" if root.message_lines else "")
        return Failure(kind="crash", title=cls.title, outcome=cls.outcome.value, signature=sig,
                       pattern=pattern.name if pattern else None, line=file_line(tb.first_line) if tb else None,
                       exception_line=exception_line, excerpt=tuple(excerpt(tb)) if tb is not None else ())
    if cls.outcome is Outcome.INFRA:
        return Failure(kind="infra", title=cls.title, outcome=cls.outcome.value, signature=cls.signature)
    if stall is not None:
        title = (f"engine {stall.engine} ran nothing with {stall.waiting} request(s) waiting"
                 f"{f' ({stall.deferred} deferred)' if stall.deferred else ''} for {stall.seconds:.0f} s")
        return Failure(kind="stall", title=title, line=stall.line, stall=stall)
    return Failure(kind="none", title="no crash and no stall in the log")
