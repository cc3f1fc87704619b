"""Shared fixtures. Tests that need the runtime env build it (idempotent, cached in ~/.cache/kvrepro);
tests that need Docker fail instead of skipping when CI is set (see `require`).

The suite runs on pytest-xdist workers (scripts/test.sh: `-n 2 --dist loadgroup`). Most tests keep
to what they start (their own tmp_path, TMPDIR, process tree, run ids), so they run side by side.
Tests that use something machine-wide run on one worker, one after another: the xdist group
"exclusive" (see `pytest_collection_modifyitems`)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IN_CI = bool(os.environ.get("CI"))


def require(condition: bool, why: str) -> None:
    """Skip on a developer's machine, fail under CI: CI must never pass by skipping."""
    if not condition:
        if IN_CI:
            pytest.fail(f"required under CI: {why}")
        pytest.skip(why)


EXCLUSIVE_MARKERS = ("docker", "exclusive")
COLLECTED = pytest.StashKey[list]()
# every fixture that hands a test vLLM (the overlays, an engine, a built matrix) depends on this one
ENGINE_FIXTURE = "runtime_python"


def runs_an_engine(item) -> bool:
    """Whether the test (or a fixture it uses) needs the vLLM runtime env: seconds to minutes each."""
    return ENGINE_FIXTURE in getattr(item, "fixturenames", ())


# module-scoped but nothing to share between workers: every test has it (autouse), and it only
# sets an environment variable, so it must not pin every module to one worker
UNGROUPED_MODULE_FIXTURES = ("shares_zygotes",)


def uses_module_fixture(item) -> bool:
    """Whether the test uses a module-scoped fixture (an engine, a wheel, a git history)."""
    info = getattr(item, "_fixtureinfo", None)
    return bool(info) and any(defs and defs[-1].scope == "module" for name, defs in info.name2fixturedefs.items()
                              if name not in UNGROUPED_MODULE_FIXTURES)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the items
def pytest_collection_modifyitems(config, items):
    """Group tests for `--dist loadgroup`; each group is one unit of work, run on one worker in order.

    * "exclusive": every test that touches a machine-wide resource, so no two run at once: docker
      tests check that no kvrepro-labelled container is left on the daemon (a label every docker
      test's containers carry), Ray tests start raylets on the fixed loopback addresses 127.0.0.11-13.
    * one group per module for the tests of that module that use a module-scoped fixture, so the
      engine, wheel or history it makes is made once, not once per worker.

    Every other test goes to whichever worker is free. xdist hands the groups out largest first,
    then single tests in collection order; on a worker, the tests that run an engine are put first,
    so the run ends on short tests on both workers, not on one engine test (the 105 s triage run)
    while the other worker idles. Serially (`-n 0`) the order is left as collected."""
    config.stash[COLLECTED] = list(items)  # before -k/-m deselect any: tests/test_xdist_groups.py checks them all
    for item in items:
        if any(item.get_closest_marker(name) for name in EXCLUSIVE_MARKERS):
            item.add_marker(pytest.mark.xdist_group("exclusive"))
        elif uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike: xdist checks their collections agree
        items.sort(key=lambda item: not runs_an_engine(item))  # stable: collection order within each part


# What the suite downloads on a machine whose kvrepro cache is empty (besides the default release,
# which `kvrepro setup` fetches before pytest starts): found in KVREPRO_HOME after a whole run on an
# empty one (2026-12-04). A release missing here is simply downloaded by the test that needs it.
PREFETCH_WHEELS = ("0.30.0", "0.31.0", "0.25.1", "0.27.0", "0.28.0", "0.33.0", "0.34.0")
PREFETCH_SDISTS = ("0.26.0", "0.30.0", "0.27.0", "0.28.0")
_PREFETCH = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: no half download left in the cache
from kvrepro.builds.sdist import fetch_sdist
from kvrepro.builds.wheel import fetch_wheel
wheels, sdists = sys.argv[1].split(","), sys.argv[2].split(",")
for i in range(max(len(wheels), len(sdists))):
    for fetch, names in ((fetch_wheel, wheels), (fetch_sdist, sdists)):
        if i < len(names):
            try:
                fetch(names[i])
            except Exception as exc:  # the test that needs it downloads it again and says why
                print(f"prefetch {names[i]}: {exc}", file=sys.stderr)
