"""A corpus of real reports and how `kvrepro triage` is judged on it.

A corpus is a folder of pasted logs and a ``manifest.yaml`` (tests/data/triage/real/ is ours; any
other folder in the same form can be judged the same way). Each report says what its text
supports as the answer (``expect``):

* an entry name (``queued-abort-store-assert``): the catalogue must name it first;
* ``{cites: [url, ...]}``: the catalogue entry whose ``upstream`` links cite one of those reports
  or fixes. This is how a report names an entry that does not exist yet: once an entry citing the
  issue lands in defects/, the expectation resolves to it without touching the corpus. None
  citing it: the report awaits an entry, and until then the right answer is "unknown";
* ``unknown``: no catalogue entry may be named (out of the family, or the text does not show
  the failure).

Each report is then one of: right first, a tie that holds the right entry (reported, not counted
as right), named wrong, missed (unknown where an entry was expected), kept unknown, a false match
(an entry named where none was expected), or refused (a BadInputError: triage declined the text).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import BadInputError
from ..suite.catalogue import Catalogue
from . import triage_file

RIGHT_FIRST = "right first"
TIE = "tie holding the right entry"
WRONG = "named the wrong entry"
MISSED = "unknown where an entry was expected"
KEPT_UNKNOWN = "kept unknown"
FALSE_MATCH = "false match"
REFUSED = "refused"


@dataclass(frozen=True)
class Report:
    file: str
    url: str
    area: str
    expect: Any  # str (entry or "unknown") or {"cites": [...]}
    thread_answer: Any = None
    diagnosis: str = ""
    note: str = ""


@dataclass(frozen=True)
class Judged:
    report: Report
    expected: str | None  # the entry expected, None for unknown
    pending: bool  # the report cites an entry the catalogue does not have yet
    got: str | None  # the entry triage named first
    tied: tuple[str, ...]  # entries tied with it at the top
    verdict: str
    detail: str = ""


@dataclass
class Summary:
    judged: list[Judged] = field(default_factory=list)

    def count(self, verdict: str) -> int:
        return sum(1 for j in self.judged if j.verdict == verdict)

    @property
    def expecting_entry(self) -> list[Judged]:
        return [j for j in self.judged if j.expected is not None]

    @property
    def expecting_unknown(self) -> list[Judged]:
        return [j for j in self.judged if j.expected is None]

    def table(self) -> dict[str, Any]:
        entry, unknown = self.expecting_entry, self.expecting_unknown
        return {
            "reports": len(self.judged),
            "expecting an entry": len(entry),
            "right first": sum(1 for j in entry if j.verdict == RIGHT_FIRST),
            "tie holding the right entry": sum(1 for j in entry if j.verdict == TIE),
            "expecting unknown": len(unknown),
            "of them awaiting a catalogue entry": sum(1 for j in unknown if j.pending),
            "unknown kept unknown": sum(1 for j in unknown if j.verdict == KEPT_UNKNOWN),
            "false matches": sum(1 for j in self.judged if j.verdict in (FALSE_MATCH, WRONG)),
            "refusals": self.count(REFUSED),
            "verdicts": dict(Counter(j.verdict for j in self.judged)),
        }


def load_manifest(folder: Path) -> list[Report]:
    data = yaml.safe_load((folder / "manifest.yaml").read_text())
    return [Report(file=r["file"], url=r["url"], area=r.get("area", ""), expect=r["expect"],
                   thread_answer=r.get("thread_answer"), diagnosis=r.get("diagnosis", ""), note=r.get("note", ""))
            for r in data["reports"]]


def resolve(expect: Any, catalogue: Catalogue) -> tuple[str | None, bool, str]:
    """(expected entry or None, awaiting an entry, a problem with the expectation or '')."""
    names = {e.name for e in catalogue.entries}
    if expect == "unknown":
        return None, False, ""
    if isinstance(expect, str):
        return (expect, False, "") if expect in names else (None, False, f"no entry {expect!r} in the catalogue")
    cites = [str(u).rstrip("/") for u in (expect or {}).get("cites", [])]
    citing = sorted(e.name for e in catalogue.entries
                    if any(str(u).rstrip("/") in cites for u in e.upstream))
    if not citing:
        return None, True, ""
    if len(citing) > 1:
        return None, False, f"entries {', '.join(citing)} all cite it: name the one expected"
    return citing[0], False, ""


def judge(folder: Path, catalogue: Catalogue, triage: Any = None) -> Summary:
    """Triage every report of the corpus in ``folder`` against ``catalogue``."""
    if triage is None:
        triage = triage_file
    summary = Summary()
    for report in load_manifest(folder):
        expected, pending, problem = resolve(report.expect, catalogue)
        if problem:
            raise ValueError(f"{folder / 'manifest.yaml'}: {report.file}: {problem}")
        try:
            found = triage(folder / report.file, catalogue)
        except BadInputError as exc:
            summary.judged.append(Judged(report, expected, pending, None, (), REFUSED, str(exc)))
            continue
        got = found.best.entry if found.best else None
        tied = tuple(m.entry for m in found.matches if found.best and m.score == found.best.score)
        if expected is None:
            verdict = KEPT_UNKNOWN if got is None else FALSE_MATCH
        elif got is None:
            verdict = MISSED
        elif expected in tied and len(tied) > 1:
            verdict = TIE
        else:
            verdict = RIGHT_FIRST if got == expected else WRONG
        summary.judged.append(Judged(report, expected, pending, got, tied if len(tied) > 1 else (), verdict,
                                     found.failure.title))
    return summary
