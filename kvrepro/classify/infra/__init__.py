"""Known infrastructure root causes, one module per cause, each defining ``CAUSE``.

A worker that died after a collective-communication timeout, or on a GPU that reported a hardware
fault, says nothing about the code under test: the run is INFRA, and its title is the line that
said so (not "crash of unknown cause", nor the traceback the death caused downstream). Each cause
is a table entry (syzkaller's pkg/report style): a regex searched in each line of the log, what it
means, where it was reported upstream, and a test log under ``tests/data/logs/`` that the tests
classify and expect this cause's title from.

What is deliberately *not* here, because the code under test produces it too (a kernel that reads
or writes out of bounds, a bad index into the KV cache):

* ``CUDA error: an illegal memory access was encountered`` -- a crash;
* ``CUDA error: unspecified launch failure`` -- ambiguous: a faulting kernel of the code under test
  raises it as readily as a failing GPU (vllm#27430 saw it with a GPU left in ``ERR!``), so alone
  it stays a crash, and is INFRA only when the driver's hardware line (an ECC error, a hardware
  Xid, "fallen off the bus") came first;
* NVIDIA Xid codes that an application causes (13 graphics engine exception, 31 memory page fault,
  43 GPU stopped processing, 45 preemptive cleanup): they follow a faulting kernel.

A cause counts when its line comes before the traceback that ended the run, or inside it (the
exception line of a ``DistBackendError: NCCL error ...``); one logged after the engine had already
died of something else is that death's consequence.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

# what torch's C++ logging (glog/c10) puts before a line: `[rank0]:[E321 02:07:08.408271257
# ProcessGroupNCCL.cpp:607] ` -- rank, level+date, time and source position; not part of a title
_CPP_PREFIX = re.compile(r"^(?:\[rank\d+\]:)?\[[DIWEF]\d{4} [\d:.]+ (?:\d+ )?[\w.]+:\d+\] ")
# the kernel's timestamp in front of a dmesg line: `[14282.651831] `
_KERNEL_TS = re.compile(r"^\[\s*\d+\.\d+\] ")


@dataclass(frozen=True)
class InfraCause:
    """One infrastructure root cause.

    ``line`` is a regex searched in a log line's text (decorations removed, see
    :mod:`kvrepro.classify.lines`); ``keywords`` are plain substrings, one of which every matching
    line contains (a cheap filter before the regex: logs of long runs reach hundreds of MB).
    ``title`` is formatted with ``kind`` and ``line`` (the matching line, torch's C++ log prefix
    removed).
    """

    name: str
    kind: str
    line: str
    keywords: tuple[str, ...]
    why: str
    title: str = "{kind}: {line}"
    upstream: tuple[str, ...] = ()
    test_log: str | None = None  # file name under tests/data/logs/
    _regex: re.Pattern[str] = field(default=re.compile(""), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", re.compile(self.line))

    def search(self, text: str) -> bool:
        return any(k in text for k in self.keywords) and self._regex.search(text) is not None

    def render_title(self, text: str) -> str:
        return self.title.format(kind=self.kind, line=strip_prefix(text))


def strip_prefix(text: str) -> str:
    """A line without the C++ logger's or the kernel's prefix, whitespace collapsed."""
    text = text.strip()
    text = _CPP_PREFIX.sub("", text)
    text = _KERNEL_TS.sub("", text)
    return " ".join(text.split())


@functools.lru_cache(maxsize=1)
def known_infra_causes() -> tuple[InfraCause, ...]:
    """Every cause under kvrepro/classify/infra/, by name."""
    import sys

    from ..tables import table_entries

    return table_entries(sys.modules[__name__], "CAUSE", InfraCause, "infra")


@functools.lru_cache(maxsize=1)
def infra_keywords() -> tuple[str, ...]:
    return tuple(dict.fromkeys(k for c in known_infra_causes() for k in c.keywords))


def match_infra(text: str) -> InfraCause | None:
    """The first cause (by name) whose line this is, or None."""
    if not any(k in text for k in infra_keywords()):
        return None
    return next((c for c in known_infra_causes() if c.search(text)), None)
