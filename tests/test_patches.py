"""The patch files under builds/ and kvrepro.builds.patching, against real vLLM 0.26.0 source.

Nothing is faked except, in one test, the absence of the `patch` program (every machine here
has it). The vLLM source is the unpacked 0.26.0 wheel: see the `vllm_src` fixture.
"""

from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path

import pytest

from kvrepro.builds.patching import (
    FUZZ,
    apply_patch_stack,
    check_expectations,
    read_header,
    touched_files,
)
from kvrepro.errors import SetupError, SpecError
from kvrepro.builds.records import PatchFailure
from kvrepro.spec.records import PatchRef
from kvrepro.spec.matrix import load_matrix
from kvrepro.versions import SUPPORTED_RELEASES

PROJECT = Path(__file__).resolve().parent.parent
MATRIX = PROJECT / "matrix.yaml"
BUILDS_DIR = PROJECT / "builds"
SCHEDULER = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
CORE_SCHEDULER = "vllm/v1/core/sched/scheduler.py"
COORDINATOR = "vllm/v1/core/kv_cache_coordinator.py"
KV_CACHE_MANAGER = "vllm/v1/core/kv_cache_manager.py"
CONNECTOR_BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
MULTI_CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py"
NIXL_CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py"
@pytest.fixture(scope="session")
def vllm_src(request) -> Path:
    """A READ-ONLY pristine vLLM 0.26.0 tree (a folder holding `vllm/`).

    The single place that decides where it comes from: $KVREPRO_TEST_VLLM_SRC, else the wheel
    kvrepro.builds downloads and extracts (cached under ~/.cache/kvrepro).
    """
    if os.environ.get("KVREPRO_TEST_VLLM_SRC"):
        src = Path(os.environ["KVREPRO_TEST_VLLM_SRC"])
    else:
        src = request.getfixturevalue("pristine_vllm")
    assert (src / SCHEDULER).is_file(), f"no vLLM 0.26.0 source at {src} (missing {SCHEDULER})"
    return src


def _all_touched() -> list[str]:
    return sorted({f for p in sorted(BUILDS_DIR.glob("*.patch")) for f in touched_files(p)})


@pytest.fixture
def tree(tmp_path: Path, vllm_src: Path):
    """A writable copy of exactly the files the patches touch (copying all of vLLM is slow)."""

    def make(name: str = "tree", release: str | None = None) -> Path:
        # a patch written for another release than the matrix's base (its header's Base:) is
        # applied to that release's tree, read from its wheel (kvrepro's cache)
        src = vllm_src
        if release is not None and release != _matrix().matrix.base:
            from kvrepro.builds import pristine_tree

            src = pristine_tree(release)[1]
        root = tmp_path / name
        for rel in _all_touched():
            if (src / rel).is_file():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, root / rel)
        return root

    return make


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _matrix():
    return load_matrix(MATRIX)


def _plan(build: str):
    return next(p for p in _matrix().plans() if p.name == build)


def _ref(name: str) -> PatchRef:
    return _matrix().patch_ref(name)


def _function(source: str, cls: str, func: str) -> ast.FunctionDef:
    module = ast.parse(source)
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == func:
                    return item
    raise AssertionError(f"{cls}.{func} not found")


def _is_alignment_assert(node: ast.Assert) -> bool:
    """`assert num_locally_computed_tokens % tokens_per_block == 0`"""
    test = node.test
    return (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.left, ast.BinOp) and isinstance(test.left.op, ast.Mod)
        and isinstance(test.left.left, ast.Name) and test.left.left.id == "num_locally_computed_tokens"
        and isinstance(test.left.right, ast.Name) and test.left.right.id == "tokens_per_block"
        and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == 0
    )


def _is_old_boundary_assert(node: ast.Assert) -> bool:
    """`assert num_locally_computed_tokens <= <something> * tokens_per_block` (the crash)"""
    test = node.test
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name) and test.left.id == "num_locally_computed_tokens"
        and isinstance(test.ops[0], ast.LtE)
    )


# ------------------------------------------------------------------ the real patches


BUILDS = list(_matrix().matrix.builds)


