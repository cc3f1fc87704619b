"""pytest plugin loaded (``-p kvrepro_upstream_plugin``) into a run of vLLM's own tests on a build.

It runs in the runtime env, not in kvrepro's: stdlib and pytest only (kvrepro copies this file
next to the build's ``tests/``). Two jobs:

* select vLLM's own CPU platform before any test module imports ``vllm.platforms``: a release
  wheel's version string does not say "cpu", so vLLM would otherwise resolve no platform here
  (no GPU). This is what vLLM's CPU CI gets from its CPU build; the platform code is vLLM's.
* keep only the tests kvrepro selected (node ids, one a line, in ``$KVREPRO_UPSTREAM_SELECT``):
  the release's CPU-runnable tests and the patches' regression tests; the rest is deselected,
  so what was excluded on the unpatched release is never run on a build.
"""

from __future__ import annotations

import os

SELECT_ENV = "KVREPRO_UPSTREAM_SELECT"


def pytest_configure(config):  # noqa: ARG001 - pytest's hook signature
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()


def _selected(nodeid, wanted):
    """A selected id selects itself, its parametrizations (``test_x[a]``) and, for a file or a class,
    what is inside it (``tests/a.py`` keeps ``tests/a.py::test_x``)."""
    if nodeid in wanted or nodeid.split("[")[0] in wanted:
        return True
    parts = nodeid.split("::")
    return any("::".join(parts[:n]) in wanted for n in range(1, len(parts)))


def pytest_collection_modifyitems(config, items):
    listing = os.environ.get(SELECT_ENV)
    if not listing:
        return
    with open(listing, encoding="utf-8") as fh:
        wanted = {line.strip() for line in fh if line.strip()}
    kept, dropped = [], []
    for item in items:
        (kept if _selected(item.nodeid, wanted) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


REPORT_ENV = "KVREPRO_UPSTREAM_REPORT"


def _write(entry):
    path = os.environ.get(REPORT_ENV)
    if path:
        import json

        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")


def _crash(report):
    """(the exception line, the source line pytest marks with '>') of a failed phase."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: "), ""
    crash = getattr(longrepr, "reprcrash", None)
    message = crash.message.splitlines()[0] if crash is not None and crash.message else ""
    # the failing statement: the line pytest marks with '>' and its continuation lines
    marked, statement = [], []
    for line in str(report.longreprtext).splitlines():
        if line.startswith(">"):
            statement = [line[1:].strip()]
        elif statement and line.startswith(" ") and line.strip():
            statement.append(line.strip())
        elif statement:
            marked.append(" ".join(statement))
            statement = []
    if statement:
        marked.append(" ".join(statement))
    if crash is not None and marked:
        marked[-1] += f"  ({crash.path.rsplit('/', 1)[-1]}:{crash.lineno})"
    if not message:
        lines = [line for line in str(report.longreprtext).splitlines() if line.strip()]
        message = lines[-1] if lines else ""
    return message[:500], (marked[-1] if marked else "")[:300]


def pytest_runtest_logreport(report):
    entry = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
    if report.outcome != "passed":
        entry["message"], entry["line"] = _crash(report)
    _write(entry)


def pytest_collectreport(report):
    """A test file that cannot be imported on this tree counts as one test in error."""
    if report.outcome == "failed":
        message, line = _crash(report)
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "message": message, "line": line})
