"""One test file written for upstream, run by vLLM's own pytest inside a release's ``tests/``.

Why: a regression test kvrepro proposes upstream (``kvrepro minimize --emit-pytest`` for a stall,
kvrepro/minimize/upstream_emit.py) imports vLLM's test helpers (``from .utils import ...``) the way
its neighbours do, so it only runs where it would be committed: in the release's ``tests/`` tree
from the sdist, under vLLM's pytest configuration and plugins, with vLLM's CPU platform. This is
the ``kvrepro builds test`` machinery (kvrepro/builds/upstream_tests.py: the sdist's tests, the
test runtime layer, the offline Hugging Face configs, one pytest process per job) pointed at one
file: the base's tree is hard-linked into a scratch folder with the file added, and pytest runs
it against the pristine release and against the release with a patch stack (the proposed fix).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..records import BuildPlan, PatchRef, UpstreamTestOutcome
from . import overlay, prepare_runtime
from .sdist import source_tests
from .upstream_tests import PLUGIN_NAME, PLUGIN_SOURCE, TestTree, TreeRun, run_pytest, test_runtime


@dataclass(frozen=True)
class StandaloneRun:
    """The file's tests on one vLLM tree: ``label`` (``vLLM 0.33.0``, ``vLLM 0.33.0 + fix``) and each
    test's outcome (pytest's node id -> passed / failed / error / skipped, with its message)."""

    label: str
    outcomes: dict[str, UpstreamTestOutcome]

    @property
    def failed(self) -> list[UpstreamTestOutcome]:
        return [o for o in self.outcomes.values() if o.outcome in ("failed", "error")]


def run_standalone(release: str, test_file: Path, rel: str, stacks: Sequence[tuple[str, Sequence[PatchRef]]],
                   work: Path, on_line: Callable[[str], None] | None = None) -> list[StandaloneRun]:
    """Run ``test_file`` as ``rel`` (``tests/v1/...py``) in vLLM ``release``'s tests/ once per stack
    (label, patches; an empty stack is the pristine release)."""
    base = source_tests(release)
    runtime = test_runtime(prepare_runtime(release, on_line), base, on_line)
    work.mkdir(parents=True, exist_ok=True)
    tree_root = Path(tempfile.mkdtemp(dir=work, prefix="tree-"))
    try:
        shutil.copytree(base.tests, tree_root / "tests", copy_function=os.link,
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(base.root / "pyproject.toml", tree_root / "pyproject.toml")
        (tree_root / f"{PLUGIN_NAME}.py").write_text(PLUGIN_SOURCE.read_text())
        target = tree_root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)  # a hard link into the shared sdist extraction: never written through
        shutil.copyfile(test_file, target)
        tree = TestTree(root=tree_root, key="standalone", modules=(), patch_ids={}, patch_of={})
        runs = []
        for n, (label, patches) in enumerate(stacks):
            if patches:
                artifact = overlay.build_release_overlay(
                    BuildPlan(name=f"standalone-{n}", base=release, patches=tuple(patches)), on_line)
                if not artifact.ok:
                    raise RuntimeError(f"{label}: {artifact.error}")
                root, key = Path(artifact.ref), artifact.ref
            else:
                wheel, root, digest = overlay.pristine_tree(release, on_line)
                if not any(root.glob("vllm-*.dist-info/METADATA")):
                    overlay.wheels.extract_dist_info(wheel, root, ("METADATA", "entry_points.txt", "top_level.txt"))
                key = f"release-{digest}"
            if on_line:
                on_line(f"running {rel} with {label}'s vLLM (vLLM's pytest, the {release} sdist's tests/)")
            job = TreeRun(label, root, key, None, (rel,))
            runs.append(StandaloneRun(label, run_pytest(runtime, tree, job, work / f"job-{n}")))
        return runs
    finally:
        shutil.rmtree(tree_root, ignore_errors=True)
