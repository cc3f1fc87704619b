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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import SetupError
from .records import UpstreamTestOutcome
from ..spec.records import BuildPlan, PatchRef
from . import overlay, prepare_runtime
from .sdist import source_tests
from .upstream_tests import (PLUGIN_NAME, PLUGIN_SOURCE, TestTree, TreeRun, _pristine_root, run_pytest,
                             test_runtime)


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
                   work: Path, on_line: Callable[[str], None] | None = None, workers: int = 2) -> list[StandaloneRun]:
    """Run ``test_file`` as ``rel`` (``tests/v1/...py``) in vLLM ``release``'s tests/ once per stack
    (label, patches; an empty stack is the pristine release), ``workers`` pytest processes at once."""
    base = source_tests(release)
    runtime = test_runtime(prepare_runtime(release, on_line), base, on_line)
    work = work.resolve()  # pytest runs in the tree: its report path must not be relative
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
        jobs = []
        for n, (label, patches) in enumerate(stacks):
            if patches:
                artifact = overlay.build_release_overlay(
                    BuildPlan(name=f"standalone-{n}", base=release, patches=tuple(patches)), on_line)
                if not artifact.ok:
                    raise SetupError(f"{label}: {artifact.error}")
                root, key = Path(artifact.ref or ""), artifact.ref or ""
            else:
                root, key = _pristine_root(release, on_line)
            jobs.append((n, TreeRun(label, root, key, None, (rel,))))
        if on_line:
            on_line(f"running {rel} with vLLM's pytest (the {release} sdist's tests/) on "
                    f"{', '.join(job.label for _, job in jobs)}")
        # the trees side by side: each process pays vLLM's and its tests' imports, most of its time
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs)))) as pool:
            outcomes = list(pool.map(lambda item: run_pytest(runtime, tree, item[1], work / f"job-{item[0]}"), jobs))
        return [StandaloneRun(job.label, got) for (_, job), got in zip(jobs, outcomes)]
    finally:
        shutil.rmtree(tree_root, ignore_errors=True)
