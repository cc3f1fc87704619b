"""Validation before anything starts: names are identifiers, paths stay inside their folder, bounds hold
(an alias bomb, a huge file, too many builds), engine flags are vLLM's (issue 8's faults, injected for
real: tests/reliability.py says how).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, planned_run
from reliability import TOKEN, kvrepro, one_clear_line, small_matrix


def test_duplicate_build_key_names_both_lines(tmp_path):
    matrix = tmp_path / "matrix.yaml"
    text = (ROOT / "matrix.yaml").read_text().replace("  D: [pr-52771, pr-52807]", "  D: [pr-52771, pr-52807]\n  B: []")
    matrix.write_text(text)
    os.symlink(ROOT / "builds", tmp_path / "builds")
    lines = text.splitlines()
    line = next(i for i, ln in enumerate(lines) if ln.startswith("  B: []")) + 1
    first = next(i for i, ln in enumerate(lines) if ln.startswith("  B: [pr-52807]")) + 1
    one_clear_line(kvrepro("matrix", "validate", "-m", str(matrix)), 2,
                   f"{matrix}:{line}: duplicate key 'B' (first at line {first})")


@pytest.mark.parametrize("change, needle", [
    ({"load": {"profile": "no_such_profile"}}, "load.profile: unknown profile 'no_such_profile'; known profiles:"),
    ({"target": "nonsense"}, "target: unknown target 'nonsense'; known targets: docker, ray, sim"),
    ({"engine": {"model": "no-such-model"}}, "engine.model: 'no-such-model' is neither a directory"),
], ids=["profile", "target", "model"])
def test_validate_catches_what_used_to_fail_late(tmp_path, change, needle):
    matrix = small_matrix(tmp_path)
    data = yaml.safe_load(matrix.read_text())
    for key, value in change.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    flat = one_clear_line(kvrepro("matrix", "validate", "-m", str(matrix)), 2, needle)
    assert f"{matrix}:" in flat  # file:line
    # `matrix run` says the same before it makes a run folder or starts anything
    one_clear_line(kvrepro("matrix", "run", "-m", str(matrix), "--results", str(tmp_path / "r")), 2, needle)
    assert not (tmp_path / "r").exists()


def test_plan_with_an_unknown_target():
    one_clear_line(kvrepro("matrix", "plan", "--target", "nonsense"), 2,
                   "--target: unknown target 'nonsense'; known targets: docker, ray, sim")


def test_engine_flag_checked_against_vllm_serve(tmp_path, runtime_python):
    """A flag `vllm serve` of the base release does not know, read from vLLM's own parser."""
    matrix = small_matrix(tmp_path)
    data = yaml.safe_load(matrix.read_text())
    data["engine"]["extra_args"] = ["--max_num_seqs", "4", "--no-such-serve-flag", "1", "--hf-token", TOKEN]
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    flat = one_clear_line(kvrepro("matrix", "validate", "-m", str(matrix)), 2,
                          "engine.extra_args: `vllm serve` of vLLM 0.26.0 does not know --no-such-serve-flag")
    assert "--max_num_seqs" not in flat and "--hf-token" not in flat and TOKEN not in flat
    data["engine"]["extra_args"] = ["--api-key", "x" * 12, "--enable-log-requests"]  # frontend flags are known
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    assert kvrepro("matrix", "validate", "-m", str(matrix)).returncode == 0


def test_patch_named_like_a_path_is_refused_at_load(tmp_path):
    """A patch key `../../../../ESCAPED` (bisect patches made folders of patch names): refused by
    validate, plan and bisect with file:line, and nothing is made anywhere."""
    matrix = small_matrix(tmp_path)
    text = matrix.read_text().replace("  pr-52807:\n", "  ../../../../ESCAPED:\n").replace(
        "[pr-52807]", "['../../../../ESCAPED']").replace("pr-52807]", "'../../../../ESCAPED']")
    matrix.write_text(text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "ESCAPED:" in ln)
    for args in (("matrix", "validate", "-m", str(matrix)), ("matrix", "plan", "-m", str(matrix)),
                 ("bisect", "patches", "-m", str(matrix), "--results", str(tmp_path / "r"))):
        one_clear_line(kvrepro(*args), 2, f"{matrix}:{line}:", "patch name '../../../../ESCAPED'", "letters, digits")
    assert not (tmp_path / "r").exists()
    assert not list(Path("/").glob("ESCAPED")) and not list(tmp_path.parent.glob("**/ESCAPED"))


