"""What changed from the previous release to ``X``, read from a release check's stages: entries newly
present or fixed, suite rows that differ from the catalogue, new explore findings, vLLM tests that
changed outcome, and what porting ``X`` needs. Rendered as markdown (report.md) and JUnit."""

from __future__ import annotations

import socket
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any

from .. import versions

# row states a suite gives (kvrepro/suite/judge.py); "shows" = the defect was seen
_SHOWS = {"PRESENT"}
_CLEAN = {"ABSENT", "UNREACHED"}


@dataclass(frozen=True)
class EntryChange:
    entry: str
    kind: str  # crash | corruption | stall
    before: str  # the row on the previous release
    after: str  # the row on X
    what: str  # "newly present" | "newly fixed" | "changed"
    expected: str | None  # the catalogue's claim for X


# a test that fails for what this machine lacks (a model config the offline hub does not hold, an
# accelerator, a platform feature) is not a vLLM regression; the failure messages that say so
_NOT_HERE = ("Invalid repository ID or local directory", "does not support", "Failed to infer device type",
             "CUDA", "No module named", "requires a GPU")


@dataclass(frozen=True)
class TestChange:
    nodeid: str
    before: str
    after: str
    message: str = ""

    @property
    def not_here(self) -> bool:
        return any(marker in self.message for marker in _NOT_HERE)

    @property
    def fix_test(self) -> bool:
        """An upstream test of a catalogue fix, taken from the release that carried the fix (``vllm
        0.30.0 tests/...``): when it stops passing on a later release, its mocks and fixtures no longer
        fit that release's code as often as the fix is undone, so it is reported, not counted."""
        return self.nodeid.startswith("vllm ")

    @property
    def regression(self) -> bool:
        """One of the release's own tests passed on the previous release and fails on this one, for
        something other than what this machine lacks."""
        return (self.before == "passed" and self.after in ("failed", "error") and not self.not_here
                and not self.fix_test)


@dataclass
class TestChanges:
    changed: list[TestChange] = field(default_factory=list)
    added: int = 0
    removed: int = 0


@dataclass
class Changes:
    release: str
    previous: str | None
    changed_entries: list[EntryChange] = field(default_factory=list)
    differ: list[dict[str, Any]] = field(default_factory=list)  # rows that differ from the catalogue
    new_findings: list[dict[str, Any]] = field(default_factory=list)
    tests: list[dict[str, Any]] = field(default_factory=list)
    tests_added: int = 0
    tests_removed: int = 0
    needs: list[dict[str, Any]] = field(default_factory=list)  # porting steps INFRA rows stopped on
    read: list[dict[str, Any]] = field(default_factory=list)  # what the static reading found


def test_changes(before: Any, after: Any) -> TestChanges:
    """Release outcomes (UpstreamTestRun.release) of the same node ids that differ between two runs."""
    old = {o.nodeid: o for o in before.release.outcomes}
    new = {o.nodeid: o for o in after.release.outcomes}
    out = TestChanges(added=len(set(new) - set(old)), removed=len(set(old) - set(new)))
    for nodeid in sorted(set(old) & set(new)):
        if old[nodeid].outcome != new[nodeid].outcome:
            out.changed.append(TestChange(nodeid, old[nodeid].outcome, new[nodeid].outcome, new[nodeid].message[:200]))
    return out


def _entry_kinds() -> dict[str, str]:
    try:
        from ..suite.run import load as load_catalogue

        return {e.name: e.kind for e in load_catalogue(None).entries}
    except Exception:  # the report is still written when the catalogue cannot be read
        return {}


def entry_changes(rows: list[dict[str, Any]], previous: str, release: str) -> list[EntryChange]:
    """Entries whose row on ``release`` differs from the one on ``previous``."""
    kinds = _entry_kinds()
    by = {(r["entry"], r["build"]): r for r in rows}
    out = []
    for entry in dict.fromkeys(r["entry"] for r in rows):
        a, b = by.get((entry, previous)), by.get((entry, release))
        if a is None or b is None or a["state"] == b["state"]:
            continue
        if b["state"] in _SHOWS and a["state"] in _CLEAN:
            what = "newly present"
        elif a["state"] in _SHOWS and b["state"] in _CLEAN:
            what = "newly fixed"
        else:
            what = "changed"
        out.append(EntryChange(entry, kinds.get(entry, "?"), a["state"], b["state"], what, b.get("expected")))
    return out


