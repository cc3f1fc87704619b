"""`kvrepro builds test`: vLLM's own tests on every build (kvrepro/builds/upstream_tests.py).

The unit tests build small later/base ``tests/`` trees by hand (our own code, not vLLM's) to check
what is copied from a later release and what is listed. The end-to-end test runs a handful of
vLLM 0.26.0's real tests, from the real sdist, on two real builds with vLLM's CPU platform: the
release itself as A and a stack with pr-52807 and a fixture patch that breaks one upstream test,
which the report must name as the cause. Nothing is faked there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from kvrepro.builds import upstream_copy
from kvrepro.builds.patching import read_header
from kvrepro.errors import SpecError


def _write(root: Path, rel: str, text: str) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)


LATER_HELPERS = '''
def shared(x):
    return x + 1


def made_later():
    return 2
'''
LATER_TEST = '''
import pytest
from tests.unit.helpers import shared, made_later

LIMIT = 3


def _local(n):
    return min(n, LIMIT)


@pytest.mark.parametrize("n", [1, 2])
def test_new(n):
    assert _local(shared(n)) == made_later()


def test_unrelated():
    assert False
'''


def _trees(tmp_path: Path) -> tuple[Path, Path]:
    later, base = tmp_path / "later", tmp_path / "base"
    _write(later, "tests/unit/helpers.py", LATER_HELPERS)
    _write(later, "tests/unit/test_x.py", LATER_TEST)
    _write(base, "tests/unit/helpers.py", "\ndef shared(x):\n    return x + 1\n")
    _write(base, "tests/unit/test_x.py", "def test_old():\n    assert True\n")
    return later, base


def test_a_later_test_is_copied_with_its_helpers_listed_and_identical_ones_imported(tmp_path):
    later, base = _trees(tmp_path)
    module = upstream_copy.generate(later, "0.30.0", base, "0.26.0", ["tests/unit/test_x.py::test_new"],
                                    "test_kvrepro_p")
    assert module.rel == "tests/unit/test_kvrepro_p.py"
    assert module.tests == ("tests/unit/test_kvrepro_p.py::test_new",)
    # identical in the base's helper module: imported from there, not copied
    assert "from tests.unit.helpers import shared" in module.text
    # not in the base: copied and listed; a helper of the test file itself likewise
    listed = {(h.name, h.file, h.why) for h in module.helpers}
    assert ("made_later", "tests/unit/helpers.py", "not in vllm 0.26.0's tests/") in listed
    assert ("_local", "tests/unit/test_x.py", "not in vllm 0.26.0's tests/") in listed
    assert ("LIMIT", "tests/unit/test_x.py", "not in vllm 0.26.0's tests/") in listed
    assert "test_unrelated" not in module.text and "import pytest" in module.text
    assert module.problems == ()
    # the module runs as written: the parametrized test passes for n=1 and fails for n=2 (our fixture)
    _write(base, module.rel, module.text)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module.rel],
                          cwd=base, capture_output=True, text=True)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout


def test_a_helper_that_differs_in_the_base_is_copied_and_says_so(tmp_path):
    later, base = _trees(tmp_path)
    _write(base, "tests/unit/helpers.py", "\ndef shared(x):\n    return x\n")
    module = upstream_copy.generate(later, "0.30.0", base, "0.26.0", ["tests/unit/test_x.py::test_new"], "test_k")
    assert ("shared", "differs from vllm 0.26.0's") in {(h.name, h.why) for h in module.helpers}


def test_a_test_the_later_release_does_not_have_is_a_listed_problem(tmp_path):
    later, base = _trees(tmp_path)
    module = upstream_copy.generate(later, "0.30.0", base, "0.26.0", ["tests/unit/test_x.py::test_gone"], "test_k")
    assert module.tests == ()
    assert module.problems == ("tests/unit/test_x.py::test_gone: not in vllm 0.30.0's tests/unit/test_x.py",)


def test_later_change_shows_the_lines_a_newer_release_changed(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    _write(old, "tests/t.py", "def test_v():\n    x = 1\n    assert x == 3\n")
    _write(new, "tests/t.py", "def test_v():\n    x = 1\n    assert x == 4\n")
    assert upstream_copy.later_change(old, new, "tests/t.py::test_v[a]") == ["-    assert x == 3", "+    assert x == 4"]
    assert upstream_copy.later_change(old, old, "tests/t.py::test_v") == []
    assert upstream_copy.later_change(old, new, "tests/t.py::test_missing") is None
    # a method of a test class: only the method is compared
    _write(old, "tests/c.py", "class TestK:\n    def test_a(self):\n        assert 1\n\n    def test_b(self):\n        assert 2\n")
    _write(new, "tests/c.py", "class TestK:\n    def test_a(self):\n        assert 1\n\n    def test_b(self):\n        assert 3\n")
    assert upstream_copy.later_change(old, new, "tests/c.py::TestK::test_a") == []
    assert upstream_copy.later_change(old, new, "tests/c.py::TestK::test_b") == ["-        assert 2", "+        assert 3"]


def test_the_patch_header_names_upstream_tests_and_a_bad_line_names_file_and_line(tmp_path):
    tests = read_header(ROOT / "builds" / "pr-52807.patch").upstream_tests
    assert [(t.release, t.nodeid.rsplit("::", 1)[1]) for t in tests] == [
        ("0.30.0", "test_recurrent_group_unhashed_block_does_not_truncate_load_boundary")]
    bad = tmp_path / "bad.patch"
    bad.write_text("# Upstream: https://x\n# Title: t\n# Upstream-Test: 0.30.0 test_x\n#\n--- a/v\n+++ b/v\n@@ -1 +1 @@\n-a\n+b\n")
    with pytest.raises(SpecError, match=r"bad.patch:3: Upstream-Test must read"):
        read_header(bad)


def test_the_plugin_selects_ids_their_parametrizations_and_what_a_file_or_class_holds():
    from kvrepro.builds.upstream_pytest_plugin import _selected

    wanted = {"tests/a.py::test_x", "tests/b.py", "tests/c.py::TestK"}
    assert _selected("tests/a.py::test_x", wanted) and _selected("tests/a.py::test_x[1-2]", wanted)
    assert _selected("tests/b.py::test_any", wanted) and _selected("tests/c.py::TestK::test_m[p]", wanted)
    assert not _selected("tests/a.py::test_xy", wanted) and not _selected("tests/c.py::TestKK::test_m", wanted)


def test_an_only_that_names_no_test_file_is_bad_input_exit_2(tmp_path, runtime_python):
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "builds", "test", "--build", "A",
                           "--only", "tests/v1/core/test_nothing_here.py", "--results", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--only tests/v1/core/test_nothing_here.py: vLLM 0.26.0's sdist has no" in proc.stderr
    assert "Traceback" not in proc.stderr


RELEASE_MODULE = '''import os

LIMIT = 3


class Pool:
    def take(self, n):
        if n > LIMIT:
            return None
        return n

    def give(self, n):
        return n + 1


def helper():
    return 1
'''


def test_the_impact_rule_sees_a_function_body_edit_as_that_function_and_a_new_method_as_module_level(tmp_path):
    """Our own two-version module (not vLLM's): what kvrepro/builds/upstream_impact.py calls changed."""
    from kvrepro.builds.upstream_impact import changed_code

    release, build = tmp_path / "release", tmp_path / "build"
    _write(release, "vllm/m.py", RELEASE_MODULE)
    body_edit = RELEASE_MODULE.replace("        return n + 1", "        n += 2\n        return n + 1")
    _write(build, "vllm/m.py", body_edit)
    units = changed_code(release, build, ["vllm/m.py"])
    assert [(u.scope, u.name, u.lines) for u in units] == [("function", "Pool.give", (13, 13))]
    # a new method, a changed constant, a changed signature: module level
    for edited in (RELEASE_MODULE.replace("    def give(self, n):", "    def peek(self):\n        return 0\n\n"
                                          "    def give(self, n):"),
                   RELEASE_MODULE.replace("LIMIT = 3", "LIMIT = 4"),
                   RELEASE_MODULE.replace("def helper():", "def helper(x=0):")):
        _write(build, "vllm/m.py", edited)
        assert [u.scope for u in changed_code(release, build, ["vllm/m.py"])] == ["module"], edited
    # an edit at the end of a body is still inside the function; an unchanged file is no unit
    _write(build, "vllm/m.py", RELEASE_MODULE.replace("        return n\n", "        return n\n        print(n)\n"))
    assert [(u.scope, u.name) for u in changed_code(release, build, ["vllm/m.py"])] == [("function", "Pool.take")]
    _write(build, "vllm/m.py", RELEASE_MODULE)
    _write(build, "vllm/data.json", "{}")
    assert [u.scope for u in changed_code(release, build, ["vllm/m.py", "vllm/data.json"])] == ["other"]


def test_the_impact_rule_reads_coverage_numbits_as_line_numbers():
    from kvrepro.builds.upstream_impact import _nums

    assert _nums(bytes([0b00000101, 0, 0b10000000])) == [0, 2, 23]


# --------------------------------------------------------------------------- end to end (vLLM env)

DYING_TESTS = '''import os
import signal


def test_before():
    assert True


def test_dies():
    os.kill(os.getpid(), signal.SIGKILL)


def test_after():
    assert True
'''


def test_a_pytest_that_dies_part_way_is_resumed_and_the_test_it_died_in_is_an_error(tmp_path, runtime_python):
    """A real pytest in the real runtime env (vLLM's CPU platform, the plugin) is killed by a test
    of ours (SIGKILL, as the OOM killer or a crash in C would): the job resumes in a new process,
    runs the tests after it, and records the one it died in as an error, not lost and not re-run."""
    from kvrepro.builds import prepare_runtime, upstream_tests
    from kvrepro.builds.upstream_tests import TestTree, TreeRun

    runtime = prepare_runtime("0.26.0")
    base = upstream_tests.source_tests("0.26.0")
    runtime = upstream_tests.test_runtime(runtime, base)
    root, key = upstream_tests._pristine_root("0.26.0", None)
    tree_root = tmp_path / "tree"
    _write(tree_root, "tests/test_dying.py", DYING_TESTS)
    shutil.copy(upstream_tests.PLUGIN_SOURCE, tree_root / f"{upstream_tests.PLUGIN_NAME}.py")
    tree = TestTree(tree_root, "dying", (), {}, {})
    found = upstream_tests._run_pytest(runtime, tree, TreeRun("dying", root, key, None, ("tests/test_dying.py",)),
                                       tmp_path / "work")
    outcomes = {nodeid.rsplit("::", 1)[1]: o.outcome for nodeid, o in found.items()}
    assert outcomes == {"test_before": "passed", "test_dies": "error", "test_after": "passed"}
    assert "pytest exited -9" in found["tests/test_dying.py::test_dies"].message

def test_what_a_job_learns_about_model_classes_is_shared_with_the_releases_later_jobs_and_engines(tmp_path,
                                                                                                  monkeypatch):
    """vLLM inspects a model class in a fresh interpreter (~8 CPU s) unless its VLLM_CACHE_ROOT holds the
    answer: each job starts from, and adds to, its release's folder, the one the sim's engines use."""
    from kvrepro import paths
    from kvrepro.builds import upstream_tests
    from kvrepro.deploy.sim import vllm_cache_root
    from kvrepro.spec.records import BuildPlan

    monkeypatch.setenv("KVREPRO_HOME", str(tmp_path / "home"))
    tree = tmp_path / "overlay"
    (tree / "vllm-0.26.0.dist-info").mkdir(parents=True)
    shared = upstream_tests.shared_modelinfos(tree)
    assert shared == vllm_cache_root(BuildPlan(name="A", base="0.26.0", patches=())) / "modelinfos" == paths.vllm_cache("0.26.0") / "modelinfos"
    assert upstream_tests.shared_modelinfos(tmp_path / "no-dist-info") is None
    learnt = tmp_path / "work" / "vllm-cache" / "modelinfos"
    learnt.mkdir(parents=True)
    (learnt / "vllm-model_executor-models-qwen3_next-Qwen3NextForCausalLM.json").write_text('{"hash": "1"}')
    upstream_tests.publish_modelinfos(learnt, shared)
    (learnt / "vllm-model_executor-models-qwen3_next-Qwen3NextForCausalLM.json").write_text('{"hash": "2"}')
    upstream_tests.publish_modelinfos(learnt, shared)  # a newer answer replaces the file whole
    assert [(p.name, p.read_text()) for p in shared.iterdir()] == [
        ("vllm-model_executor-models-qwen3_next-Qwen3NextForCausalLM.json", '{"hash": "2"}')]
    upstream_tests.publish_modelinfos(tmp_path / "nothing-learnt", shared)  # a job that learnt nothing
    assert len(list(shared.iterdir())) == 1


# a handful of 0.26.0's own tests: the one the fixture patch breaks and three it must not touch
HANDFUL = [
    "tests/v1/core/test_kv_cache_utils.py::test_hash_block_tokens",
    "tests/v1/core/test_kv_cache_utils.py::test_free_kv_cache_block_queue_initialization",
    "tests/v1/core/test_kv_cache_utils.py::test_generate_block_hash_extra_keys",
]
BROKEN = HANDFUL[0]


def _fixture_matrix(tmp_path: Path) -> Path:
    """matrix.yaml with two builds: A (common: pr-49146 only) and F (+ pr-52807 + the fixture)."""
    (tmp_path / "builds").mkdir()
    for name in ("pr-49146", "pr-52807"):
        shutil.copy(ROOT / "builds" / f"{name}.patch", tmp_path / "builds")
    shutil.copy(ROOT / "tests" / "data" / "patches" / "fixture-break-block-hash.patch", tmp_path / "builds")
    text = (ROOT / "matrix.yaml").read_text()
    head, _, rest = text.partition("\npatches:\n")
    tail = rest.split("\ntarget_signature:", 1)[1].split("\nexpect:", 1)[0]
    patches = "".join(f"  {name}:\n    file: {name}.patch\n    upstream: {url}\n" for name, url in (
        ("pr-49146", "https://github.com/vllm-project/vllm/pull/49146"),
        ("pr-52807", "https://github.com/vllm-project/vllm/pull/52807"),
        ("fixture-break-block-hash", "https://example.invalid/kvrepro-fixture")))
    path = tmp_path / "matrix.yaml"
    path.write_text(head + "\npatches:\n" + patches + "\ncommon: [pr-49146]\n\nbuilds:\n  A: []\n"
                    "  F: [pr-52807, fixture-break-block-hash]\n\ntarget_signature:" + tail + "\n")
    return path


def test_builds_test_runs_upstream_tests_and_names_the_patch_that_broke_one(tmp_path, runtime_python):
    """vLLM 0.26.0's real tests on two real builds; the fixture patch (tests/data/patches) changes
    vLLM's block hashing, so test_hash_block_tokens must fail on F and the report must name it."""
    matrix = _fixture_matrix(tmp_path)
    cmd = [sys.executable, "-m", "kvrepro.cli", "builds", "test", "--matrix", str(matrix), "--json",
           "--results", str(tmp_path / "results"), "--later", "0.27.0", *[arg for t in HANDFUL for arg in ("--only", t)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]  # a test that passes on the release fails on F
    run = json.loads(proc.stdout)
    builds = {b["build"]: b for b in run["builds"]}
    assert builds["A"]["patches"] == ["pr-49146"]
    assert builds["F"]["patches"] == ["pr-49146", "pr-52807", "fixture-break-block-hash"]
    changes = {c["nodeid"]: c for c in builds["F"]["changes"]}
    broken = changes[BROKEN + "[sha256]"]  # parametrized upstream: [sha256] and [sha256_cbor]
    assert (broken["release_outcome"], broken["build_outcome"]) == ("passed", "failed")
    assert (broken["changed_by"], broken["stack_position"]) == ("fixture-break-block-hash", 3)
    assert "assert" in broken["message"].lower()
    regression = [c for nodeid, c in changes.items() if "does_not_truncate_load_boundary" in nodeid]
    assert [(c["release_outcome"], c["build_outcome"], c["changed_by"]) for c in regression] == [
        ("failed", "passed", "pr-52807")]
    # the release's own run shows the target assertion for PR 52807's test
    target = next(o for o in run["release"]["outcomes"] if o["patch"] == "pr-52807")
    assert target["outcome"] == "failed" and "num_locally_computed_tokens" in target["line"]
    # on A only 52807's test fails; on F only the two parametrizations of the broken test
    assert builds["A"]["failed"] == 1 and builds["F"]["failed"] == 2
    assert changes[BROKEN + "[sha256]"]["later"] == "unchanged in vllm 0.27.0"
    # the impact rule: A's stack changes only the offloading connector, which none of HANDFUL runs,
    # so A runs the patches' tests alone; F's fixture changes block hashing, which test_hash_block_tokens runs
    patch_items = [o for o in builds["A"]["outcomes"] if o["patch"]]
    assert run["impact_rule"] and builds["A"]["ran"] == len(patch_items)
    assert all(o["not_run"] for o in builds["A"]["outcomes"] if not o["patch"])
    ran_on_f = {o["nodeid"] for o in builds["F"]["outcomes"] if not o["not_run"]}
    assert {BROKEN + "[sha256]", BROKEN + "[sha256_cbor]"} <= ran_on_f
    report = next((tmp_path / "results").glob("upstream-tests-*/report.md")).read_text()
    assert "fixture-break-block-hash (3)" in report and "_make_partial_tail_scheduler" in report
    # a second run reads every tree back from the cache
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 1, again.stderr[-2000:]
    assert all(b["cached"] for b in json.loads(again.stdout)["builds"])


class _Index:
    """A package index on loopback (real HTTP, PEP 691 JSON, what kvrepro/builds/sdist.py reads) that
    lists the sdists given, or answers 503 for all; it counts the requests."""

    def __init__(self, sdists: dict[str, str] | None):
        import http.server
        import threading

        index = self
        self.requests: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                index.requests.append(self.path)
                if sdists is None:
                    self.send_error(503)
                    return
                body = json.dumps({"files": [{"filename": f"vllm-{release}.tar.gz", "url": "http://127.0.0.1:9/x",
                                              "hashes": {"sha256": digest}} for release, digest in sdists.items()]})
                self.send_response(200)
                self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_bad_later_release_is_refused_in_one_line_before_anything_runs(tmp_path):
    """`--later` (and `--results`) were checked only at the end of a run (`--later` for a test that
    differs on a build): a typo found there cost the whole run, recorded nowhere. Now: a non-version,
    a release not newer than the base, or one the index does not list is exit 2 at once, and nothing
    is set up (the kvrepro home stays empty). The index is a real HTTP server on loopback (no network
    here to ask PyPI)."""
    matrix = _fixture_matrix(tmp_path)
    index = _Index({"0.27.0": "0" * 64})
    home = tmp_path / "home"
    env = {**os.environ, "KVREPRO_HOME": str(home), "KVREPRO_INDEX_URL": index.url}
    try:
        for later, expected in (("9.9.9", "the package index lists no vLLM 9.9.9 sdist"),
                                ("abc", "--later abc: not a vLLM version"),
                                ("0.25.1", "--later 0.25.1: not newer than the base 0.26.0")):
            asked = len(index.requests)
            proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "builds", "test", "--matrix", str(matrix),
                                   "--results", str(tmp_path / "results"), "--later", "0.27.0", "--later", later],
                                  capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
            assert proc.returncode == 2, proc.stderr
            (line,) = proc.stderr.strip().splitlines()
            assert line.startswith("error: ") and expected in line, line
            assert "Traceback" not in proc.stderr and not proc.stdout
            # 0.27.0 is listed and asked for; a bad version or an older release never reaches the index
            assert len(index.requests) - asked == (2 if later == "9.9.9" else 1)
        # the same for a --results that is a file (it was checked only when the run was written)
        (tmp_path / "a-file").write_text("")
        proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "builds", "test", "--matrix", str(matrix),
                               "--results", str(tmp_path / "a-file")], capture_output=True, text=True, cwd=tmp_path,
                              env=env, timeout=120)
        assert proc.returncode == 2 and "is a file, not a folder" in proc.stderr, proc.stderr
        assert not list(home.rglob("*")), "a refused --later or --results set something up"
        assert not (tmp_path / "results").exists()
    finally:
        index.close()