"""
PREFETCHER = pytest.StashKey[subprocess.Popen]()


def pytest_sessionstart(session):
    """On a machine whose cache lacks them, download the vLLM wheels and sdists the suite uses while
    the first tests run (network time under CPU time, instead of a test waiting for its download),
    in a process of the controlling pytest (it has nothing else to do under xdist). The downloads
    write to a temporary name and rename (kvrepro.builds.wheel/sdist), so a test fetching the same
    file at once only downloads it twice. KVREPRO_TEST_PREFETCH=0 turns it off."""
    from kvrepro.builds.sdist import sdists_dir
    from kvrepro.builds.wheel import cached_wheel

    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("KVREPRO_TEST_PREFETCH") == "0":
        return
    wheels = [v for v in PREFETCH_WHEELS if cached_wheel(v) is None]
    sdists = [v for v in PREFETCH_SDISTS if not (sdists_dir() / v / f"vllm-{v}.tar.gz.sha256").exists()]
    if wheels or sdists:
        from kvrepro import lifetime

        session.config.stash[PREFETCHER] = subprocess.Popen(  # SIGTERM too if pytest itself is killed
            [sys.executable, "-c", _PREFETCH, ",".join(wheels), ",".join(sdists)], start_new_session=True,
            stdout=subprocess.DEVNULL, preexec_fn=lifetime.child_hook())


def pytest_sessionfinish(session):
    """Whatever the prefetch has not finished when the tests have (an interrupted run) is stopped."""
    import signal

    proc = session.config.stash.get(PREFETCHER, None)
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def one_worker_at_a_time(tmp_path_factory, name: str):
    """Hold a lock shared by this run's xdist workers (their base temp folders share a parent), so
    a cold cache is built by one worker while the others wait and then find it built."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def shared_zygote_folder(tmp_path_factory):
    """This worker's folder of shared engine zygotes; they are stopped when the session ends."""
    from kvrepro.deploy.sim import stop_shared_zygotes

    folder = tmp_path_factory.mktemp("zygotes")
    yield folder
    stop_shared_zygotes(folder)


@pytest.fixture(scope="module", autouse=True)
def shares_zygotes(request):
    """A module marked ``shares_zygotes`` runs its kvrepro commands with KVREPRO_SHARED_ZYGOTES set
    (kvrepro/deploy/sim.py): each runtime's engine zygote is started once for the whole session
    and outlives each command, so a command forks its engines at once instead of importing torch
    & co. again (~9 CPU s a command). Only modules that judge a run's outcome are marked: tests of
    what a command leaves behind, of signals and of the zygote itself keep their own zygotes."""
    # KVREPRO_TEST_OWN_ZYGOTES=1: every command its own zygote, as before (benchmarks/pytest_wallclock.py compares)
    if request.node.get_closest_marker("shares_zygotes") is None or os.environ.get("KVREPRO_TEST_OWN_ZYGOTES"):
        yield
        return
    from kvrepro.deploy.sim import SHARED_ZYGOTES_ENV

    folder = request.getfixturevalue("shared_zygote_folder")
    before = os.environ.get(SHARED_ZYGOTES_ENV)
    os.environ[SHARED_ZYGOTES_ENV] = str(folder)
    yield
    if before is None:
        os.environ.pop(SHARED_ZYGOTES_ENV, None)
    else:
        os.environ[SHARED_ZYGOTES_ENV] = before


