"""Classify an engine log: did the engine die, on which crash, and did the tested path run.

Public API:

* :func:`parse_log` / :class:`ParsedLog` (:class:`LogParser`, :class:`LogTail` for a growing
  file) -- a log parsed once into one report (classification, exposure, engine counters, KV
  capacity and geometry lines) that every consumer reads (kvrepro/classify/report.py).
* :func:`classify_log` / :func:`classify_file` -- find the traceback that killed the engine and
  reduce it to a :class:`~kvrepro.records.Signature` and a one-line title, and say whether it is
  the matrix's target crash, another crash, an infrastructure failure or no crash at all
  (:class:`~kvrepro.records.Outcome`).
* :func:`is_target_crash` -- the one rule for "is this signature the matrix's target crash"
  (the classifier, the minimizer and the emitted test's check all ask it).
* :func:`read_exposure` -- the probe's counts of how often the crash's precondition occurred.
* :func:`read_engine_counters` -- the GPU-free engine's own totals (steps, offload jobs).
* :func:`known_patterns` / :func:`match_pattern` / :class:`Pattern` -- the table of known
  crashes, one module each under ``kvrepro/classify/signatures/``.
* :func:`~kvrepro.classify.infra.known_infra_causes` -- the table of infrastructure root causes
  (NCCL timeouts and errors, GPU hardware errors), one module each under
  ``kvrepro/classify/infra/``: a run whose log shows one before what ended it is INFRA, titled
  with that line.

Logs of the GPU-free engine, of ``vllm serve`` (multi-process, prefixed lines), of ``docker logs
-t`` and ``docker compose logs`` are all understood; see :mod:`kvrepro.classify.lines`.
"""

from __future__ import annotations

from pathlib import Path

from .records import Classification
from ..spec.matrix import TargetSignature
from .classifier import classify_lines, excerpt, fatal_traceback, is_target_crash
from .engine_counters import read_engine_counters
from .exposure import read_exposure
from ..errors import BadInputError
from .logfile import open_log
from .patterns import Pattern, known_patterns, match_pattern
from .report import LogParser, LogTail, ParsedLog, parse_log

__all__ = [
    "LogParser",
    "LogTail",
    "ParsedLog",
    "Pattern",
    "classify_file",
    "classify_log",
    "crash_excerpt",
    "is_target_crash",
    "known_patterns",
    "match_pattern",
    "parse_log",
    "read_engine_counters",
    "read_exposure",
]


def classify_log(text: str, source_root: Path | None = None,
                 target: TargetSignature | None = None) -> Classification:
    """Classify the text of an engine log.

    ``source_root`` is a folder holding the build's ``vllm/`` package: with it, the crashing
    ``file:line`` is resolved to the whole statement (Python prints one line of a wrapped one).
    ``target`` defaults to ``TargetSignature()``, the crash of kvrepro's default matrix.
    """
    return classify_lines(text, source_root, target)


def classify_file(path: str | Path, source_root: Path | None = None,
                  target: TargetSignature | None = None, notices: list[str] | None = None) -> Classification:
    """Classify a log file, streaming it (logs of long runs reach hundreds of MB).

    A compressed file is read decompressed, UTF-16 transcoded, every line cut to a bound; a file
    that is not a text log at all (binary, damaged compressed data) is
    :class:`~kvrepro.classify.logfile.NotTextLog`; a few bytes that are not UTF-8 (a line cut
    mid-character) are replaced rather than failing the classification (kvrepro/classify/logfile.py).
    ``notices``: what reading it noticed (lines cut) is appended there.
    """
    with open_log(path, require_text=True, notices=notices) as fh:
        return classify_lines(fh, source_root, target)


def crash_excerpt(path: str | Path, max_frames: int = 3) -> list[str]:
    """The relevant lines of the traceback that killed the engine in a log file (innermost frames,
    their code, the exception line), for a report; empty when the log holds none."""
    try:
        with open_log(path) as fh:  # never blocks on a FIFO left in a results folder
            tb = fatal_traceback(fh)
    except (OSError, BadInputError):
        return []
    return excerpt(tb, max_frames) if tb is not None else []
