"""Release day (kvrepro/release/): a release newer than the table runs unported or is stopped with the
one porting step it needs named; the static reading and the log diagnosis behind it; the release
check's change report and exit codes.

The planted releases are vLLM 0.34.0's own wheel given a later version number (and, for one, a renamed
worker RPC), served by a real package index on loopback (tests/planted_release.py): no network here
to ask PyPI, and no later vLLM exists yet. Fake only what no machine here has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT, require

from kvrepro import versions
from kvrepro.release import changes, porting


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def _mini_tree(root: Path, *, rpc: str, raise_text: str | None, limit_name: str) -> Path:
    """A vllm/ tree with just the files the static reading walks (EngineCore, the executor base,
    the CPU platform, the offloading scheduler's crash statement)."""
    _write(root, "vllm/v1/engine/core.py", f"""
        class EngineCore:
            def _initialize_kv_caches(self):
                self.collective_rpc("update_max_model_len")
                layouts = self.collective_rpc({rpc!r})
    """)
    _write(root, "vllm/v1/executor/abstract.py", """
        from abc import abstractmethod

        class Executor:
            @abstractmethod
            def collective_rpc(self, method): ...

            @abstractmethod
            def execute_model(self, scheduler_output): ...
    """)
    check = f"        if x86 and not triton:\n            raise {raise_text}\n" if raise_text else ""
    _write(root, "vllm/platforms/cpu.py",
           "class CpuPlatform:\n    @classmethod\n    def check_and_update_config(cls, vllm_config):\n"
           "        x86 = triton = True\n" + check + "        if vllm_config is None:\n"
           "            raise ValueError('no config')\n")
    _write(root, "vllm/platforms/interface.py", """
        class Platform:
            @classmethod
            def _find_non_ssm_backends(cls, vllm_config):
                return []
    """)
    _write(root, "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", f"""
        class OffloadingConnectorScheduler:
            def update_state_after_alloc(self, request, blocks, num_external_tokens):
                assert num_locally_computed_tokens <= {limit_name} * tokens_per_block
    """)
    return root


def test_the_static_reading_names_each_step_with_the_vllm_file_and_line(tmp_path):
    """A new worker RPC the table does not answer, a new raise in the CPU platform's config check and a
    crash statement whose identifiers were renamed are each named by their porting step and the
    file:line of the release; the release it is compared with has none of them."""
    before = _mini_tree(tmp_path / "before", rpc="get_supported_kv_cache_layouts", raise_text=None,
                        limit_name="num_locally_computed_gpu_blocks")
    after = _mini_tree(tmp_path / "after", rpc="get_kv_cache_layouts_v2",
                       raise_text="RuntimeError('vLLM on x86 CPUs requires Triton (triton-cpu).')",
                       limit_name="num_local_gpu_blocks")
    reading = porting.read_release("0.35.0", after, "0.34.0", before)
    by_step = {f.step: f for f in reading.findings}
    rpc = by_step[porting.WORKER_RPC]
    assert "'get_kv_cache_layouts_v2'" in rpc.what and rpc.where == "vllm/v1/engine/core.py:5"
    assert "Release('0.35.0').rpc_answers" in rpc.fix and not rpc.reached
    platform = by_step[porting.PLATFORM_CHECK]
    assert platform.where == "vllm/platforms/cpu.py:6" and "requires Triton" in platform.what
    renamed = by_step[porting.RENAMED_IDENTIFIER]
    assert renamed.where.endswith("offloading/scheduler.py:4")
    assert "'num_local_gpu_blocks': 'num_locally_computed_gpu_blocks'" in renamed.fix
    assert "IDENTIFIER_ALIASES" in renamed.fix
    assert reading.signatures["offload_update_state_after_alloc"] == "renamed"
    # the sim executor defines every abstract method of this base: no executor-interface finding for it
    assert not [f for f in reading.findings if "Executor." in f.what]
    # kvrepro's platform overrides _find_non_ssm_backend; this vLLM (as 0.31.0+) calls _find_non_ssm_backends
    (stale,) = [f for f in reading.findings if "overrides nothing" in f.what]
    assert stale.step == porting.EXECUTOR_INTERFACE and "SimCpuPlatform._find_non_ssm_backend" in stale.what
    assert stale.where == "vllm/platforms/interface.py:4" and "_find_non_ssm_backends" in stale.fix
    # compared with itself, nothing new: the raise and the RPC are the earlier release's too
    same = porting.read_release("0.35.0", before, "0.34.0", before)
    assert not same.by_step(porting.WORKER_RPC) and not same.by_step(porting.PLATFORM_CHECK)
    assert same.signatures["offload_update_state_after_alloc"].endswith("offloading/scheduler.py:4")


def _logged(lines: list[str]) -> str:
    """Lines as vLLM's EngineCore logs a fatal error (the format the classifier reads)."""
    head = "(EngineCore pid=7) ERROR 12-04 18:00:00 [core.py:1759] "
    return "\n".join([head + "EngineCore failed to start."] + [head + line for line in lines]) + "\n"


def test_an_engine_log_is_reduced_to_the_porting_step_it_needs():
    """What stopped a run is named from its traceback: an unanswered RPC (with the vLLM frame that asked
    it), a raise inside vllm/platforms/, an import of ours that the release broke; a crash of vLLM's
    own code under test is not a porting step."""
    overlay = "/cache/overlays/abc/vllm"
    ours = "/work/kvrepro/kvrepro/engine/executor.py"
    rpc = _logged(["Traceback (most recent call last):",
                   f'  File "{overlay}/v1/engine/core.py", line 316, in _initialize_kv_caches',
                   f'  File "{overlay}/v1/executor/abstract.py", line 218, in get_supported_kv_cache_layouts',
                   f'  File "{ours}", line 640, in collective_rpc',
                   "NotImplementedError: collective_rpc('get_kv_cache_layouts_supported'): the sim executor has "
                   "no answer for vLLM 0.35.1; add one to kvrepro/versions.py (porting checklist, step 3)"])
    found = porting.diagnose(rpc, versions.settings_for("0.35.1"))
    assert found.step == porting.WORKER_RPC and found.where == "vllm/v1/executor/abstract.py:218"
    assert "'get_kv_cache_layouts_supported'" in found.what and "Release('0.35.1')" in found.fix and found.reached
    platform = _logged(["Traceback (most recent call last):",
                        f'  File "{overlay}/config/vllm.py", line 900, in __post_init__',
                        f'  File "{ours.replace("executor", "platform")}", line 52, in check_and_update_config',
                        f'  File "{overlay}/platforms/cpu.py", line 243, in check_and_update_config',
                        "RuntimeError: vLLM on x86 CPUs requires Triton (triton-cpu)."])
    found = porting.diagnose(platform)
    assert found.step == porting.PLATFORM_CHECK and found.where == "vllm/platforms/cpu.py:243"
    moved = _logged(["Traceback (most recent call last):",
                     f'  File "{overlay}/v1/engine/core.py", line 500, in step',
                     f'  File "{ours}", line 231, in execute_model',
                     "ModuleNotFoundError: No module named 'vllm.v1.worker.kv_connector_model_runner_mixin'"])
    found = porting.diagnose(moved)
    assert found.step == porting.EXECUTOR_INTERFACE and "kvrepro/engine/executor.py:231" in found.what
    crash = _logged(["Traceback (most recent call last):",
                     f'  File "{overlay}/v1/core/sched/scheduler.py", line 1400, in schedule',
                     f'  File "{overlay}/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", '
                     "line 815, in update_state_after_alloc",
                     "AssertionError"])
    assert porting.diagnose(crash) is None


def test_a_release_check_reports_what_changed_and_exits_by_it(tmp_path):
    """The change report of a release check: entries newly fixed or present between the two releases,
    rows that differ from the catalogue, tests that changed outcome; JUnit carries each as a testcase,
    and the exit code says whether a person is needed (1), a stage could not run (3), or neither (0)."""
    from kvrepro.release.check import ReleaseCheck, exit_code

    check = ReleaseCheck("0.34.0", "0.33.0", False, tmp_path, 0.0)
    rows = [
        {"entry": "recompute-failed-load-stall", "build": "0.33.0", "state": "PRESENT", "expected": "present",
         "matches": True, "detail": "stall", "run_dirs": []},
        {"entry": "recompute-failed-load-stall", "build": "0.34.0", "state": "ABSENT", "expected": "fixed",
         "matches": True, "detail": "path ran: injected_load_faults 41", "run_dirs": []},
        {"entry": "offload-boundary-assert", "build": "0.33.0", "state": "ABSENT", "expected": "fixed",
         "matches": True, "detail": "path ran", "run_dirs": []},
        {"entry": "offload-boundary-assert", "build": "0.34.0", "state": "ABSENT", "expected": "fixed",
         "matches": True, "detail": "path ran", "run_dirs": []},
    ]
    for name in check.stages:
        check.stages[name].status = "ok"
    check.stages["suite"].detail["rows"] = rows
    check.stages["tests"].detail.update(runs={"0.33.0": {}, "0.34.0": {}}, added=3, removed=1, changed=[
        {"nodeid": "tests/v1/core/test_x.py::test_y", "before": "passed", "after": "skipped", "message": ""}])
    check.changes = changes.collect(check)
    (moved,) = check.changes.changed_entries
    assert (moved.entry, moved.before, moved.after, moved.what) == ("recompute-failed-load-stall", "PRESENT",
                                                                     "ABSENT", "newly fixed")
    assert moved.kind == "stall" and not check.changes.differ
    report = changes.markdown(check)
    assert "| `recompute-failed-load-stall` | stall | PRESENT | ABSENT | newly fixed | fixed |" in report
    assert "`tests/v1/core/test_x.py::test_y`: passed -> skipped" in report and "3 new in 0.34.0" in report
    assert exit_code(check) == 0
    # a release test that passed and now fails is a regression; a fix's upstream test from an older
    # release, or a test that needs a model config this machine lacks, is reported, not counted
    for nodeid, message, counted in (
            ("tests/v1/core/test_x.py::test_z", "AssertionError: assert 3 == 4", True),
            ("vllm 0.30.0 tests/v1/kv_connector/unit/test_a.py::test_b", "TypeError: MagicMock", False),
            ("tests/v1/core/test_x.py::test_w", "ValidationError: Invalid repository ID or local directory", False)):
        assert changes.TestChange(nodeid, "passed", "failed", message).regression is counted
    junit = changes.junit_xml(check)
    assert 'name="recompute-failed-load-stall on 0.34.0"' in junit and "<failure" not in junit
    # a row that differs from the catalogue, or a test that passed and now fails: a person is needed
    rows[3].update(state="PRESENT", matches=False)
    check.stages["suite"].status = "found"
    check.changes = changes.collect(check)
    assert exit_code(check) == 1 and "expected fixed, got PRESENT" in changes.junit_xml(check)
    assert [e.what for e in check.changes.changed_entries] == ["newly fixed", "newly present"]
    check.stages["suite"].status = "ok"
    check.stages["fetch"].status = "failed"
    assert exit_code(check) == 3
    check.status = "interrupted"
    assert exit_code(check) == 130


def test_release_commands_refuse_bad_input_in_one_line(tmp_path):
    """An older gap, another major version or a bad budget is exit 2 and one line, before any download."""
    env = {**os.environ, "KVREPRO_HOME": str(tmp_path / "home")}
    for args, expected in ((["port", "1.0.0"], "or an unported release newer than 0.34.0"),
                           (["check", "0.34.0", "--budget", "often"], "--budget often"),
                           (["check", "0.25.1"], "no previous one to compare with")):
        proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "release", *args], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=120)
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith("error: ") and expected in line, line
    assert not (tmp_path / "home").exists()


