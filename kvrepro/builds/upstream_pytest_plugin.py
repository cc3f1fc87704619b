"""pytest plugin loaded (``-p kvrepro_upstream_plugin``) into a run of vLLM's own tests on a build.

It runs in the runtime env, not in kvrepro's: stdlib and pytest only (kvrepro copies this file
next to the build's ``tests/``). Its jobs:

* select vLLM's own CPU platform before any test module imports ``vllm.platforms``: a release
  wheel's version string does not say "cpu", so vLLM would otherwise resolve no platform here
  (no GPU). This is what vLLM's CPU CI gets from its CPU build; the platform code is vLLM's.
* keep only the tests kvrepro selected (node ids, one a line, in ``$KVREPRO_UPSTREAM_SELECT``):
  the release's CPU-runnable tests and the patches' regression tests; the rest is deselected,
  so what was excluded on the unpatched release is never run on a build.
* when the run is measured by coverage.py (the release's baseline, kvrepro/builds/upstream_impact.py),
  name the coverage context after the running test, so the data says which test executed which line,
  and mark a test that started a process (``spawned``): what a child process executes is not in the
  parent's data, so kvrepro runs such a test on every build.
* write each test phase's outcome and duration (``$KVREPRO_UPSTREAM_REPORT``, one JSON a line).
* skip the ``gc.collect()`` that vLLM's tests/conftest.py runs after every test: measured at 1-6 s a
  test here (600,000 objects from torch and transformers, under load), most of a run. vLLM's own
  switch is used (the ``skip_global_cleanup`` marker, "a ~10x speedup for non-GPU unit tests", its
  conftest says), and the rest of that cleanup, the distributed state's teardown, is still done after
  every test by vLLM's own functions. Outcomes on the release compared with the unmodified cleanup:
  docs/upstream-tests.md.
"""

from __future__ import annotations

import os

import pytest

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


def _skip_global_gc(items):
    for item in items:
        item.add_marker("skip_global_cleanup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):  # noqa: ARG001 - pytest's hook signature
    """vLLM's cleanup_dist_env_and_memory without its gc.collect() (see the module docstring)."""
    yield
    from vllm import envs
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    envs.disable_envs_cache()
    destroy_model_parallel()
    destroy_distributed_environment()


def _lines(env):
    listing = os.environ.get(env)
    if not listing:
        return None
    with open(listing, encoding="utf-8") as fh:
        return {line.strip() for line in fh if line.strip()}


# node ids (exact) already done by an earlier process of the same job, which died (kvrepro resumes)
DONE_ENV = "KVREPRO_UPSTREAM_DONE"


def pytest_collection_modifyitems(config, items):
    _skip_global_gc(items)
    wanted, done = _lines(SELECT_ENV), _lines(DONE_ENV) or set()
    kept, dropped = [], []
    for item in items:
        keep = (wanted is None or _selected(item.nodeid, wanted)) and item.nodeid not in done
        (kept if keep else dropped).append(item)
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


_SPAWNED = set()
_CURRENT = [None]


def _note_spawn(*_args, **_kwargs):
    if _CURRENT[0] is not None:
        _SPAWNED.add(_CURRENT[0])


def _watch_spawns():
    """Flag the running test when it forks or starts a process (Popen and multiprocessing's spawn do
    not go through os.fork)."""
    import multiprocessing.process
    import os as _os
    import subprocess

    _os.register_at_fork(before=_note_spawn)
    for owner, name in ((subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start")):
        original = getattr(owner, name)

        def wrapped(*args, _original=original, **kwargs):
            _note_spawn()
            return _original(*args, **kwargs)

        setattr(owner, name, wrapped)


def _coverage():
    if not os.environ.get(COVERAGE_ENV):
        return None
    import coverage

    return coverage.Coverage.current()


COVERAGE_ENV = "KVREPRO_UPSTREAM_COVERAGE"


def pytest_sessionstart(session):  # noqa: ARG001 - pytest's hook signature
    if os.environ.get(COVERAGE_ENV):
        _watch_spawns()


def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 - pytest's hook signature
    """Everything the test's setup, call and teardown execute is recorded under its node id."""
    cov = _coverage()
    _CURRENT[0] = item.nodeid
    if cov is not None:
        cov.switch_context(item.nodeid)


def pytest_runtest_logfinish(nodeid, location):  # noqa: ARG001 - pytest's hook signature
    cov = _coverage()
    _CURRENT[0] = None
    if cov is not None:
        cov.switch_context("")


def pytest_runtest_logreport(report):
    entry = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
             "seconds": round(report.duration, 3)}
    if report.when == "teardown" and report.nodeid in _SPAWNED:
        entry["spawned"] = True
    if report.outcome != "passed":
        entry["message"], entry["line"] = _crash(report)
    _write(entry)


def pytest_collectreport(report):
    """A test file that cannot be imported on this tree counts as one test in error."""
    if report.outcome == "failed":
        message, line = _crash(report)
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "message": message, "line": line})