def test_every_folder_of_a_run_stays_inside_it(tmp_path):
    """results.RunFolder refuses a build folder that resolves outside the run (whatever names
    reach it, e.g. a derived matrix that skipped validation)."""
    from kvrepro.results import store as results
    from kvrepro.errors import BadInputError

    with pytest.raises(BadInputError, match="would be outside"):
        results.create_run(tmp_path / "r", "builds: {}\n", planned_run(**{"build_order": ["../../x"]}))
    assert not (tmp_path / "x").exists() and not (tmp_path / "r").exists()  # refused before anything is made
    folder = results.create_run(tmp_path / "r", "builds: {}\n", planned_run(**{"build_order": ["A"]}))
    with pytest.raises(BadInputError):
        folder.rep_dir("../../../y", 0)
    assert not (tmp_path / "y").exists()
    assert folder.rep_dir("A", 0).is_dir()


def test_resume_of_a_bisection_outside_results_is_refused(tmp_path):
    """`bisect --resume ../elsewhere` would read and rewrite a bisect.json outside --results."""
    (tmp_path / "elsewhere").mkdir()
    state = tmp_path / "elsewhere" / "bisect.json"
    state.write_text("{}")
    (tmp_path / "r").mkdir()
    one_clear_line(kvrepro("bisect", "patches", "--resume", "../elsewhere", "--results", str(tmp_path / "r")), 2,
                   "would be outside", "--resume takes a bisection id under")
    assert state.read_text() == "{}" and list((tmp_path / "r").iterdir()) == []


@pytest.mark.parametrize("file, extra, needle", [
    ("/etc/passwd", {}, "'/etc/passwd' is outside the matrix's folder"),
    ("../../outside.patch", {}, "'../../outside.patch' is outside the matrix's folder"),
    ("", {}, "patches.pr-52807.file: is empty"),
    (".", {}, "is a folder, not a patch file"),
    ("pr-52807.patch", {"sha256": "0" * 64}, "all zeros is a placeholder, not a sha256"),
], ids=["absolute", "dotdot", "empty", "folder", "zero-sha"])
def test_patch_file_problems_are_named(tmp_path, file, extra, needle):
    matrix = small_matrix(tmp_path / "m")
    data = yaml.safe_load(matrix.read_text())
    data["patches"]["pr-52807"] = {"file": file, "upstream": "x", **extra}
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    flat = one_clear_line(kvrepro("matrix", "validate", "-m", str(matrix)), 2, needle)
    assert "does not exist" not in flat
    if "outside" in needle:
        assert "outside_matrix_folder: true" in flat
        data["patches"]["pr-52807"]["outside_matrix_folder"] = True  # the explicit opt-in: read, and said
        (tmp_path / "outside.patch").write_text("--- a/x\n+++ b/x\n")
        matrix.write_text(yaml.safe_dump(data, sort_keys=False))
        proc = kvrepro("matrix", "validate", "-m", str(matrix))
        assert proc.returncode == 0, proc.stderr
        assert "outside_matrix_folder" in " ".join(proc.stderr.split())


def bomb_text(levels: int = 9, width: int = 9) -> str:
    text = "a0: &a0 [" + ", ".join(["lol"] * width) + "]\n"
    for i in range(1, levels):
        text += f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]\n"
    return text + "builds: {A: []}\n"


def test_alias_bomb_refused_fast_with_bounded_memory(tmp_path):
    """9 levels x 9 aliases (9^9 values): refused before expanding, a few MB at most (expanded, the
    bomb takes hours and gigabytes: the 30 s bound tells the two apart on a loaded machine)."""
    import tracemalloc

    from kvrepro.errors import SpecError
    from kvrepro.spec.matrix import parse_matrix

    tracemalloc.start()
    started = time.monotonic()
    with pytest.raises(SpecError, match="aliases here expand to more than 100,000 values"):
        parse_matrix(bomb_text(), tmp_path / "matrix.yaml")
    elapsed = time.monotonic() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 30 and peak < 20 << 20, (elapsed, peak)
    (tmp_path / "matrix.yaml").write_text(bomb_text())
    one_clear_line(kvrepro("matrix", "validate", "-m", str(tmp_path / "matrix.yaml"), timeout=60), 2,
                   f"{tmp_path / 'matrix.yaml'}:", "aliases here expand to more than 100,000 values")
    (tmp_path / "cycle.yaml").write_text("x: &x [1, *x]\nbuilds: {A: []}\n")
    one_clear_line(kvrepro("matrix", "validate", "-m", str(tmp_path / "cycle.yaml"), timeout=60), 2,
                   "alias *x inside its own anchor")