def collect(check: Any) -> Changes:
    stages = check.stages
    out = Changes(check.release, check.previous)
    rows = stages["suite"].detail.get("rows", [])
    if check.previous:
        out.changed_entries = entry_changes(rows, check.previous, check.release)
    out.differ = [r for r in rows if r.get("matches") is False]
    out.needs = list(stages["suite"].detail.get("needs", []))
    out.read = list(stages["port"].detail.get("read", []))
    out.new_findings = list(stages["explore"].detail.get("new", []))
    out.tests = list(stages["tests"].detail.get("changed", []))
    out.tests_added = stages["tests"].detail.get("added", 0)
    out.tests_removed = stages["tests"].detail.get("removed", 0)
    return out


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(check: Any) -> str:
    """report.md of a release check."""
    c: Changes = check.changes or Changes(check.release, check.previous)
    label = versions.label(check.release)
    lines = [f"# vLLM {label}: release check against {check.previous}", "",
             f"{check.status}, {check.seconds:.0f} s wall (`{check.command or 'kvrepro release check ' + check.release}`)."]
    if check.unported:
        lines += ["", f"**{versions.unported_note(check.release)}.**"]
    lines += ["", "| stage | status | seconds | summary |", "|---|---|---:|---|"]
    for s in check.stages.values():
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.0f} | {_cell(s.summary)} |")
    lines += ["", "## What changed since " + str(check.previous), ""]
    if c.changed_entries:
        lines += [f"| entry | kind | {check.previous} | {check.release} | what | catalogue for {check.release} |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| `{e.entry}` | {e.kind} | {e.before} | {e.after} | {e.what} | {e.expected or 'no claim'} |"
                  for e in c.changed_entries]
    elif not check.stages["suite"].detail.get("rows"):
        lines.append(f"The suite did not run ({check.stages['suite'].status}): nothing is known about the entries.")
    else:
        lines.append("No catalogue entry changed its row.")
    lines += ["", "### Rows that differ from the catalogue", ""]
    lines += ([f"- `{r['entry']}` on {r['build']}: expected {r['expected']}, got {r['state']} ({_cell(r['detail'])})"
               for r in c.differ] or ["None: every row agrees with defects/."])
    lines += ["", "### New explore findings", ""]
    lines += ([f"- {_cell(f['title'])} ({f.get('folder', '')})" for f in c.new_findings]
              or ["None (known failures only, or none)."])
    lines += ["", f"### vLLM tests that changed outcome ({c.tests_added} new in {check.release}, "
                  f"{c.tests_removed} gone)", ""]
    ran_tests = bool(check.stages["tests"].detail.get("runs"))
    if not ran_tests:
        lines.append(f"The tests did not run ({check.stages['tests'].status}).")
    lines += [] if not ran_tests else ([f"- `{t['nodeid']}`: {t['before']} -> {t['after']}" + (f" ({_cell(t['message'])})" if t['message'] else "")
               + (" (needs what this machine lacks)" if TestChange(**t).not_here else "")
               + (" (a fix's upstream test from an older release)" if TestChange(**t).fix_test else "")
               for t in c.tests] or ["None of the tests both releases have changed outcome."])
    lines += ["", "### Porting", ""]
    if c.needs:
        lines += [f"- **{n['entry']}** stopped on {n['step']}: {_cell(n['what'])} ({n['where']}); {_cell(n['fix'])}"
                  for n in c.needs]
    lines += [f"- read: {r['step']}: {_cell(r['what'])} ({r['where']})" for r in c.read] or ["- nothing read that "
                                                                                              "the table lacks"]
    bis = check.stages["bisect"]
    lines += ["", "### Bisection", "", bis.summary or bis.status]
    suite = check.stages["suite"].detail
    if suite.get("rows"):
        lines += ["", f"## Suite `{suite.get('suite_id')}`", "", f"| entry | {check.previous} | {label} | expected |",
                  "|---|---|---|---|"]
        by = {(r["entry"], r["build"]): r for r in suite["rows"]}
        for entry in dict.fromkeys(r["entry"] for r in suite["rows"]):
            a, b = by.get((entry, check.previous)), by.get((entry, check.release))
            lines.append(f"| `{entry}` | {a['state'] if a else '-'} | {b['state'] if b else '-'} | "
                         f"{(b or {}).get('expected') or 'no claim'} |")
    return "\n".join(lines) + "\n"