def _planted_home(home: Path, real: Path) -> None:
    """A kvrepro home of its own (a planted wheel must never enter the shared cache), sharing the
    runtime envs, byte code and 0.34.0's wheel and tree with the real one (read, not written)."""
    (home / "wheels").mkdir(parents=True)
    (home / "overlays" / "pristine").mkdir(parents=True)
    for name in ("runtimes", "pycache"):
        (home / name).symlink_to(real / name)
    (home / "wheels" / "0.34.0").symlink_to(real / "wheels" / "0.34.0")
    for tree in (real / "overlays" / "pristine").glob("0.34.0-*"):
        (home / "overlays" / "pristine" / tree.name).symlink_to(tree)


def test_a_planted_next_release_runs_unported_or_names_the_rpc_it_needs(runtime_python, tmp_path):
    """0.34.0's wheel as vLLM 0.35.0 on a loopback package index: `kvrepro release port 0.35.0` fetches it
    through pip from that index, runs it with 0.34.0's settings, marks it unported and says it needs no
    code change (exit 0). The same wheel as 0.35.1 with one worker RPC renamed in vLLM's executor base
    (`get_supported_kv_cache_layouts`, asked at start-up): the run stops before health, and the command
    names the one step, a new worker RPC, with the vLLM file:line that asks it (exit 1)."""
    from kvrepro import paths
    from kvrepro.builds.wheel import cached_wheel, fetch_wheel
    from planted_release import PlantedIndex, plant_wheel

    source = cached_wheel("0.34.0") or fetch_wheel("0.34.0")
    require(source is not None, "vLLM 0.34.0's wheel (kvrepro downloads it from the package index)")
    real = paths.home()
    plants = tmp_path / "plants"
    files = [plant_wheel(source, "0.35.0", plants),
             plant_wheel(source, "0.35.1", plants, {"vllm/v1/executor/abstract.py": (
                 '"get_supported_kv_cache_layouts"', '"get_kv_cache_layouts_supported"')})]
    home = tmp_path / "home"
    _planted_home(home, real)
    index = PlantedIndex(files)
    env = {**os.environ, "KVREPRO_HOME": str(home), "KVREPRO_INDEX_URL": index.url}
    try:
        outcomes = {}
        for release in ("0.35.0", "0.35.1"):
            proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "release", "port", release, "--ci", "--json",
                                   "--requests", "10", "--results", str(tmp_path / "results")],
                                  capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
            outcomes[release] = (proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else None, proc.stderr)
    finally:
        index.close()
    code, ported, stderr = outcomes["0.35.0"]
    assert code == 0, stderr[-3000:]
    assert ported["unported"] and ported["settings_from"] == "0.34.0" and ported["ported"]
    # 0.34.0's own code in the GPU's mode (async scheduling): clean, not a crash of kvrepro's executor
    assert ported["verdict"] in ("SURVIVED", "UNREACHED") and ported["needs"] is None, ported["verdict"]
    assert ported["table_entry"].startswith('Release("0.35.0"')
    assert any(p.startswith("/simple/vllm") for p in index.requests)  # pip read the planted index
    assert not (real / "wheels" / "0.35.0").exists()  # the shared cache never saw a planted wheel
    code, stopped, stderr = outcomes["0.35.1"]
    assert code == 1, stderr[-3000:]
    assert stopped["verdict"] == "INFRA" and stopped["unported"]
    assert stopped["needs"]["step"] == porting.WORKER_RPC and stopped["needs"]["reached"]
    assert stopped["needs"]["where"] == "vllm/v1/executor/abstract.py:218"
    assert "'get_kv_cache_layouts_supported'" in stopped["needs"]["what"]
    # the static reading saw it too, before the run
    assert any("get_kv_cache_layouts_supported" in f["what"] for f in stopped["read"])