def test_matrix_declares_the_expected_stacks():
    stacks = {p.name: [r.name for r in p.patches] for p in _matrix().plans()}
    assert stacks == {
        "A": ["pr-49146"],
        "B": ["pr-49146", "pr-52807"],
        "C": ["pr-49146", "pr-52771"],
        "D": ["pr-49146", "pr-52771", "pr-52807"],
        "E": ["pr-49146", "pr-52771", "pr-52807", "pr-48425", "pr-50344"],
    }


@pytest.mark.parametrize("build", BUILDS)
def test_stack_applies_and_each_patch_changes_what_it_claims(build: str, tree):
    plan = _plan(build)
    root = tree()
    applied: list[str] = []
    for ref in plan.patches:
        header = read_header(ref.path)
        assert header.expects, f"{ref.name}: a patch with no Expect claim cannot be checked"
        missing = [r for r in header.requires if r not in applied]
        assert not missing, f"build {build}: {ref.name} requires {missing} earlier in the stack"
        # Each claim must be false before the patch, or the patch is not what changes it.
        already_true = [e.describe() for e in header.expects if e.holds(root)]
        assert not already_true, f"{ref.name}: claims already true before applying it: {already_true}"

        assert apply_patch_stack(root, [ref]) is None
        assert check_expectations(root, header) == []
        applied.append(ref.name)

    for rel in _all_touched():
        if rel.endswith(".py"):
            compile((root / rel).read_text(), rel, "exec")  # SyntaxError fails the test
    leftovers = [p.name for p in root.rglob("*") if p.suffix in (".orig", ".rej")]
    assert leftovers == []

    # Applying the stack in one call gives the same bytes as patch by patch.
    at_once = tree("at_once")
    assert apply_patch_stack(at_once, plan.patches) is None
    assert _snapshot(at_once) == _snapshot(root)


@pytest.mark.parametrize("build", ["B", "D"])
def test_pr52807_asserts_block_alignment_in_update_state_after_alloc(build: str, tree, vllm_src):
    before = _function((vllm_src / SCHEDULER).read_text(), "OffloadingConnectorScheduler", "update_state_after_alloc")
    before_asserts = [n for n in ast.walk(before) if isinstance(n, ast.Assert)]
    assert any(_is_old_boundary_assert(a) for a in before_asserts)
    assert not any(_is_alignment_assert(a) for a in before_asserts)

    root = tree()
    assert apply_patch_stack(root, _plan(build).patches) is None
    func = _function((root / SCHEDULER).read_text(), "OffloadingConnectorScheduler", "update_state_after_alloc")
    asserts = [n for n in ast.walk(func) if isinstance(n, ast.Assert)]
    assert sum(_is_alignment_assert(a) for a in asserts) == 1
    assert not any(_is_old_boundary_assert(a) for a in asserts)

    # The scan for the load start begins at cdiv(num_locally_computed_tokens, tokens_per_block).
    starts = [
        ast.unparse(n.iter.args[0])
        for n in ast.walk(func)
        if isinstance(n, ast.For) and isinstance(n.iter, ast.Call)
        and isinstance(n.iter.func, ast.Name) and n.iter.func.id == "range"
    ]
    assert starts == ["cdiv(num_locally_computed_tokens, tokens_per_block)"]


@pytest.mark.parametrize("build", ["A", "C"])
def test_builds_without_pr52807_keep_the_crashing_assert(build: str, tree):
    root = tree()
    assert apply_patch_stack(root, _plan(build).patches) is None
    func = _function((root / SCHEDULER).read_text(), "OffloadingConnectorScheduler", "update_state_after_alloc")
    assert any(_is_old_boundary_assert(n) for n in ast.walk(func) if isinstance(n, ast.Assert))


def test_pr52771_drops_the_all_groups_drafter_fallback(tree, vllm_src):
    def fallback_assignments(source: str) -> list[str]:
        func = _function(source, "SchedulerOffloadConfig", "from_spec")
        return [ast.unparse(n) for n in ast.walk(func)
                if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "eagle_groups"
                                                     for t in n.targets)
                and isinstance(n.value, ast.Call)]

    assert fallback_assignments((vllm_src / SCHEDULER).read_text())  # 0.26.0 has `= set(range(...))`
    root = tree()
    assert apply_patch_stack(root, _plan("C").patches) is None
    assert fallback_assignments((root / SCHEDULER).read_text()) == []