def junit_xml(check: Any) -> str:
    """One testsuite per stage; a testcase per suite row, changed test, new finding and porting need."""
    c: Changes = check.changes or Changes(check.release, check.previous)
    root = ET.Element("testsuites", name=f"kvrepro release check {versions.label(check.release)}")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(check.started))

    def suite(name: str, seconds: float) -> ET.Element:
        return ET.SubElement(root, "testsuite", name=f"kvrepro.release.{name}", timestamp=stamp,
                             hostname=socket.gethostname(), time=f"{seconds:.3f}")

    def case(ts: ET.Element, name: str, failure: str | None = None, error: str | None = None,
             skipped: str | None = None, out: str = "") -> None:
        tc = ET.SubElement(ts, "testcase", name=name, classname=ts.get("name", ""))
        if failure:
            ET.SubElement(tc, "failure", message=failure[:500]).text = failure
        if error:
            ET.SubElement(tc, "error", message=error[:500]).text = error
        if skipped:
            ET.SubElement(tc, "skipped", message=skipped[:500])
        if out:
            ET.SubElement(tc, "system-out").text = out

    for s in check.stages.values():
        ts = suite(s.name, s.seconds)
        if s.name == "suite" and s.detail.get("rows"):
            for r in s.detail["rows"]:
                failure = f"expected {r['expected']}, got {r['state']}" if r.get("matches") is False else None
                error = f"INFRA: {r['detail']}" if r["state"] == "INFRA" else None
                skipped = f"not testable here: {r['detail']}" if r["state"] == "NOT TESTABLE" else None
                case(ts, f"{r['entry']} on {versions.label(r['build'])}", failure, error, skipped, out=r["detail"])
        elif s.name == "tests" and s.detail.get("runs"):
            for t in c.tests:
                fail = f"{t['before']} on {check.previous}, {t['after']} on {check.release}"
                case(ts, t["nodeid"], fail if TestChange(**t).regression else None,
                     out=fail + (f": {t['message']}" if t["message"] else ""))
            case(ts, f"vLLM {check.release}'s own tests", out=s.summary)
        elif s.name == "explore" and s.detail.get("campaign"):
            for f in c.new_findings:
                case(ts, f"new finding: {f['title'][:120]}", failure=f["title"], out=f.get("folder", ""))
            case(ts, f"campaign {s.detail['campaign']}", out=s.summary)
        elif s.name == "port":
            for n in c.needs:
                case(ts, f"{n['entry']} needs {n['step']}", failure=f"{n['what']} ({n['where']}); {n['fix']}")
            case(ts, f"vLLM {versions.label(check.release)} read against {check.previous}", out=s.summary)
        else:
            case(ts, s.name, error=s.summary if s.status == "failed" else None,
                 skipped=s.summary or s.status if s.status in ("skipped", "interrupted") else None, out=s.summary)
        ts.set("tests", str(len(ts)))
        ts.set("failures", str(sum(1 for tc in ts for x in tc if x.tag == "failure")))
        ts.set("errors", str(sum(1 for tc in ts for x in tc if x.tag == "error")))
        ts.set("skipped", str(sum(1 for tc in ts for x in tc if x.tag == "skipped")))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
