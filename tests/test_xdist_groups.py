"""The test command runs on xdist workers (scripts/test.sh); tests that use something machine-wide
must share one worker (conftest.py's "exclusive" group), or a docker test's "no kvrepro container
is left" would see another worker's engine, and two loopback Ray clusters would claim the same
addresses. These checks read every test this pytest session collected (`pytest tests -k xdist_groups`
checks the whole suite), so a new test that starts containers or raylets without the `docker` or
`exclusive` mark fails here."""

from __future__ import annotations

import inspect

import pytest

from conftest import COLLECTED, EXCLUSIVE_MARKERS, uses_module_fixture

# the fixtures that hand a test the Docker daemon, and what a test (or a fixture it uses) calls
# when it starts containers or raylets itself
DOCKER_FIXTURES = {"docker_host", "docker_base", "cpu_base"}
MACHINE_WIDE_CALLS = ("LocalCluster(", ".containers.")


def sources(item) -> str:
    """The test function's source and that of every fixture it uses."""
    funcs = [item.function] + [defs[-1].func for defs in item._fixtureinfo.name2fixturedefs.values() if defs]
    found = []
    for func in funcs:
        try:
            found.append(inspect.getsource(func))
        except (OSError, TypeError):
            continue  # a fixture of pytest itself (tmp_path, monkeypatch)
    return "\n".join(found)


def group_of(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark else None


def test_every_test_that_uses_docker_or_ray_is_in_the_exclusive_group(request):
    items = [i for i in request.config.stash[COLLECTED] if isinstance(i, pytest.Function)]
    machine_wide = [i for i in items if DOCKER_FIXTURES & set(i.fixturenames)
                    or any(call in sources(i) for call in MACHINE_WIDE_CALLS)]
    assert machine_wide or len(items) < 100, "found no docker or Ray test in the whole suite: the check is blind"
    outside = [i.nodeid for i in machine_wide if group_of(i) != "exclusive"]
    assert outside == [], f"start containers or raylets but lack @pytest.mark.docker / exclusive: {outside}"
    for item in items:
        marked = any(item.get_closest_marker(name) for name in EXCLUSIVE_MARKERS)
        assert marked == (group_of(item) == "exclusive"), item.nodeid


def test_tests_sharing_a_module_fixture_share_a_worker(request):
    """A module-scoped fixture (an engine, a wheel) is made once per worker that runs its tests:
    they are one group, named after the module, unless they are exclusive."""
    for item in request.config.stash[COLLECTED]:
        if isinstance(item, pytest.Function) and uses_module_fixture(item) and group_of(item) != "exclusive":
            assert group_of(item) == item.module.__name__, item.nodeid


GROUPED_MODULE = '''
import os
import time
import pytest

@pytest.fixture(scope="module")
def made_once():
    return object()

@pytest.mark.parametrize("i", range(4))
def test_shares(made_once, i):
    time.sleep(0.3)

@pytest.mark.exclusive
@pytest.mark.parametrize("i", range(4))
def test_machine_wide(i):
    time.sleep(0.3)

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    started("free")
    time.sleep(0.3)

@pytest.fixture
def runtime_python():  # stands in for conftest's (the vLLM runtime env): marks a test that runs an engine
    return None

@pytest.mark.parametrize("i", range(2))
def test_engine(runtime_python, i):
    started("engine")
    time.sleep(0.3)

def started(kind):
    with open(os.path.join(os.path.dirname(__file__), "started.log"), "a") as log:
        log.write(f"{os.environ['PYTEST_XDIST_WORKER']} {kind}\\n")
'''


def test_loadgroup_really_keeps_each_group_on_one_worker(tmp_path):
    """The groups only mean something if xdist acts on them: pytest 9.2 with pytest-xdist 3.8 runs
    `--dist loadgroup` as plain `load` (every xdist_group ignored, nothing fails), which put docker
    and Ray tests side by side and made each module fixture once per worker. This runs our
    conftest's grouping on two real workers and reads where, and in which order, each test ran."""
    import os
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_grouped.py").write_text(GROUPED_MODULE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    exclusive: machine-wide\n    docker: daemon\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_ADDOPTS"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                           "no:cacheprovider", "test_grouped.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    ran = re.findall(r"^\[(gw\d)\] .*PASSED test_grouped\.py::(test_\w+)\[\d\](@\S+)?", proc.stdout, re.M)
    assert len(ran) == 16, proc.stdout[-3000:]
    for test, group in (("test_shares", "@test_grouped"), ("test_machine_wide", "@exclusive")):
        workers = {worker for worker, name, suffix in ran if name == test and suffix == group}
        assert len(workers) == 1 and sum(name == test for _, name, _ in ran) == 4, (test, ran)
    assert all(suffix == "" for _, name, suffix in ran if name in ("test_free", "test_engine")), ran
    # single tests that run an engine are handed out first: on each worker none follows a short one
    started = [line.split() for line in (tmp_path / "started.log").read_text().splitlines()]
    assert sorted(kind for _, kind in started) == ["engine"] * 2 + ["free"] * 6, started
    for worker in {w for w, _ in started}:
        kinds = [kind for w, kind in started if w == worker]
        assert kinds == sorted(kinds), (worker, started)  # "engine" < "free"