TOUCHED = {
    "pr-49146.patch": [SCHEDULER],
    "pr-52771.patch": [SCHEDULER],
    "pr-52807.patch": [SCHEDULER],
    "pr-48425.patch": [COORDINATOR, KV_CACHE_MANAGER, CORE_SCHEDULER],
    "pr-50344.patch": [CONNECTOR_BASE, MULTI_CONNECTOR, NIXL_CONNECTOR, CORE_SCHEDULER],
    "decoy-docstring.patch": ["vllm/logger.py"],
    "pr-44409.patch": [COORDINATOR],
    "pr-42554.patch": [CORE_SCHEDULER],
    "pr-49671.patch": [SCHEDULER],
    "revert-pr-46231.patch": [SCHEDULER],
    "fix-recompute-failed-load-reservation.patch": [CORE_SCHEDULER],
    "fix-recompute-failed-load-reservation-0.34.patch": [CORE_SCHEDULER],
}


@pytest.mark.parametrize("patch", sorted(p.name for p in BUILDS_DIR.glob("*.patch")))
def test_touched_files_of_real_patches(patch: str):
    assert touched_files(BUILDS_DIR / patch) == TOUCHED[patch]


def test_headers_agree_with_matrix():
    matrix = _matrix().matrix
    for name, spec in matrix.patches.items():
        header = read_header(BUILDS_DIR / spec.file)
        assert header.upstream == spec.upstream, name
        assert header.title and header.description
        in_builds = any(name == ref.name for plan in _matrix().plans() for ref in plan.patches) or name in matrix.common
        if in_builds:
            assert header.base == f"vllm {matrix.base}", name
        else:  # a patch in no build (a proposal, a catalogue stack) may be written for another release
            assert header.base.removeprefix("vllm ") in SUPPORTED_RELEASES, (name, header.base)
        assert all(r in matrix.patches for r in header.requires), name
        # provenance: each Derived-From names a later release tree and a file the diff touches
        touched = touched_files(BUILDS_DIR / spec.file)
        for derived in header.derived_from:
            assert derived.release in SUPPORTED_RELEASES, (name, derived)
            assert SUPPORTED_RELEASES.index(derived.release) > SUPPORTED_RELEASES.index(matrix.base), (name, derived)
            assert derived.file in touched, (name, derived)


def test_backports_say_which_release_tree_each_file_came_from():
    for patch in ("pr-48425.patch", "pr-50344.patch"):
        header = read_header(BUILDS_DIR / patch)
        assert sorted(d.file for d in header.derived_from) == sorted(touched_files(BUILDS_DIR / patch)), patch
    assert {d.release for d in read_header(BUILDS_DIR / "pr-48425.patch").derived_from} == {"0.27.0"}
    assert {d.release for d in read_header(BUILDS_DIR / "pr-50344.patch").derived_from} == {"0.28.0"}


def _stack_for(name: str) -> list[str]:
    """common, then what `name` requires (recursively, each once), then `name`."""
    matrix = _matrix().matrix
    order: list[str] = list(matrix.common)

    def add(patch: str) -> None:
        for required in read_header(BUILDS_DIR / matrix.patches[patch].file).requires:
            add(required)
        if patch not in order:
            order.append(patch)

    add(name)
    return order


@pytest.mark.parametrize("name", list(_matrix().matrix.patches))
def test_every_declared_patch_changes_what_it_claims_on_its_required_stack(name: str, tree):
    """Also the patches no build uses (the bisection's decoy): claims false before, true after;
    a revert (`reverse: true`) the other way round, since the claims describe the fixed tree."""
    release = read_header(_ref(name).path).base.removeprefix("vllm ")
    root = tree(release=release)
    stack = _stack_for(name)
    if release != _matrix().matrix.base:  # the matrix's common patches are 0.26.0's
        stack = [p for p in stack if p not in _matrix().matrix.common]
    assert apply_patch_stack(root, [_ref(p) for p in stack[:-1]]) is None
    header = read_header(_ref(name).path)
    assert header.expects
    fixed_before, fixed_after = (True, False) if _ref(name).reverse else (False, True)
    assert [e.describe() for e in header.expects if e.holds(root) != fixed_before] == []
    assert apply_patch_stack(root, [_ref(name)]) is None
    assert [e.describe() for e in header.expects if e.holds(root) != fixed_after] == []
    for rel in touched_files(_ref(name).path):
        compile((root / rel).read_text(), rel, "exec")