@pytest.fixture
def shared_zygotes_here(request, monkeypatch):
    """One test of an unmarked module runs its kvrepro commands with the session's shared zygotes
    (what ``shares_zygotes`` does for a whole module): for a test whose subject is not what a
    command leaves running, in a module whose other tests check exactly that."""
    if os.environ.get("KVREPRO_TEST_OWN_ZYGOTES"):
        return
    from kvrepro.deploy.sim import SHARED_ZYGOTES_ENV

    monkeypatch.setenv(SHARED_ZYGOTES_ENV, str(request.getfixturevalue("shared_zygote_folder")))


# The thin client of kvrepro/engine/zygote.py (stdlib only on this side): hands its argv, environment,
# working directory and stdio to the zygote, which forks and runs MODULE as `python -m` would.
_ZYGOTE_CLIENT = """
import sys
from kvrepro.engine.zygote import delegate
code = delegate(sys.argv[1], sys.argv[3:], module=sys.argv[2])
if code is None:
    sys.stderr.write("kvrepro-tests: no zygote answered\\n")
    sys.exit(199)
sys.exit(code)
"""
_NO_ZYGOTE = 199


class RuntimeScripts:
    """``python -c CODE ARGS`` / ``python -m MODULE ARGS`` in the default release's runtime env, forked
    from this worker's shared engine zygote: torch & co. are imported there once, so a script that
    imports vLLM pays ~2 CPU s instead of ~7. What the script sees is what every engine kvrepro
    runs sees (the zygote never imports vLLM or the probe; its environment, working directory and
    stdio are the caller's). ``-c CODE`` runs as a module written to a folder of its own that is
    added to PYTHONPATH (so ``sys.argv[0]`` is that file, not ``-c``). Without a shared zygote
    (KVREPRO_TEST_OWN_ZYGOTES=1), or if it does not answer, the script runs in a fresh
    interpreter as before; ``forked`` counts the scripts that did fork (tests/test_shared_zygote.py)."""

    def __init__(self, python: Path, zygote: str | None, folder: Path):
        self.python, self.zygote, self.folder, self.forked = Path(python), zygote, folder, 0

    def run(self, python: Path | str, args: list[str], *, env: dict[str, str], timeout: float,
            input: str | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        plain = dict(env=env, capture_output=True, text=True, timeout=timeout, input=input, cwd=cwd)
        if self.zygote is None or Path(python) != self.python or args[0] not in ("-c", "-m"):
            return subprocess.run([str(python), *args], **plain)
        env = dict(env)
        if args[0] == "-c":
            code = args[1]
            module = "kvrepro_test_script_" + hashlib.sha256(code.encode()).hexdigest()[:16]
            (self.folder / f"{module}.py").write_text(code)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(self.folder)) if p)
        else:
            module = args[1]
        proc = subprocess.run([sys.executable, "-I", "-c", _ZYGOTE_CLIENT, self.zygote, module, *args[2:]],
                              **dict(plain, env=env))
        if proc.returncode == _NO_ZYGOTE and "kvrepro-tests: no zygote answered" in proc.stderr:
            return subprocess.run([str(python), *args], **plain)
        self.forked += 1
        return proc


@pytest.fixture(scope="session")
def runtime_scripts(default_matrix, runtime_python, shared_zygote_folder, tmp_path_factory) -> RuntimeScripts:
    """This worker's :class:`RuntimeScripts`, on the same shared zygote the `shares_zygotes` modules'
    engines fork from (started here if none of them has yet)."""
    folder = tmp_path_factory.mktemp("runtime-scripts")
    if os.environ.get("KVREPRO_TEST_OWN_ZYGOTES"):
        return RuntimeScripts(runtime_python, None, folder)
    from kvrepro.deploy.sim import SHARED_ZYGOTES_ENV, SimTarget

    with pytest.MonkeyPatch.context() as env:
        env.setenv(SHARED_ZYGOTES_ENV, str(shared_zygote_folder))
        target = SimTarget(default_matrix)
        try:
            socket_path = target.shared_zygote_socket(default_matrix.matrix.base)
        finally:
            target.close()
    return RuntimeScripts(runtime_python, socket_path, folder)