def test_every_catalogue_entry_has_a_newest_release_cell_that_agrees_with_its_reading():
    """Every entry of defects/ says what the newest release does (a `# 0.34.0 (state; ...)` comment with
    the file:line it was read at), and its present_in / fixed_in give that state: `present` and `fixed`
    as written, `no claim` where the ranges make none (an unported release inherits none of these)."""
    import re

    from kvrepro.suite.catalogue import expected_state
    from kvrepro.suite.run import load as load_catalogue

    newest = versions.newest()
    for entry in load_catalogue(None).entries:
        text = entry.file.read_text()
        cell = re.search(rf"^# {re.escape(newest)} \((?P<state>[^;]+);", text, re.M)
        assert cell, f"{entry.file.name}: no `# {newest} (state; ...)` comment"
        said = cell["state"].split(" (")[0].split(",")[0].strip()
        expected = expected_state(entry, newest)
        if said.startswith("no claim"):
            assert expected is None, (entry.name, expected)
            continue
        assert said == expected, (entry.name, said, expected)
        assert re.search(r":\d+", text[cell.start():cell.start() + 900]), f"{entry.name}: no file:line"


def test_a_signature_whose_statement_is_not_an_assert_is_found_or_renamed(tmp_path):
    """A KeyError's signature names the statement that raised (an assignment, not an assert's
    condition): the port check finds it in the release's function, follows a rename of one of its
    identifiers, and says absent when the function no longer has it (vllm#49635's statement)."""
    from kvrepro.classify.patterns import Pattern

    pattern = Pattern(name="t", exception="KeyError", function="prepare_store", file="m.py",
                      expressions=("state = self._req_state[req_context.req_id]",), why="test")
    src = tmp_path / "m.py"
    for body, want in (("state = self._req_state[req_context.req_id]", ("found", 3, {})),
                       ("state = self._req_state[ctx.req_id]", ("renamed", 3, {"ctx": "req_context"})),
                       ("state = None", ("absent", None, {}))):
        src.write_text(f"class C:\n    def prepare_store(self, req_context):\n        {body}\n")
        got = porting.signature_statement(tmp_path, pattern)
        assert got == want, (body, got)