def test_pr48425_applies_to_bare_base_and_pr50344_needs_it(tree):
    """pr-48425 does not depend on the offloading patches (a bisection may pick it alone);
    pr-50344 fails on a tree without pr-48425 and says so."""
    root = tree()
    assert apply_patch_stack(root, [_ref("pr-48425")]) is None
    root = tree("without")
    failure = apply_patch_stack(root, [_ref("pr-49146"), _ref("pr-50344")])
    assert failure is not None and failure.patch == "pr-50344"
    assert "requires pr-48425" in failure.detail


def test_backports_replace_the_max_of_groups_local_hit(tree, vllm_src):
    """0.26.0's schedule() takes max(per_group_hits) for any connector; after pr-48425 the connector's
    local hit comes from get_computed_blocks_for_connector, after pr-50344 only for capable connectors."""
    def schedule_calls(source: str) -> set[str]:
        func = _function(source, "Scheduler", "schedule")
        return {ast.unparse(n.func) for n in ast.walk(func) if isinstance(n, ast.Call)}

    before = schedule_calls((vllm_src / CORE_SCHEDULER).read_text())
    assert "max" in before and "self.kv_cache_manager.coordinator.find_longest_cache_hit_per_group" in before
    root = tree()
    assert apply_patch_stack(root, _plan("E").patches[:-1]) is None  # D + pr-48425
    mid = schedule_calls((root / CORE_SCHEDULER).read_text())
    assert "self.kv_cache_manager.coordinator.find_longest_cache_hit_per_group" not in mid
    assert "self.kv_cache_manager.get_computed_blocks_for_connector" in mid
    assert apply_patch_stack(root, _plan("E").patches[-1:]) is None
    after = schedule_calls((root / CORE_SCHEDULER).read_text())
    assert "self._get_local_prefix_cache_hit" in after
    assert "self.kv_cache_manager.get_computed_blocks_for_connector" not in after
    # the OffloadingConnector inherits the base class's False: it gets the reconciled hit
    base = ast.parse((root / CONNECTOR_BASE).read_text())
    prop = _function(ast.unparse(base), "KVConnectorBase_V1", "supports_divergent_local_hybrid_hits")
    assert ast.unparse(prop.body[-1]) == "return False"


# ------------------------------------------------------------------ failures


def _write(path: Path, text: str) -> PatchRef:
    path.write_text(text)
    return PatchRef(name=path.stem, path=path, upstream="", sha256="")


def _hunk_headers(text: str) -> list[str]:
    return [line.split(" @@")[0] + " @@" for line in text.splitlines() if line.startswith("@@ ")]


def test_broken_hunk_names_patch_file_and_hunk_and_changes_nothing(tmp_path, tree):
    """Hunk #2's first context line no longer matches: a default-fuzz `patch` would still
    apply it (fuzz ignores outer context lines); with fuzz 0 it must fail, and hunk #1 (which
    does match) must not be applied either."""
    assert FUZZ == 0
    text = (BUILDS_DIR / "pr-52807.patch").read_text()
    lines = text.splitlines(keepends=True)
    second = [i for i, line in enumerate(lines) if line.startswith("@@ ")][1]
    assert lines[second + 1].startswith(" ")
    lines[second + 1] = " " + lines[second + 1][1:].rstrip("\n") + "  # drifted\n"
    broken = _write(tmp_path / "broken-52807.patch", "".join(lines))

    root = tree()
    reference = tree("reference")
    assert apply_patch_stack(reference, [_ref("pr-49146")]) is None

    failure = apply_patch_stack(root, [_ref("pr-49146"), broken])
    assert isinstance(failure, PatchFailure)
    assert failure.patch == "broken-52807"
    assert failure.file == SCHEDULER
    assert failure.hunk == f"#2 ({_hunk_headers(text)[1]})"
    assert "Hunk #2 FAILED" in failure.detail
    assert _snapshot(root) == _snapshot(reference)  # pr-49146 applied, the broken one not at all


