"""JUnit XML of a recorded run, the format CI systems already read.

One ``<testsuite>`` per (base, build) and one ``<testcase>`` per repetition, so a CI page lists
"0.26.0 / B / rep 1" the way a person asks about it. A repetition whose verdict differs from the
build's ``expect:`` is a ``<failure>`` naming the expected and the actual verdict; an INFRA
repetition is an ``<error>`` (it says nothing about the code); an INTERRUPTED one is
``<skipped>``. The evidence (verdict, title, counts, the crash's traceback lines, where the logs
are) is in each testcase's ``<system-out>``. The tests validate the output against
tests/data/junit/junit.xsd, kvrepro's statement of the format as Jenkins, GitLab and GitHub's
readers accept it.
"""

from __future__ import annotations

import re
import socket
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .. import versions
from ..records import RunResult, Verdict
from .expectations import Check, check
from ..results.store import BuildResults, MatrixRun, write_atomic


def _evidence(build: BuildResults, r: RunResult) -> str:
    from ..classify import crash_excerpt

    lines = [
        f"verdict: {r.label}" + (f" (expected {build.expect})" if build.expect else ""),
        f"title: {r.title}",
        f"base: {versions.label(r.base or build.base)}  build: {build.build_name}  patches: {' -> '.join(build.patches) or '(base)'}",
        f"requests: {r.requests}  seconds under load: {r.load_seconds:.1f}  wall seconds: {r.seconds:.1f}"
        + (f"  stopped because: {r.load.stopped_because}" if r.load is not None else "")
        + (f" ({r.load.settled_by})" if r.load is not None and r.load.settled_by else ""),
        f"trigger count: {r.trigger_count}  offload-hit calls: {r.external_hit_calls}  "
        f"offload loads: {'?' if r.offload_load_jobs is None else r.offload_load_jobs}",
        f"bug state: {r.state_count}" + (f" {dict(sorted(r.state_groups.items()))}" if r.state_groups else "")
        + f"  KV check: {r.kv_check}",
    ]
    if r.infra_error:
        lines.append(f"infrastructure: {r.infra_error}")
    if r.run_dir:
        lines.append(f"logs: {r.run_dir}")
        if r.verdict in (Verdict.CRASH, Verdict.CORRUPT):
            excerpt = crash_excerpt(Path(r.run_dir) / "engine.log")
            if excerpt:
                lines += ["traceback (innermost frames):", *excerpt]
    return _xml_safe("\n".join(lines) + "\n")


_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_safe(text: str) -> str:
    """XML 1.0 cannot carry most control characters (ANSI colours in a log would make the file
    unreadable to every CI system): they are shown as \\xNN instead."""
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _name(text: str) -> str:
    """A CI "class name" segment: dots would split ``0.26.0`` into packages."""
    return text.replace(".", "_").replace(" ", "_")


def junit_xml(run: MatrixRun) -> str:
    root = ET.Element("testsuites", name=f"kvrepro {run.run_id}")
    totals = {"tests": 0, "failures": 0, "errors": 0, "time": 0.0}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(run.info.started or time.time()))
    for build in run.builds:
        suite = ET.SubElement(root, "testsuite", name=f"kvrepro {versions.label(build.base)} {build.build_name}")
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
        properties = ET.SubElement(suite, "properties")
        for key, value in (("run_id", run.run_id), ("base", build.base), ("build", build.build_name),
                           ("patches", " -> ".join(build.patches)), ("expect", build.expect or ""),
                           ("target", run.info.target), ("kvrepro_version", run.info.kvrepro_version),
                           ("unported", "true" if versions.is_unported(build.base) else "false")):
            ET.SubElement(properties, "property", name=key, value=value)
        for r in build.runs:
            case = ET.SubElement(suite, "testcase", name=f"{build.name} rep {r.rep}",
                                 classname=f"kvrepro.{_name(build.base)}.{_name(build.build_name)}",
                                 time=f"{r.seconds:.3f}")
            counts["tests"] += 1
            counts["time"] += r.seconds
            if r.verdict is Verdict.INTERRUPTED:
                ET.SubElement(case, "skipped", message="interrupted before the budget was spent")
                counts["skipped"] += 1
            elif r.verdict is Verdict.DAMAGED:  # its verdict.json cannot be read: not a pass
                error = ET.SubElement(case, "error", type="DAMAGED", message=_xml_safe(r.title))
                error.text = _xml_safe(r.title)
                counts["errors"] += 1
            elif check(r, build.expect) is Check.INFRA:
                error = ET.SubElement(case, "error", type="INFRA", message=_xml_safe(f"infrastructure: {r.title}"))
                error.text = _xml_safe(r.infra_error or r.title)
                counts["errors"] += 1
            elif check(r, build.expect) is Check.DIFFERS:
                failure = ET.SubElement(case, "failure", type="verdict",
                                        message=f"expected {build.expect}, got {r.label}")
                failure.text = _xml_safe(f"expected verdict: {build.expect}\nactual verdict: {r.label}\n"
                                         f"title: {r.title}\n")
                counts["failures"] += 1
            ET.SubElement(case, "system-out").text = _evidence(build, r)
        suite.set("tests", str(counts["tests"]))
        suite.set("failures", str(counts["failures"]))
        suite.set("errors", str(counts["errors"]))
        suite.set("skipped", str(counts["skipped"]))
        suite.set("time", f"{counts['time']:.3f}")
        suite.set("timestamp", stamp)
        suite.set("hostname", run.info.host.hostname if run.info.host else socket.gethostname())
        for key in ("tests", "failures", "errors"):
            totals[key] += counts[key]
        totals["time"] += counts["time"]
    root.set("tests", str(totals["tests"]))
    root.set("failures", str(totals["failures"]))
    root.set("errors", str(totals["errors"]))
    root.set("time", f"{totals['time']:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(run: MatrixRun, path: Path) -> Path:
    write_atomic(path, junit_xml(run))
    return path