@pytest.mark.parametrize("section, field, value, needle", [
    ("runs", "repetitions", 1_000_000_000, "runs.repetitions: Input should be less than or equal to 1000"),
    ("runs", "requests", 10**12, "runs.requests: Input should be less than or equal to 1000000"),
    ("runs", "duration_s", 1e9, "runs.duration_s: Input should be less than or equal to 86400"),
    ("runs", "stall_timeout_s", 1e9, "runs.stall_timeout_s: Input should be less than or equal to 3600"),
    ("engine", "extra_args", ["--enable-log-requests"] * 300, "engine.extra_args: List should have at most 256"),
], ids=["reps", "requests", "duration", "stall", "extra_args"])
def test_bounds_checked_by_validate(tmp_path, section, field, value, needle):
    """A billion repetitions passed validate and plan and died in `matrix run` with a
    MemoryError: now validate, plan and run refuse it before anything is made."""
    matrix = small_matrix(tmp_path)
    data = yaml.safe_load(matrix.read_text())
    data[section][field] = value
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    for command in ("validate", "plan", "run"):
        started = time.monotonic()
        one_clear_line(kvrepro("matrix", command, "-m", str(matrix), "--results", str(tmp_path / "r"))
                       if command == "run" else kvrepro("matrix", command, "-m", str(matrix)), 2,
                       f"{matrix}:", needle, "docs/reliability.md")
        assert time.monotonic() - started < 60
    assert not (tmp_path / "r").exists()


def test_too_many_builds_and_a_huge_file(tmp_path):
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text("builds:\n" + "".join(f"  b{i}: []\n" for i in range(300)))
    one_clear_line(kvrepro("matrix", "validate", "-m", str(matrix)), 2, "builds: Dictionary should have at most 256")
    matrix.write_text("# " + "x" * (2 << 20) + "\nbuilds: {A: []}\n")
    one_clear_line(kvrepro("matrix", "validate", "-m", str(matrix)), 2, "bytes; a matrix is at most 1,048,576")


def test_reps_and_adaptive_bounded_and_exclusive(tmp_path):
    one_clear_line(kvrepro("matrix", "run", "--reps", "1000000000", "--results", str(tmp_path / "r")), 2)
    one_clear_line(kvrepro("matrix", "run", "--adaptive", "1", "--reps", "2", "--results", str(tmp_path / "r")), 2,
                   "--adaptive 1 and --reps 2: give one")
    assert not (tmp_path / "r").exists()


def test_run_materialises_nothing_per_repetition(tmp_path, monkeypatch):
    """The runner walks (build, repetition) pairs lazily with at most `jobs` in flight: a huge
    repetition count costs nothing before the repetitions run (a stop after two ends it)."""
    import threading

    from kvrepro.matrix import runner
    from kvrepro.builds.records import BuildArtifact, BuildManifest
    from kvrepro.spec.matrix import load_matrix

    loaded = load_matrix(small_matrix(tmp_path))
    started: list[tuple[str, int]] = []
    stop = threading.Event()

    class FakeTarget:
        name = "sim"
        on_line = None
        runs_remotely = False  # the Target contract's: this one starts its engines itself
        starts_during_stop = False  # ... and keeps a run's slot until its engine is stopped

        def __init__(self, loaded):
            pass

        def max_parallel(self):
            return 2

        def prepare(self, plan):
            return BuildArtifact(plan=plan, ref=None, manifest=BuildManifest(), error="not built in this test")

        def interrupt(self):
            pass

        def warm_up(self, artifacts):
            pass

        def close(self):
            pass

    def fake_run_one(loaded, target, artifact, run_dir, rep, progress, stop_event, replay=None, stop_rule=None,
                     on_load_done=None):
        started.append((artifact.plan.name, rep))
        if len(started) >= 6:
            stop.set()
        return runner._infra_result(artifact.plan, rep, run_dir, "fake")

    monkeypatch.setattr(runner, "get_target", lambda name: FakeTarget)
    monkeypatch.setattr(runner, "run_one", fake_run_one)
    import tracemalloc

    tracemalloc.start()
    options = runner.MatrixOptions(builds=["A", "B"], repetitions=10**9, results_root=tmp_path / "r", jobs=2)
    run = runner.run_matrix(loaded, options, stop=stop)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert 6 <= len(started) <= 8 and peak < 50 << 20, (len(started), peak)
    assert run.status == "interrupted"