def test_patch_without_its_requirement_fails_on_the_dependent_hunk(tree):
    root = tree()
    before = _snapshot(root)
    failure = apply_patch_stack(root, [_ref("pr-52771")])
    assert failure is not None
    assert (failure.patch, failure.file) == ("pr-52771", SCHEDULER)
    assert failure.hunk.startswith("#2 (@@ -")
    assert "requires pr-49146" in failure.detail
    assert _snapshot(root) == before


def test_already_applied_patch_is_a_failure_not_a_reversal(tree):
    root = tree()
    assert apply_patch_stack(root, [_ref("pr-49146")]) is None
    once = _snapshot(root)
    failure = apply_patch_stack(root, [_ref("pr-49146")])
    assert failure is not None and failure.patch == "pr-49146"
    assert "previously applied" in failure.detail and "already" in failure.detail
    assert _snapshot(root) == once


def test_patch_for_a_missing_file(tmp_path, tree):
    text = (BUILDS_DIR / "pr-49146.patch").read_text().replace(SCHEDULER, "vllm/not_there.py")
    failure = apply_patch_stack(tree(), [_write(tmp_path / "ghost.patch", text)])
    assert failure is not None
    assert (failure.patch, failure.file) == ("ghost", "vllm/not_there.py")
    assert failure.hunk.startswith("#1 (@@ -")
    assert "does not exist" in failure.detail


def test_symlinked_file_is_refused_and_its_target_untouched(tmp_path, tree):
    """An overlay that symlinks into a shared source tree must not get that tree patched."""
    shared = tree("shared")
    overlay = tmp_path / "overlay"
    (overlay / SCHEDULER).parent.mkdir(parents=True)
    (overlay / SCHEDULER).symlink_to(shared / SCHEDULER)
    before = _snapshot(shared)
    failure = apply_patch_stack(overlay, [_ref("pr-49146")])
    assert failure is not None and failure.file == SCHEDULER
    assert "symbolic link" in failure.detail
    assert _snapshot(shared) == before


def test_malformed_and_empty_patches(tmp_path, tree):
    root = tree()
    before = _snapshot(root)
    good = (BUILDS_DIR / "pr-49146.patch").read_text()
    first = _hunk_headers(good)[0]
    # The @@ line promises more lines than the hunk has.
    bad_counts = good.replace(first, first.replace(",10 ", ",30 ", 1), 1)
    assert bad_counts != good
    failure = apply_patch_stack(root, [_write(tmp_path / "counts.patch", bad_counts)])
    assert failure is not None and failure.patch == "counts" and "malformed" in failure.detail

    failure = apply_patch_stack(root, [_write(tmp_path / "prose.patch", "# Upstream: x\njust words\n")])
    assert failure is not None and failure.patch == "prose" and "no unified diff" in failure.detail
    assert _snapshot(root) == before


def test_sha256_pin_is_checked_at_apply_time(tmp_path, tree):
    ref = _ref("pr-49146")
    pinned = PatchRef(name=ref.name, path=ref.path, upstream=ref.upstream, sha256="0" * 64)
    failure = apply_patch_stack(tree(), [pinned])
    assert failure is not None and "sha256" in failure.detail


def test_missing_patch_program_is_a_setup_error(monkeypatch, tree):
    """Fakes a machine without GNU patch (shutil.which finds nothing)."""
    from kvrepro.builds import patching

    monkeypatch.setattr(patching.shutil, "which", lambda name: None)
    with pytest.raises(SetupError, match="apt-get install patch"):
        apply_patch_stack(tree(), [_ref("pr-49146")])


# ------------------------------------------------------------------ header and diff parsing