def test_a_newer_release_that_cannot_be_read_is_named_in_the_run_not_fatal(tmp_path, monkeypatch):
    """A newer release's tests/ that cannot be had when a differing test asks for it (the index down,
    here a real loopback server answering 503) is named in that test's `later` sentence, asked for
    once per run, and the run goes on; a release in the cache (a real sdist tarball, made here) is
    still read. Before, the error ended `builds test` after all its pytest jobs, recording nothing."""
    from kvrepro.builds import sdist, upstream_tests

    monkeypatch.setenv("KVREPRO_HOME", str(tmp_path / "home"))
    index = _Index(None)
    monkeypatch.setattr(sdist, "INDEX_URL", index.url)
    later, base = tmp_path / "later", tmp_path / "base"
    _write(base, "tests/unit/test_x.py", "def test_new():\n    assert 1 == 1\n\n\ndef test_unrelated():\n    assert False\n")
    _write(later, "tests/unit/test_x.py", "LIMIT = 3\n\n\ndef test_new():\n    assert min(4, LIMIT) == 3\n\n\n"
                                          "def test_unrelated():\n    assert False\n")
    folder = tmp_path / "home" / "sdists" / "0.27.0"
    folder.mkdir(parents=True)
    tarball = folder / "vllm-0.27.0.tar.gz"
    import hashlib
    import tarfile

    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(later / "tests", arcname="vllm-0.27.0/tests")
    (folder / "vllm-0.27.0.tar.gz.sha256").write_text(hashlib.sha256(tarball.read_bytes()).hexdigest() + "\n")
    try:
        lines: list[str] = []
        trees = upstream_tests._LaterTests(["0.26.5", "0.27.0"], lines.append)
        base_tests = sdist.SourceTests("0.26.0", base, "0" * 64)
        changed = trees.first_change(base_tests, "tests/unit/test_x.py::test_new")
        same = trees.first_change(base_tests, "tests/unit/test_x.py::test_unrelated")
        assert changed.startswith("changed in vllm 0.27.0: ") and "LIMIT" in changed, changed
        assert same == "unchanged in vllm 0.27.0; not read: vllm 0.26.5 (sdist unavailable)", same
        assert changed.endswith("; not read: vllm 0.26.5 (sdist unavailable)")
        assert len(index.requests) == 1, index.requests  # the unreadable release is not asked for again
        assert sum("0.26.5's tests/ not read" in line and "503" in line for line in lines) == 1, lines
        # an index that cannot be reached does not refuse --later: the tree is read when needed
        upstream_tests.check_later_releases("0.26.0", ["0.26.5"])
    finally:
        index.close()
