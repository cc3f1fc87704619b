"""The runtime env's byte code is ready for the first engine (issue 27, warm first starts): what pip
compiled into the env's __pycache__ folders is hard-linked into the engines' byte-code folder
(PYTHONPYCACHEPREFIX), and a real Python run with that prefix loads it instead of compiling again.

Real venv, real files, real `python` processes; the runtime is a bare venv (no torch) plus a layer
holding one compiled module, so the test needs no runtime env."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from kvrepro import paths
from kvrepro.builds.runtime import Runtime, seed_byte_code


@pytest.fixture
def bare_runtime(tmp_path, monkeypatch) -> Runtime:
    monkeypatch.setenv("KVREPRO_HOME", str(tmp_path / "home"))
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env)
    layer = tmp_path / "layer"
    (layer / "seedling").mkdir(parents=True)
    source = layer / "seedling" / "__init__.py"
    source.write_text("GROWN = 'from the layer'\n")
    py_compile.compile(str(source), doraise=True)  # as pip does when it installs a layer
    return Runtime(env / "bin" / "python", (layer,))


def _pyc(prefix: Path, source: Path) -> Path:
    return prefix / str(source.parent).lstrip(os.sep) / f"{source.stem}.{sys.implementation.cache_tag}.pyc"


def test_the_envs_byte_code_is_linked_into_the_prefix_and_python_loads_it(bare_runtime):
    layer_source = bare_runtime.layers[0] / "seedling" / "__init__.py"
    stdlib_source = Path(__import__("json").__file__)  # the runtime's standard library: the same python
    in_tree = stdlib_source.parent / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"
    assert in_tree.is_file()

    linked = seed_byte_code(bare_runtime)
    prefix = paths.pycache_prefix()
    assert linked > 100  # the standard library's modules, at least
    for source in (layer_source, stdlib_source):
        pyc = _pyc(prefix, source)
        assert pyc.is_file(), pyc
    # a link, not a copy: the same file as the one in the tree
    assert os.path.samefile(_pyc(prefix, stdlib_source), in_tree)
    assert (prefix / ".seeded" / bare_runtime.key).read_text().strip() == str(linked)

    # an engine's python with that prefix finds them: it imports both and writes no byte code of its own
    before = {p: p.stat().st_ino for p in prefix.rglob("*.pyc")}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPYCACHEPREFIX=str(prefix), PYTHONPATH=bare_runtime.pythonpath())
    proc = subprocess.run([str(bare_runtime.python), "-c", "import json, seedling; print(seedling.GROWN)"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "from the layer", proc.stderr
    after = {p: p.stat().st_ino for p in prefix.rglob("*.pyc")}
    assert after == before  # nothing compiled, nothing replaced

    # once per runtime
    assert seed_byte_code(bare_runtime) == 0


def test_a_stale_link_is_replaced_in_the_prefix_and_the_env_is_left_alone(bare_runtime):
    seed_byte_code(bare_runtime)
    source = bare_runtime.layers[0] / "seedling" / "__init__.py"
    in_tree = source.parent / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"
    original = in_tree.read_bytes()
    source.write_text("GROWN = 'changed since it was compiled'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPYCACHEPREFIX=str(paths.pycache_prefix()), PYTHONPATH=bare_runtime.pythonpath())
    proc = subprocess.run([str(bare_runtime.python), "-c", "import seedling; print(seedling.GROWN)"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "changed since it was compiled", proc.stderr
    assert in_tree.read_bytes() == original  # Python wrote a new file in the prefix, not through the link
    assert not os.path.samefile(_pyc(paths.pycache_prefix(), source), in_tree)


def test_a_byte_code_folder_it_cannot_write_is_left_alone(bare_runtime):
    """Engines then compile as they go, as before; nothing is raised (a file stands where the folder
    would be: unwritable for root too, whom a read-only mode does not stop)."""
    home = Path(os.environ["KVREPRO_HOME"])
    home.mkdir(parents=True)
    (home / "pycache").write_text("not a folder\n")
    assert seed_byte_code(bare_runtime) == 0
    assert (home / "pycache").read_text() == "not a folder\n"