def test_header_field_typo_names_the_line(tmp_path):
    text = (BUILDS_DIR / "pr-49146.patch").read_text().replace("# Expect: ", "# Expects: ", 1)
    path = tmp_path / "typo.patch"
    path.write_text(text)
    with pytest.raises(SpecError, match=r"typo\.patch:4: unknown header field 'Expects'"):
        read_header(path)


def test_expect_text_is_a_json_string(tmp_path):
    path = tmp_path / "quoted.patch"
    path.write_text('# Upstream: u\n# Title: t\n# Expect: a/b.py contains "say \\"hi\\""\n#\n# why\n'
                    "--- a/x/a/b.py\n+++ b/x/a/b.py\n@@ -1 +1 @@\n-x\n+y\n")
    header = read_header(path)
    assert header.expects[0].text == 'say "hi"' and header.expects[0].present
    assert header.description == "why"


def test_touched_files_of_a_multi_file_diff(tmp_path):
    path = tmp_path / "multi.patch"
    path.write_text(
        "# Upstream: u\n# Title: t\n"
        "diff --git a/vllm/one.py b/vllm/one.py\n--- a/vllm/one.py\n+++ b/vllm/one.py\n"
        "@@ -1,2 +1,2 @@\n a\n-b\n+c\n"
        "--- /dev/null\n+++ b/vllm/new.py\n@@ -0,0 +1 @@\n+x = 1\n"
        "--- a/vllm/gone.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-y = 2\n"
        "--- a/vllm/one.py\n+++ b/vllm/one.py\n@@ -5 +5 @@\n-d\n+e\n"
    )
    assert touched_files(path) == ["vllm/one.py", "vllm/new.py", "vllm/gone.py"]


def test_touched_files_rejects_paths_outside_the_tree(tmp_path):
    path = tmp_path / "escape.patch"
    path.write_text("--- a/../etc/passwd\n+++ b/../etc/passwd\n@@ -1 +1 @@\n-a\n+b\n")
    with pytest.raises(SpecError, match="outside the tree"):
        touched_files(path)


def test_derived_from_is_parsed_and_repeatable(tmp_path):
    path = tmp_path / "backport.patch"
    path.write_text("# Upstream: u\n# Title: t\n"
                    "# Derived-From: vllm 0.27.0 vllm/v1/core/kv_cache_manager.py (get_computed_blocks_for_connector)\n"
                    "# Derived-From: vllm 0.28.0 vllm/v1/core/sched/scheduler.py\n"
                    '# Expect: vllm/a.py contains "x"\n#\n# why\n'
                    "--- a/vllm/a.py\n+++ b/vllm/a.py\n@@ -1 +1 @@\n-x\n+y\n")
    derived = read_header(path).derived_from
    assert [(d.release, d.file, d.note, d.line) for d in derived] == [
        ("0.27.0", "vllm/v1/core/kv_cache_manager.py", "get_computed_blocks_for_connector", 3),
        ("0.28.0", "vllm/v1/core/sched/scheduler.py", "", 4),
    ]
    assert derived[0].describe() == "vllm 0.27.0 vllm/v1/core/kv_cache_manager.py (get_computed_blocks_for_connector)"


@pytest.mark.parametrize("value, problem", [
    ("0.27.0 vllm/v1/core/kv_cache_manager.py", "must read `vllm <release> <relative file>"),
    ("vllm main vllm/v1/core/kv_cache_manager.py", "must read `vllm <release> <relative file>"),
    ("vllm 0.27.0", "must read `vllm <release> <relative file>"),
    ("vllm 0.27.0 /etc/passwd (x)", "must be a relative path inside the tree"),
])
def test_malformed_derived_from_names_the_line(tmp_path, value: str, problem: str):
    path = tmp_path / "bad.patch"
    path.write_text(f"# Upstream: u\n# Title: t\n# Derived-From: {value}\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n")
    with pytest.raises(SpecError, match=r"bad\.patch:3: Derived-From") as info:
        read_header(path)
    assert problem in str(info.value)


# ------------------------------------------------------------------ reverse (revert) patches


