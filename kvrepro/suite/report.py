"""A suite run as a table (fits 80 columns), as JSON and as JUnit XML.

JUnit: one ``<testsuite>`` per entry, one ``<testcase>`` per entry and build (classname
``kvrepro.suite.<entry>``, name the build key). A row that differs from the catalogue's
expectation is a ``<failure>``; INFRA is an ``<error>``; NOT TESTABLE is ``<skipped>`` with the
reason; the row's evidence (detail, run folders) is in ``<system-out>``.
"""

from __future__ import annotations

import re
import socket
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from .. import versions
from ..records import to_jsonable
from ..report import stack
from ..results.store import write_atomic
from .judge import ABSENT, INFRA, NOT_TESTABLE, OTHER, PRESENT, UNREACHED, Row
from .run import SuiteResult

_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_safe(text: str) -> str:
    """XML 1.0 cannot carry most control characters: shown as \\xNN (as kvrepro.report.junit does)."""
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


_STYLE = {PRESENT: "red", ABSENT: "green", UNREACHED: "yellow", OTHER: "magenta", NOT_TESTABLE: "dim", INFRA: "magenta"}


def _mark(row: Row) -> str:
    if row.matches is None:
        return "-"
    return "ok" if row.matches else "FAIL"


def _build_label(key: str) -> str:
    """A build key with its release marked when unported (``0.35.0 (unported)+pr-1``)."""
    release, _, rest = key.partition("+")
    return versions.label(release) + (f"+{rest}" if rest else "")


def table(suite: SuiteResult) -> Table:
    """entry | build | row | expected | ok: the detail goes on a second line so that it fits 80 columns."""
    wall = f", {suite.seconds:.0f} s" if suite.seconds else ""
    t = Table(title=f"kvrepro suite {suite.suite_id} ({suite.status}{wall})", title_justify="left",
              show_lines=False, pad_edge=False)
    t.add_column("entry", overflow="fold", max_width=26)
    t.add_column("build", overflow="fold", max_width=22)
    t.add_column("row / evidence", overflow="fold", max_width=30)
    t.add_column("expect", max_width=7)
    t.add_column("ok", max_width=4)
    last = None
    for row in suite.rows:
        style = _STYLE.get(row.state, "")
        cell = f"[{style}]{row.state}[/]" if style else row.state
        detail = row.detail
        if row.state == NOT_TESTABLE and row.entry == last:
            detail = "(as above)"  # the reason once per entry; --json and JUnit carry it on every row
        if detail:
            cell += f"\n[dim]{escape(detail)}[/]"
        t.add_row(row.entry if row.entry != last else "", _build_label(row.build), cell, row.expected or "-",
                  _mark(row) if row.matches is not False else "[bold red]FAIL[/]")
        last = row.entry
    return t


def as_json(suite: SuiteResult) -> dict[str, Any]:
    return {
        "suite_id": suite.suite_id, "path": str(suite.path), "status": suite.status, "seconds": suite.seconds,
        "catalogue": suite.catalogue, "builds": [b.key for b in suite.builds],
        "unported": [b.key for b in suite.builds if versions.is_unported(b.release)],
        "rows": [to_jsonable(r) | {"failed": r.failed} for r in suite.rows],
        "mismatches": len(suite.mismatches), "notes": list(suite.notes),
        # --patch: the failing entries' failures against the releases without the stack (issue 51)
        "introduced": stack.as_json(suite.introduced),
    }


def junit_xml(suite: SuiteResult) -> str:
    root = ET.Element("testsuites", name=f"kvrepro suite {suite.suite_id}")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    by_entry: dict[str, list[Row]] = {}
    for row in suite.rows:
        by_entry.setdefault(row.entry, []).append(row)
    for entry, rows in by_entry.items():
        ts = ET.SubElement(root, "testsuite", name=f"kvrepro suite {entry}")
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        seconds = 0.0
        for row in rows:
            case = ET.SubElement(ts, "testcase", name=_build_label(row.build), classname=f"kvrepro.suite.{entry}",
                                 time=f"{row.seconds:.3f}")
            counts["tests"] += 1
            seconds += row.seconds
            if row.state == NOT_TESTABLE:
                ET.SubElement(case, "skipped", message=_xml_safe(f"not testable here: {row.detail}"))
                counts["skipped"] += 1
            elif row.state == INFRA:
                error = ET.SubElement(case, "error", type="INFRA", message=_xml_safe(f"infrastructure: {row.detail}"))
                error.text = _xml_safe(row.detail)
                counts["errors"] += 1
            elif row.failed:
                failure = ET.SubElement(case, "failure", type="expectation",
                                        message=f"expected {row.expected}, got {row.state}")
                failure.text = _xml_safe(f"expected: {row.expected}\nrow: {row.state}\nevidence: {row.detail}\n")
                counts["failures"] += 1
            lines = [f"row: {row.state}", f"evidence: {row.detail}", f"expected: {row.expected or '(no claim)'}",
                     f"repetitions: {row.reps}  seconds: {row.seconds:.1f}"] + [f"logs: {d}" for d in row.run_dirs]
            ET.SubElement(case, "system-out").text = _xml_safe("\n".join(lines) + "\n")
        for key, value in counts.items():
            ts.set(key, str(value))
            totals[key] += value
        ts.set("time", f"{seconds:.3f}")
        ts.set("timestamp", stamp)
        ts.set("hostname", socket.gethostname())
    for key in ("tests", "failures", "errors"):
        root.set(key, str(totals[key]))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(suite: SuiteResult, path: Path) -> Path:
    write_atomic(path, junit_xml(suite))
    return path


def exit_code(suite: SuiteResult, reporting: bool = False) -> int:
    """As `matrix run --ci`: 130 interrupted, 1 a row differs from the catalogue, 3 INFRA, else 0.
    ``reporting`` (`suite report`): the report itself was not interrupted, so never 130; the
    rows an interruption left unrun are INFRA (3)."""
    if suite.status == "interrupted" and not reporting:
        return 130
    if suite.mismatches:
        return 1
    if any(r.state == INFRA for r in suite.rows):
        return 3
    return 0


def entries_table(catalogue: Any) -> Table:
    """`suite list`: every entry, its kind and signature, where present and fixed, what measured it."""
    table = Table(title=f"{catalogue.folder}: {len(catalogue.entries)} known defects", title_justify="left")
    for col, width in (("entry", 26), ("kind", 10), ("present / fixed in", 28), ("measured", 9)):
        table.add_column(col, overflow="fold", max_width=width)
    for e in catalogue.entries:
        where = ("present: " + ", ".join(e.present_in) if e.present_in else "") + \
            ("\nfixed: " + ", ".join(e.fixed_in) if e.fixed_in else "")
        measured = "not testable" if not e.testable else (f"{len(e.reproduced)} run(s)" if e.reproduced else "no")
        table.add_row(f"{e.name}\n[dim]{escape(e.signature)}[/]", e.kind, where.strip(), measured)
    return table


def entries_json(catalogue: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in to_jsonable(e).items() if k != "fragment_yaml"} for e in catalogue.entries]