def run_beside_the_probe(tree, tmp_path, script: str):
    """Run ``script`` in the runtime's python with the probe module importable and build A's vLLM
    tree on the path (no platform plugin): the probe's checks on vLLM's own classes, in a process
    of their own (the probe installs an import hook for the life of a process). ``tree`` is
    ``((python, scripts), root)``; returns the finished process."""
    import os
    import textwrap

    (python, scripts), root = tree
    probe = tmp_path / "probe"
    probe.mkdir(exist_ok=True)
    (probe / "kvrepro_probe.py").write_bytes((ROOT / "kvrepro" / "probe" / "kvrepro_probe.py").read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(probe), str(root)])
    env["VLLM_PLUGINS"] = "kvrepro-test-no-plugin"
    proc = scripts.run(python, ["-c", textwrap.dedent(script)], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


@contextlib.contextmanager
def local_ray_cluster(tmp_path_factory, nodes: int):
    """``nodes`` raylets on 127.0.0.11.., one logical CPU each (the fake part: remote hosts are
    loopback addresses); torn down (every process of it killed by pid, none by name) and checked
    to have left nothing."""
    from kvrepro.deploy.ray.localcluster import LocalCluster

    cache = tmp_path_factory.mktemp("ray-node-cache")
    os.environ["KVREPRO_RAY_NODE_CACHE"] = str(cache)  # inherited by the raylets and their workers
    cluster = LocalCluster(nodes=nodes, cpus_per_node=1).start()
    try:
        yield cluster
    finally:
        os.environ.pop("KVREPRO_RAY_NODE_CACHE", None)
        left = cluster.stop()
        assert not left, f"processes of the test cluster still alive: {left}"
        assert not cluster.processes()


@pytest.fixture(scope="session")
def default_matrix():
    from kvrepro.spec.matrix import load_matrix

    return load_matrix(ROOT / "matrix.yaml")


@pytest.fixture(scope="session")
def runtime_python(default_matrix, tmp_path_factory) -> Path:
    """The runtime env's python (vLLM's dependencies, torch CPU)."""
    from kvrepro.builds import prepare_runtime

    with one_worker_at_a_time(tmp_path_factory, "runtime"):
        return prepare_runtime(default_matrix.matrix.base).python


@pytest.fixture(scope="session")
def overlays(default_matrix, runtime_python, tmp_path_factory) -> dict[str, Path]:
    """The default matrix's builds A-D as overlays (patched vllm/ + probe), built by kvrepro.builds."""
    from kvrepro.builds import build_overlay

    built = {}
    with one_worker_at_a_time(tmp_path_factory, "overlays"):
        for plan in default_matrix.plans():
            artifact = build_overlay(plan)
            assert artifact.ok, artifact.error
            built[plan.name] = Path(artifact.ref)
    return built


@pytest.fixture(scope="session")
def pristine_vllm(default_matrix, tmp_path_factory) -> Path:
    """A folder holding vLLM 0.26.0's unpatched vllm/ sources (from the cached wheel)."""
    from kvrepro.builds import pristine_tree

    with one_worker_at_a_time(tmp_path_factory, "pristine"):
        _, tree, _ = pristine_tree(default_matrix.matrix.base)
    return tree


@pytest.fixture
def matrix_copy(tmp_path) -> Path:
    """A writable copy of matrix.yaml + builds/ to edit in a test."""
    shutil.copy(ROOT / "matrix.yaml", tmp_path / "matrix.yaml")
    shutil.copytree(ROOT / "builds", tmp_path / "builds")
    return tmp_path / "matrix.yaml"


def planned_run(**fields):
    """A run as the runner plans it (kvrepro.results.store.create_run's ``info``), from JSON-like fields."""
    from kvrepro.records import from_jsonable, to_jsonable
    from kvrepro.results.records import RunInfo

    return from_jsonable(RunInfo, {"run_id": "", "status": "running", **to_jsonable(fields)})