def test_a_revert_takes_the_fix_out_and_records_itself(tree):
    """`revert-pr-44409` applies builds/pr-44409.patch with `patch --reverse`: the coordinator
    allocates each group's external blocks right after touching that group's local hit again
    (the order before #44409), and the patch's own Expect claim about the fixed tree turns false."""
    ref = _ref("revert-pr-44409")
    assert ref.reverse and ref.path.name == "pr-44409.patch" and ref.label == "revert-pr-44409 (reverse of pr-44409.patch)"
    header = read_header(ref.path)
    root = tree()
    assert check_expectations(root, header) == []  # 0.26.0 as released carries the fix
    assert apply_patch_stack(root, [ref]) is None
    assert len(check_expectations(root, header)) == len(header.expects)
    method = _function((root / COORDINATOR).read_text(), "KVCacheCoordinator", "allocate_new_computed_blocks")
    loop = next(n for n in method.body if isinstance(n, ast.For))
    inner = ast.unparse(loop)
    assert "add_local_computed_blocks" in inner and "allocate_external_computed_blocks" in inner


def test_a_revert_of_a_change_the_tree_lacks_is_one_clear_failure(tree):
    """Listed twice, the second revert finds the change already gone: a failure naming the revert,
    the file and hunk, and the tree stays as the first revert left it (never applied forward)."""
    ref = _ref("revert-pr-44409")
    root = tree()
    assert apply_patch_stack(root, [ref]) is None
    before = _snapshot(root)
    failure = apply_patch_stack(root, [ref, ref])
    assert isinstance(failure, PatchFailure) and failure.file == COORDINATOR
    line = str(failure)
    assert line.startswith(f"patch revert-pr-44409 (reverse of pr-44409.patch): {COORDINATOR}: hunk #1")
    assert "Unreversed patch detected" in line and "does not carry the change" in line and "\n" not in line
    assert _snapshot(root) == before


def test_a_revert_whose_context_drifted_names_the_hunk(tmp_path, tree):
    """A hunk that no longer matches (as on 0.33.0, whose second loop passes record_for_zeroing=)
    fails like a forward hunk does, in one line, and changes nothing."""
    text = (BUILDS_DIR / "pr-44409.patch").read_text().replace(
        "+            for manager in self.single_type_managers:\n",
        "+            for i, manager in enumerate(self.single_type_managers):\n")
    path = tmp_path / "drifted.patch"
    path.write_text(text)
    ref = PatchRef(name="revert-drifted", path=path, upstream="", sha256="", reverse=True)
    root = tree()
    before = _snapshot(root)
    failure = apply_patch_stack(root, [ref])
    assert failure is not None and failure.hunk.startswith("#2 (@@")
    assert str(failure).startswith(f"patch revert-drifted (reverse of drifted.patch): {COORDINATOR}: hunk #2")
    assert "FAILED" in failure.detail and _snapshot(root) == before


def test_reverse_is_in_the_overlay_key_and_the_manifest_records():
    """A revert is another build than the same file applied forward, and every record says so;
    forward patches keep the records (and overlay keys) they had."""
    from dataclasses import replace

    from kvrepro.builds.overlay import overlay_key
    from kvrepro.builds.records import BuildManifest, ManifestPatch
    from kvrepro.deploy.records import PatchInfo
    from kvrepro.records import to_jsonable
    from kvrepro.spec.records import BuildPlan

    ref = _ref("revert-pr-44409")
    plan = BuildPlan(name="R", base="0.26.0", patches=(ref,))
    forward = BuildPlan(name="R", base="0.26.0", patches=(replace(ref, reverse=False),))
    assert overlay_key(plan, "w" * 64) != overlay_key(forward, "w" * 64)
    manifest = BuildManifest.from_json({"patches": [{"name": ref.name, "sha256": ref.sha256, "upstream": ref.upstream,
                                                     "reverse": True}]})
    assert manifest.patches == (ManifestPatch(ref.name, ref.sha256, ref.upstream, reverse=True),)
    assert to_jsonable(manifest)["patches"][0]["reverse"] is True
    assert "reverse" not in to_jsonable(ManifestPatch("p", "s"))
    assert to_jsonable(PatchInfo("p", "u", "s", True))["reverse"] is True and "reverse" not in to_jsonable(PatchInfo("p"))
