"""Every build checked by vLLM's own tests (``kvrepro builds test``).

kvrepro's verdicts come from load on a GPU-free engine; vLLM's unit tests are a second oracle that
nobody here wrote. For a matrix's builds this module

1. reads the base release's ``tests/`` from its sdist (kvrepro/builds/sdist.py) and the tests
   each patch header names (``# Upstream-Test:``) from the later releases that carry them
   (kvrepro/builds/upstream_copy.py writes them, unchanged, into the base's tests/);
2. runs ``tests/v1/core`` and ``tests/v1/kv_connector/unit`` (``ROOTS``) on the unpatched release
   with vLLM's own CPU platform: what does not pass there (needs CUDA, a model download, a
   third-party service) is *excluded*, with why, from every build;
3. runs, on each build's overlay (the patched ``vllm/`` the engine runs), the rest of those tests
   that reach code the build's stack changed (the release's run is measured by coverage.py for
   this: kvrepro/builds/upstream_impact.py) and every patch's tests, the builds side by side two
   pytest processes at a time, and records pass / fail (assertion) per test; a test no change
   reaches keeps the release's outcome, marked ``not_run``;
4. for every test whose outcome on a build differs from the release, runs it on the prefixes of
   the build's patch stack to name the patch that changed it, and reads the same test in the
   newer releases' tests/ to say whether upstream changed it there too.

Every tree's results are cached by what went into it (overlay key, sdist, selection, runtime), so
a second run of the same builds reads them back in seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import paths, versions
from ..errors import BadInputError, SetupError
from ..records import (
    BuildArtifact, BuildPlan, ChangedCode, ExcludedTest, PatchRef, PatchTestModule, UpstreamBuildTests, UpstreamTestChange,
    UpstreamTestOutcome, UpstreamTestRun, from_jsonable, to_jsonable,
)
from . import overlay, patching, upstream_copy, upstream_impact
from .runtime import Runtime, ensure_layer
from .sdist import SourceTests, on_index, publish_staged, source_tests

# The scheduler, the KV-cache manager and the KV connectors: what kvrepro's builds patch.
ROOTS = ("tests/v1/core", "tests/v1/kv_connector/unit")
# What vLLM's tests/conftest.py and these tests import beyond vLLM's own requirements; pinned to
# the release's requirements/test/cpu.txt when it pins them.
# coverage: the release's baseline records which test executed which line (test impact selection,
# kvrepro/builds/upstream_impact.py).
TEST_REQUIREMENTS = ("pytest", "pytest-asyncio", "pytest-mock", "pytest-timeout", "tblib", "coverage")
PER_TEST_TIMEOUT_S = 300
FORMAT = 3  # bump when what a cached result means changes
# pytest's options for every job (part of the cache key). A file that cannot be imported (ray,
# flexkv, lmcache missing) must not stop the others: pytest stops at collection errors by default.
PYTEST_ARGS = ("-p", "no:cacheprovider", "-q", "-rN", "--no-header", "--continue-on-collection-errors",
               f"--timeout={PER_TEST_TIMEOUT_S}", "-o", "addopts=")
# Model configs the tests build a ModelConfig from (create_scheduler's default facebook/opt-125m):
# this machine cannot reach the Hugging Face hub, so kvrepro puts the model's config.json (no
# weights, no tokenizer) in an offline hub cache. Listed in the record; a test that needs more of
# a model than its config is excluded, as before.
HF_CONFIGS = paths.PACKAGE_ROOT / "data" / "hf-configs"
_HF_REVISION = "0" * 40
PLUGIN_SOURCE = Path(__file__).with_name("upstream_pytest_plugin.py")
PLUGIN_NAME = "kvrepro_upstream_plugin"
PASSED = "passed"


def newer_releases(base: str) -> list[str]:
    """The supported releases after ``base`` (kvrepro/versions.py), oldest first."""
    releases = list(versions.SUPPORTED_RELEASES)
    return releases[releases.index(base) + 1:] if base in releases else []


def check_later_releases(base: str, releases: Sequence[str]) -> None:
    """``--later``: each a version newer than ``base`` whose sdist exists; raises BadInputError.

    Checked before any test runs because the newer trees are read only at the end, for a test that
    differs on a build: a typo found there used to end a run of minutes or hours with nothing recorded.
    An index that cannot be reached now is not bad input; the tree is read when needed and a failure
    then is written into the run (:class:`_LaterTests`)."""
    from packaging.version import InvalidVersion, Version

    for release in releases:
        try:
            newer = Version(release) > Version(base)
        except InvalidVersion:
            raise BadInputError(f"--later {release}: not a vLLM version; give a release newer than {base}, "
                                f"e.g. --later {versions.newest()}") from None
        if not newer:
            raise BadInputError(f"--later {release}: not newer than the base {base}; give a later release, "
                                f"e.g. --later {versions.newest()}")
        if on_index(release) is False:
            raise BadInputError(f"--later {release}: the package index lists no vLLM {release} sdist; "
                                "`pip index versions vllm` lists the releases")


def cache_dir() -> Path:
    return paths.home() / "upstream-tests"


def _sha(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


# --------------------------------------------------------------------------- the test tree


@dataclasses.dataclass(frozen=True)
class TestTree:
    """A folder holding the base's ``tests/`` (hard links into the sdist extraction), the patches'
    generated test modules and the plugin; the same for every build of the base."""

    root: Path
    key: str
    modules: tuple[PatchTestModule, ...]
    patch_ids: dict[str, str]  # generated node id -> "vllm <release> <upstream node id>"
    patch_of: dict[str, str]  # generated node id -> patch name


def patch_test_refs(patches: Sequence[PatchRef]) -> list[tuple[str, patching.UpstreamTest]]:
    """(patch name, its Upstream-Test line) for every patch, in the given order."""
    return [(p.name, t) for p in patches for t in patching.read_header(p.path).upstream_tests]


def _module_name(patch: str, release: str, file: str) -> str:
    stem = file.rsplit("/", 1)[-1].removesuffix(".py").removeprefix("test_")
    return f"test_kvrepro_{patch}_{release}_{stem}".replace("-", "_").replace(".", "_")


def prepare_tests(base: SourceTests, patches: Sequence[PatchRef],
                  on_line: Callable[[str], None] | None = None) -> TestTree:
    """The test tree for ``base`` with the Upstream-Test lines of ``patches`` (made once)."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for name, ref in patch_test_refs(patches):
        groups.setdefault((name, ref.release, ref.nodeid.split("::")[0]), []).append(ref.nodeid)
    generated: list[tuple[str, upstream_copy.GeneratedModule]] = []
    for (name, release, file), nodeids in groups.items():
        if on_line:
            on_line(f"reading {name}'s tests from the vLLM {release} sdist")
        later = source_tests(release)
        module = upstream_copy.generate(later.root, release, base.root, base.release, nodeids,
                                        _module_name(name, release, file))
        generated.append((name, module))
    plugin = PLUGIN_SOURCE.read_text()
    key = _sha(str(FORMAT), base.sdist_sha256, plugin, *(m.rel + m.text for _, m in generated))[:16]
    root = cache_dir() / "trees" / key
    modules = tuple(PatchTestModule(patch=name, release=m.release, tests=m.upstream_ids, helpers=m.helpers,
                                    problems=m.problems) for name, m in generated)
    patch_ids = {gen: f"vllm {m.release} {_upstream_file(m)}::{gen.split('::', 1)[1]}" for _, m in generated for gen in m.tests}
    patch_of = {gen: name for name, m in generated for gen in m.tests}
    if not (root / ".complete").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{key}-"))
        try:
            shutil.copytree(base.tests, tmp / "tests", copy_function=os.link,
                            ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy2(base.root / "pyproject.toml", tmp / "pyproject.toml")
            for _, module in generated:
                (tmp / module.rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / module.rel).write_text(module.text)
            (tmp / f"{PLUGIN_NAME}.py").write_text(plugin)
            publish_staged(tmp, root, key)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return TestTree(root=root, key=key, modules=modules, patch_ids=patch_ids, patch_of=patch_of)


def _upstream_file(module: upstream_copy.GeneratedModule) -> str:
    return module.upstream_ids[0].split("::", 1)[0]


def test_runtime(runtime: Runtime, base: SourceTests, on_line: Callable[[str], None] | None = None) -> Runtime:
    """``runtime`` plus a layer holding pytest and the plugins vLLM's tests need."""
    pins = base.test_pins()
    requirements = [f"{name}=={pins[name]}" if name in pins else name for name in TEST_REQUIREMENTS]
    env_dir = runtime.python.parent.parent
    layer = ensure_layer(env_dir, requirements, on_line)
    return Runtime(runtime.python, (*runtime.layers, layer))


# --------------------------------------------------------------------------- running pytest


@dataclasses.dataclass(frozen=True)
class TreeRun:
    """One pytest job: a vLLM tree (overlay or pristine extraction) and which tests to run."""

    label: str
    vllm_root: Path  # holds vllm/ (and its dist-info)
    vllm_key: str
    select: tuple[str, ...] | None  # node ids; None: everything under the paths
    paths: tuple[str, ...]
    measure: bool = False  # under coverage.py, one context per test (the release's baseline)


def _outcome_of(phases: list[dict]) -> UpstreamTestOutcome:
    nodeid = phases[0]["nodeid"]
    for phase in phases:  # pytest's "E   " marks an exception line; the record keeps the line itself
        phase["message"] = phase.get("message", "").removeprefix("E").strip()
        # pytest's ^^^^ markers under a statement are not part of it
        phase["line"] = " ".join(w for w in phase.get("line", "").split(" ") if w.strip("^"))
    seconds = round(sum(phase.get("seconds", 0.0) for phase in phases), 3)
    spawned = any(phase.get("spawned") for phase in phases)
    for phase in phases:
        if phase["outcome"] == "failed":
            kind = "failed" if phase["when"] == "call" else "error"
            return UpstreamTestOutcome(nodeid, kind, phase.get("message", ""), phase.get("line", ""),
                                       seconds=seconds, spawned=spawned)
    for phase in phases:
        if phase["outcome"] == "skipped":
            return UpstreamTestOutcome(nodeid, "skipped", phase.get("message", ""), seconds=seconds, spawned=spawned)
    return UpstreamTestOutcome(nodeid, PASSED, seconds=seconds, spawned=spawned)


def _run_pytest(runtime: Runtime, tree: TestTree, job: TreeRun, work: Path) -> dict[str, UpstreamTestOutcome]:
    work.mkdir(parents=True, exist_ok=True)
    report = work / "report.jsonl"
    report.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VLLM_", "KVREPRO_SIM"))}
    env.update({
        "PYTHONPATH": runtime.pythonpath(job.vllm_root, tree.root),
        "KVREPRO_UPSTREAM_REPORT": str(report),
        "HF_HUB_OFFLINE": "1",  # no model downloads here: a test that needs one is excluded, fast
        "CUDA_VISIBLE_DEVICES": "",
        "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
        "HF_HUB_CACHE": str(offline_hub()),
    })
    # byte code where the engines keep theirs (vLLM's, torch's, the test tree's), never in the tree
    # every build shares: without it each run compiled every vLLM module again (~12 CPU s)
    paths.keep_byte_code(env)
    # vLLM inspects a model class in a fresh process (a whole second vLLM import: ~8 CPU s, minutes
    # under load) unless VLLM_CACHE_ROOT/modelinfos holds the answer, keyed by the model file's hash;
    # every job starts with what earlier jobs and the release's engines learnt, and adds what it learns
    shared_infos = shared_modelinfos(job.vllm_root)
    if shared_infos is not None and shared_infos.is_dir():
        shutil.copytree(shared_infos, work / "vllm-cache" / "modelinfos", dirs_exist_ok=True)
    if job.select is not None:
        listing = work / "select.txt"
        listing.write_text("\n".join(job.select) + "\n")
        env["KVREPRO_UPSTREAM_SELECT"] = str(listing)
    cmd = [str(runtime.python), "-m", "pytest", "-p", PLUGIN_NAME, *PYTEST_ARGS, *job.paths]
    data = work / "coverage.sqlite"
    if job.measure:
        data.unlink(missing_ok=True)
        rcfile = work / "coveragerc"
        rcfile.write_text(f"[run]\ninclude =\n    {job.vllm_root}/vllm/*\ndata_file = {data}\n")
        env["KVREPRO_UPSTREAM_COVERAGE"] = "1"
        cmd[1:3] = ["-m", "coverage", "run", f"--rcfile={rcfile}", "-m", "pytest"]
    phases: dict[str, list[dict]] = {}
    for attempt in range(1, MAX_ATTEMPTS + 1):
        with (work / "pytest.log").open("a" if attempt > 1 else "w") as log:
            proc = subprocess.Popen(cmd, cwd=tree.root, env=env, stdout=log, stderr=subprocess.STDOUT)
            _LIVE.add(proc)
            try:
                proc.wait()
            except BaseException:  # KeyboardInterrupt here, or a Ray task cancelled: no pytest left behind
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                raise
            finally:
                _LIVE.discard(proc)
        phases = _read_phases(report)
        # pytest itself died (INTERNALERROR, a signal, a crash in C): resume in a new process with the
        # tests not finished; the test it died in is recorded as an error, not run again
        if proc.returncode in (0, 1, 2, 5) or not phases or attempt == MAX_ATTEMPTS or _STOPPING:
            break
        unfinished = [n for n, entries in phases.items() if not any(e["when"] in ("teardown", "collect") for e in entries)]
        tail = (work / "pytest.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        for nodeid in unfinished:
            _append(report, {"nodeid": nodeid, "when": "teardown", "outcome": "failed",
                             "message": f"pytest exited {proc.returncode} while running or reporting this test: "
                                        f"{tail[0][:200]}"})
        done = work / "done.txt"
        done.write_text("\n".join(sorted(set(phases))) + "\n")
        env["KVREPRO_UPSTREAM_DONE"] = str(done)
        if job.measure:  # keep the first process's coverage data
            cmd[cmd.index("run") + 1:cmd.index("run") + 1] = ["--append"] if "--append" not in cmd else []
    publish_modelinfos(work / "vllm-cache" / "modelinfos", shared_infos)
    phases = _read_phases(report)
    if not phases and proc.returncode not in (0, 5):
        tail = (work / "pytest.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise SetupError(f"pytest on {job.label} exited {proc.returncode} without running a test; "
                         f"{work / 'pytest.log'} ends:\n  " + "\n  ".join(tail))
    if job.measure and not data.exists():
        raise SetupError(f"coverage.py wrote no data for {job.label} ({work / 'pytest.log'})")
    return {nodeid: _outcome_of(entries) for nodeid, entries in phases.items()}


MAX_ATTEMPTS = 3  # pytest processes per job when one dies part-way


def shared_modelinfos(vllm_root: Path) -> Path | None:
    """The release's ``modelinfos`` folder (:func:`kvrepro.paths.vllm_cache`) for a vLLM tree, from
    its ``vllm-<version>.dist-info``; None for a tree without one."""
    versions_found = sorted(p.name[len("vllm-"):-len(".dist-info")] for p in vllm_root.glob("vllm-*.dist-info"))
    return paths.vllm_cache(versions_found[0]) / "modelinfos" if versions_found else None


def publish_modelinfos(learnt: Path, shared: Path | None) -> None:
    """Copy what a job's vLLM wrote into the release's shared folder, each file replaced whole (jobs
    and engines of the release run at once; vLLM checks each entry's hash when it reads it)."""
    if shared is None or not learnt.is_dir():
        return
    try:
        shared.mkdir(parents=True, exist_ok=True)
        for info in learnt.glob("*.json"):
            staged = shared / f".{info.name}.{os.getpid()}.{threading.get_ident()}"
            shutil.copy2(info, staged)
            os.replace(staged, shared / info.name)
    except OSError:  # a read-only or full cache: the next job inspects again, as before
        pass


def _read_phases(report: Path) -> dict[str, list[dict]]:
    phases: dict[str, list[dict]] = {}
    for line in report.read_text().splitlines() if report.exists() else ():
        entry = json.loads(line)
        phases.setdefault(entry["nodeid"], []).append(entry)
    return phases


def _append(report: Path, entry: dict) -> None:
    with report.open("a") as fh:
        fh.write(json.dumps(entry) + "\n")


def coverage_files(key: str) -> list[Path]:
    """The coverage data of a measured job (one file per shard), kept with its cached result."""
    return sorted((cache_dir() / "coverage" / key).glob("*.sqlite"))


def _shards(job: TreeRun, tree: TestTree, count: int) -> list[TreeRun]:
    """Split a job by test file (largest first, onto the lightest shard) into ``count`` jobs."""
    files: list[str] = []
    for rel in job.paths:
        path = tree.root / rel
        found = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
        files += [str(p.relative_to(tree.root)) for p in found]
    if job.select is not None:
        wanted = {nodeid.split("::")[0] for nodeid in job.select}
        files = [f for f in files if f in wanted]
    sizes = sorted(((tree.root / f).stat().st_size, f) for f in files)[::-1]
    loads = [[0, []] for _ in range(max(1, min(count, len(files))))]
    for size, file in sizes:
        lightest = min(loads, key=lambda item: item[0])
        lightest[0] += size
        lightest[1].append(file)
    return [dataclasses.replace(job, paths=tuple(sorted(files_))) for _, files_ in loads if files_] or [job]


def run_pytest(runtime: Runtime, tree: TestTree, job: TreeRun, work: Path) -> dict[str, UpstreamTestOutcome]:
    """One pytest job in ``work``: the outcome per test (what a Ray node runs, deploy/ray/upstream.py)."""
    return _run_pytest(runtime, tree, job, work)


class PytestRunner:
    """Where a build's pytest job runs: here, a child process (this class). The ray target's runner
    (kvrepro/deploy/ray/upstream.py) sends each job to a node instead; the result and its cache
    key are the same wherever it ran. ``workers``: jobs at once (None: the caller's ``workers``)."""

    workers: int | None = None

    def run(self, runtime: Runtime, tree: TestTree, job: TreeRun, work: Path) -> dict[str, UpstreamTestOutcome]:
        return _run_pytest(runtime, tree, job, work)

    def stop(self) -> None:
        """Ctrl-C, SIGTERM or a failed job: stop every job still running."""
        stop_live()


LOCAL = PytestRunner()


def run_trees(runtime: Runtime, tree: TestTree, jobs: Sequence[TreeRun], workers: int,
              on_line: Callable[[str], None] | None = None,
              runner: PytestRunner = LOCAL) -> list[tuple[dict[str, UpstreamTestOutcome], float, bool]]:
    """Run every job (split into ``workers`` shards when fewer jobs than that), ``workers`` pytest processes at a time;
    (outcomes, seconds, read from the cache) per job, cached by what went into the job. ``runner``:
    where a job that is not measured runs (a measured one, the release's baseline, always here: its
    coverage data is read here by the impact rule)."""
    workers = runner.workers or workers
    results: list[tuple[dict[str, UpstreamTestOutcome], float, bool] | None] = [None] * len(jobs)
    pending: list[tuple[int, str, list[TreeRun]]] = []
    for index, job in enumerate(jobs):
        key = job_key(runtime, tree, job)
        cached = cache_dir() / "results" / f"{key}.json"
        if cached.exists():
            raw = json.loads(cached.read_text())
            outcomes = {o["nodeid"]: from_jsonable(UpstreamTestOutcome, o) for o in raw["outcomes"]}
            results[index] = (outcomes, raw["seconds"], True)
            continue
        pending.append((index, key, [job]))
    # every pytest process pays vLLM's import (about 20 s idle, minutes under load): split a job
    # across processes only when there are fewer jobs than processes to keep busy
    if len(pending) < workers:
        pending = [(index, key, _shards(shards[0], tree, workers)) for index, key, shards in pending]
    shard_jobs = [(index, key, n, shard) for index, key, shards in pending for n, shard in enumerate(shards)]
    # the longest first, so that the last process to start is a short one (E runs 780 tests, A 113)
    shard_jobs.sort(key=lambda item: -(len(item[3].select) if item[3].select is not None else 10**9))
    started: dict[int, float] = {}  # a job's time runs from its first process, not from the queue
    merged: dict[int, dict[str, UpstreamTestOutcome]] = {index: {} for index, _, _ in pending}
    remaining = {index: len(shards) for index, _, shards in pending}
    seconds: dict[int, float] = {}

    def one(item: tuple[int, str, int, TreeRun]) -> None:
        index, key, n, shard = item
        started.setdefault(index, time.monotonic())
        if on_line:
            on_line(f"{shard.label}: pytest on {len(shard.paths)} file(s)")
        work = cache_dir() / "work" / key / str(n)
        found = _run_pytest(runtime, tree, shard, work) if shard.measure else runner.run(runtime, tree, shard, work)
        if shard.measure:
            kept = cache_dir() / "coverage" / key / f"{n}.sqlite"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(work / "coverage.sqlite", kept)
        merged[index].update(found)
        remaining[index] -= 1
        if remaining[index] == 0:
            seconds[index] = time.monotonic() - started[index]
            if on_line:
                on_line(f"{shard.label}: {len(merged[index])} tests in {seconds[index]:.0f} s")

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(one, item) for item in shard_jobs]
        try:
            for future in futures:
                future.result()
        except BaseException:  # Ctrl-C, SIGTERM, a failed job: no pytest is left running
            for future in futures:
                future.cancel()
            runner.stop()
            stop_live()
            raise
    for index, key, _ in pending:
        outcomes = merged[index]
        if jobs[index].select is not None:  # a selected test that did not run is a result too
            for nodeid in jobs[index].select:
                if not any(found == nodeid or found.startswith((nodeid + "[", nodeid + "::")) for found in outcomes):
                    outcomes[nodeid] = UpstreamTestOutcome(nodeid, "missing", "not collected on this tree")
        path = cache_dir() / "results" / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"outcomes": to_jsonable(list(outcomes.values())), "seconds": seconds[index]}))
        results[index] = (outcomes, seconds[index], False)
    return [r for r in results if r is not None]


def job_key(runtime: Runtime, tree: TestTree, job: TreeRun) -> str:
    select = "\n".join(sorted(job.select)) if job.select is not None else "*"
    return _sha(str(FORMAT), runtime.key, tree.key, job.vllm_key, select, *job.paths, *PYTEST_ARGS,
                _configs_digest(), "measured" if job.measure else "")[:20]


_LIVE: set[subprocess.Popen] = set()


_STOPPING: list[bool] = []  # non-empty once stop_live ran: a stopped pytest is not resumed


def stop_live() -> None:
    """Stop every pytest this module started (SIGTERM, then SIGKILL after 10 s)."""
    _STOPPING.append(True)
    for proc in list(_LIVE):
        proc.terminate()
    for proc in list(_LIVE):
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def offline_models() -> tuple[str, ...]:
    return tuple(sorted(str(p.parent.relative_to(HF_CONFIGS)) for p in HF_CONFIGS.glob("*/*/config.json")))


def _configs_digest() -> str:
    return _sha(*(p.read_text() for p in sorted(HF_CONFIGS.glob("*/*/config.json"))))


def offline_hub() -> Path:
    """A Hugging Face hub cache holding only the shipped model configs (what HF_HUB_OFFLINE reads)."""
    hub = cache_dir() / f"hf-hub-{_configs_digest()[:12]}"
    if (hub / ".complete").exists():
        return hub
    for model in offline_models():
        repo = hub / f"models--{model.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(_HF_REVISION)
        snapshot = repo / "snapshots" / _HF_REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copy2(HF_CONFIGS / model / "config.json", snapshot / "config.json")
    hub.mkdir(parents=True, exist_ok=True)
    (hub / ".complete").write_text("")
    return hub


# --------------------------------------------------------------------------- the whole check


def _pristine_root(base: str, on_line: Callable[[str], None] | None) -> tuple[Path, str]:
    """The unpatched release as a vllm root: the pristine extraction plus vLLM's dist-info."""
    wheel, pristine, digest = overlay.pristine_tree(base, on_line)
    if not any(pristine.glob("vllm-*.dist-info/METADATA")):
        overlay.wheels.extract_dist_info(wheel, pristine, ("METADATA", "entry_points.txt", "top_level.txt"))
    return pristine, f"release-{digest}"


def _function_id(nodeid: str) -> tuple[str, str]:
    """(the id without its parametrization, the ``[...]`` suffix)."""
    head, bracket, params = nodeid.partition("[")
    return head, bracket + params


def _display(tree: TestTree, nodeid: str) -> tuple[str, str]:
    """How a node id is shown (a patch's test by its upstream id) and the patch it belongs to."""
    head, params = _function_id(nodeid)
    if head in tree.patch_ids:
        return tree.patch_ids[head] + params, tree.patch_of[head]
    return nodeid, ""


def _is_patch_test(tree: TestTree, nodeid: str) -> bool:
    return _function_id(nodeid)[0] in tree.patch_of


def _counts(outcomes: dict[str, UpstreamTestOutcome]) -> tuple[int, int]:
    passed = sum(o.outcome == PASSED for o in outcomes.values())
    return passed, len(outcomes) - passed


@dataclasses.dataclass
class _ReleaseRun:
    """The unpatched release's own run: what every build is compared with."""

    jobs: list[TreeRun]  # the baseline (measured), then the patch tests it does not collect, if any
    results: list[tuple[dict[str, UpstreamTestOutcome], float, bool]]
    outcomes: dict[str, UpstreamTestOutcome]
    excluded: tuple[ExcludedTest, ...]  # what does not pass on the release, with why
    selected: tuple[str, ...]  # the release tests that pass: what the builds run
    patch_run: tuple[str, ...]  # the patches' tests as the release collected them, failing or not

    @property
    def to_run(self) -> tuple[str, ...]:
        return self.selected + self.patch_run


@dataclasses.dataclass
class _BuildsCheck:
    """One ``builds test``: the release's run, then each build's, then the rows that compare them."""

    base: str
    base_tests: SourceTests
    tree: TestTree
    runtime: Runtime
    workers: int
    on_line: Callable[[str], None] | None
    runner: PytestRunner
    release_root: Path = dataclasses.field(init=False)
    release_key: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.release_root, self.release_key = _pristine_root(self.base, self.on_line)

    def roots(self, only: Sequence[str]) -> tuple[str, ...]:
        """``only``: test files or node ids of the release (CI runs a handful); the default is all of ROOTS."""
        for entry in only:
            if not (self.tree.root / entry.split("::")[0]).exists():
                raise BadInputError(f"--only {entry}: vLLM {self.base}'s sdist has no {entry.split('::')[0]}; give a "
                                    f"test file or node id under {' or '.join(ROOTS)}, e.g. {ROOTS[0]}/test_kv_cache_utils.py")
        return tuple(only) if only else tuple(ROOTS)

    def release_jobs(self, only: Sequence[str], roots: tuple[str, ...]) -> list[TreeRun]:
        """One baseline process pair: the patches' tests live beside the files they came from, so a run
        of the whole ROOTS collects them; a restricted run (--only) selects them too. Only a patch test
        outside what the baseline collects needs a job of its own (each process pays vLLM's import)."""
        patch_nodeids = tuple(self.tree.patch_ids)
        patch_files = sorted({n.split("::")[0] for n in patch_nodeids})
        if only:
            selection: tuple[str, ...] | None = tuple(only) + patch_nodeids
            baseline_paths = tuple(sorted({o.split("::")[0] for o in only} | set(patch_files)))
            outside: tuple[str, ...] = ()
        else:
            selection, baseline_paths = None, roots
            outside = tuple(n for n in patch_nodeids if not any(n.startswith(r.rstrip("/") + "/") for r in roots))
        baseline = TreeRun(f"vLLM {self.base}", self.release_root, self.release_key, selection, baseline_paths,
                           measure=True)
        if not outside:
            return [baseline]
        return [baseline, TreeRun(f"vLLM {self.base} (patch tests)", self.release_root, self.release_key, outside,
                                  tuple(sorted({n.split("::")[0] for n in outside})))]

    def run_release(self, jobs: list[TreeRun]) -> _ReleaseRun:
        ran = run_trees(self.runtime, self.tree, jobs, self.workers, self.on_line)
        outcomes = dict(ran[0][0])
        if len(jobs) > 1:
            outcomes.update(ran[1][0])
        tree = self.tree
        excluded = tuple(ExcludedTest(n, f"{o.outcome}: {o.message}".rstrip(": ")) for n, o in sorted(outcomes.items())
                         if o.outcome != PASSED and not _is_patch_test(tree, n))
        selected = tuple(sorted(n for n, o in outcomes.items() if o.outcome == PASSED and not _is_patch_test(tree, n)))
        patch_run = tuple(sorted(n for n in outcomes if _is_patch_test(tree, n)))
        return _ReleaseRun(jobs, ran, outcomes, excluded, selected, patch_run)

    def run_sets(self, plans: Sequence[BuildPlan], artifacts: dict[str, BuildArtifact], release: _ReleaseRun,
                 impact: bool) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[ChangedCode, ...]]]:
        """What each build that was made runs, and the code its stack changed. The impact rule
        (kvrepro/builds/upstream_impact.py): the tests that reach code the stack changed, plus the
        patches' tests; the rest keep the release's outcome, marked so."""
        index = upstream_impact.CoverageIndex(coverage_files(job_key(self.runtime, self.tree, release.jobs[0])),
                                              self.release_root) if impact else None
        spawned = [n for n, o in release.outcomes.items() if o.spawned]
        run_sets: dict[str, tuple[str, ...]] = {}
        changed: dict[str, tuple[ChangedCode, ...]] = {}
        for plan in plans:
            artifact = artifacts[plan.name]
            if not artifact.ok:
                continue
            if index is None:
                run_sets[plan.name] = release.to_run
                continue
            if not plan.patches:  # the release itself (`release check`): its outcomes are the baseline's
                run_sets[plan.name] = ()
                continue
            files = [rel for patch in plan.patches for rel in patching.touched_files(patch.path)]
            changed[plan.name] = tuple(upstream_impact.changed_code(self.release_root, Path(artifact.ref or "."), files))
            why = upstream_impact.affected_tests(changed[plan.name], index, self.release_root, self.tree.root,
                                                 release.selected, spawned)
            run_sets[plan.name] = tuple(sorted(why)) + release.patch_run
            if self.on_line:
                self.on_line(f"build {plan.name}: {len(why)} of {len(release.selected)} release tests reach a change "
                             f"({len(changed[plan.name])} changed unit(s)), + {len(release.patch_run)} patch tests")
        return run_sets, changed

    def run_builds(self, plans: Sequence[BuildPlan], artifacts: dict[str, BuildArtifact],
                   run_sets: dict[str, tuple[str, ...]]) -> tuple[dict[str, TreeRun], dict[str, tuple]]:
        """Each build's job (none when it runs nothing) and its (outcomes, seconds, cached), by build name."""
        jobs = {plan.name: TreeRun(f"build {plan.name}", Path(artifacts[plan.name].ref or "."),
                                   artifacts[plan.name].manifest.overlay_key or "", run_sets[plan.name],
                                   tuple(sorted({n.split("::")[0] for n in run_sets[plan.name]})))
                for plan in plans if plan.name in run_sets and run_sets[plan.name]}
        ran = run_trees(self.runtime, self.tree, list(jobs.values()), self.workers, self.on_line, self.runner)
        results = dict(zip(jobs, ran))
        for name in run_sets:
            results.setdefault(name, ({}, 0.0, True))
        return jobs, results

    @staticmethod
    def filled(ran: dict[str, UpstreamTestOutcome], run_set: tuple[str, ...],
               release: _ReleaseRun) -> dict[str, UpstreamTestOutcome]:
        """A build's outcome of every test: what it ran, and the release's (marked not run) for the rest."""
        return {n: ran.get(n, UpstreamTestOutcome(n, "missing", "not collected on this build"))
                if n in run_set else
                dataclasses.replace(release.outcomes[n], seconds=0.0, not_run=upstream_impact.NOT_AFFECTED)
                for n in release.to_run}

    def release_row(self, release: _ReleaseRun) -> UpstreamBuildTests:
        outcomes = release.outcomes
        passed, failed = _counts({n: outcomes[n] for n in release.to_run if n in outcomes})
        return UpstreamBuildTests(
            build=f"vLLM {self.base}", patches=(), key=job_key(self.runtime, self.tree, release.jobs[0]), passed=passed,
            failed=failed, excluded=len(release.excluded),
            outcomes=tuple(_labelled(self.tree, outcomes[n]) for n in release.to_run if n in outcomes),
            seconds=round(release.results[0][1], 1), cached=release.results[0][2], ran=len(outcomes))


def check_builds(plans: Sequence[BuildPlan], all_patches: Sequence[PatchRef], runtime: Runtime,
                 workers: int = 2, only: Sequence[str] = (), later_releases: Sequence[str] = (),
                 on_line: Callable[[str], None] | None = None, command: str = "", impact: bool = True,
                 runner: PytestRunner = LOCAL) -> UpstreamTestRun:
    """Run the check on ``plans`` (one base); ``only``: node-id substrings that restrict the release's
    tests (CI runs a handful); ``later_releases``: whose tests/ to read for a changed test;
    ``impact``: run on each build only the tests that reach a change (False: every test);
    ``runner``: where the builds' jobs run (the release's baseline runs here)."""
    started = time.monotonic()
    bases = {plan.base for plan in plans}
    if len(bases) != 1:
        raise SetupError(f"builds test runs one base release at a time; the builds have {sorted(bases)}")
    base = bases.pop()
    if on_line:
        on_line(f"reading tests/ from the vLLM {base} sdist")
    base_tests = source_tests(base)
    tree = prepare_tests(base_tests, all_patches, on_line)
    runtime = test_runtime(runtime, base_tests, on_line)
    check = _BuildsCheck(base, base_tests, tree, runtime, workers, on_line, runner)
    roots = check.roots(only)
    release = check.run_release(check.release_jobs(only, roots))

    artifacts = {plan.name: overlay.build_release_overlay(plan, on_line) for plan in plans}
    run_sets, changed = check.run_sets(plans, artifacts, release, impact)
    build_jobs, build_results = check.run_builds(plans, artifacts, run_sets)
    filled = {name: check.filled(build_results[name][0], run_sets[name], release) for name in build_results}
    by_stack: dict[tuple[str, ...], dict[str, UpstreamTestOutcome]] = {(): release.outcomes}
    for plan in plans:
        if plan.name in filled:
            by_stack[tuple(p.name for p in plan.patches)] = filled[plan.name]

    later_trees = _LaterTests(later_releases, on_line)
    rows: list[UpstreamBuildTests] = []
    for plan in plans:
        stack = tuple(p.name for p in plan.patches)
        artifact = artifacts[plan.name]
        if not artifact.ok:
            rows.append(UpstreamBuildTests(plan.name, stack, "", 0, 0, len(release.excluded), (), error=artifact.error))
            continue
        _, seconds, cached = build_results[plan.name]
        outcomes = filled[plan.name]
        build_job = build_jobs.get(plan.name)
        differing = [n for n in release.to_run if outcomes[n].outcome != release.outcomes.get(n, _MISSING).outcome]
        changes = _attribute(plan, differing, outcomes, release.outcomes, by_stack, runtime, tree, workers,
                             later_trees, base_tests, on_line, runner)
        passed, failed = _counts(outcomes)
        rows.append(UpstreamBuildTests(
            build=plan.name, patches=stack, key=job_key(runtime, tree, build_job) if build_job else "",
            passed=passed, failed=failed, excluded=len(release.excluded),
            outcomes=tuple(_labelled(tree, outcomes[n]) for n in release.to_run),
            changes=tuple(changes), seconds=round(seconds, 1), cached=cached,
            ran=len(run_sets[plan.name]), changed_code=changed.get(plan.name, ())))
    return UpstreamTestRun(
        base=base, sdist_sha256=base_tests.sdist_sha256, roots=roots, selected=len(release.selected),
        excluded=release.excluded, patch_tests=tree.modules, release=check.release_row(release), builds=tuple(rows),
        seconds=round(time.monotonic() - started, 1), command=command, offline_models=offline_models(),
        impact_rule=impact, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


_MISSING = UpstreamTestOutcome("", "missing")


class _LaterTests:
    """The newer releases' tests/, fetched only when a release test differs on a build."""

    def __init__(self, releases: Sequence[str], on_line: Callable[[str], None] | None):
        self.releases = list(releases)
        self.on_line = on_line
        self.unread: set[str] = set()  # releases whose tests/ could not be had (asked once)

    def _tree(self, release: str) -> SourceTests | None:
        if release in self.unread:
            return None
        try:
            return source_tests(release)
        except SetupError as exc:  # the index down, a bad download: the run's outcomes are still recorded
            self.unread.add(release)
            if self.on_line:
                self.on_line(f"vLLM {release}'s tests/ not read: {exc}")
            return None

    def first_change(self, base_tests: SourceTests, nodeid: str) -> str:
        """What the first newer release that changed the test changed, or that none did, and which
        releases could not be read (the sentence says so rather than the run failing)."""
        unchanged, found = [], ""
        for release in self.releases:
            if self.on_line and release not in self.unread:
                self.on_line(f"reading {nodeid.split('::')[-1]} in the vLLM {release} sdist")
            later = self._tree(release)
            if later is None:
                continue
            diff = upstream_copy.later_change(base_tests.root, later.root, nodeid)
            if diff:
                found = f"changed in vllm {release}: " + " | ".join(diff)
                break
            if diff == []:
                unchanged.append(release)
        if not found:
            found = f"unchanged in vllm {', '.join(unchanged)}" if unchanged else "not in the newer releases read"
        # an unread release before the first change means "first" is not known: the sentence says which
        unread = [release for release in self.releases if release in self.unread]
        return found + (f"; not read: vllm {', '.join(unread)} (sdist unavailable)" if unread else "")


def _labelled(tree: TestTree, outcome: UpstreamTestOutcome) -> UpstreamTestOutcome:
    nodeid, patch = _display(tree, outcome.nodeid)
    return dataclasses.replace(outcome, nodeid=nodeid, patch=patch)


def _attribute(plan: BuildPlan, differing: list[str], outcomes: dict[str, UpstreamTestOutcome],
               release: dict[str, UpstreamTestOutcome], by_stack: dict[tuple[str, ...], dict[str, UpstreamTestOutcome]],
               runtime: Runtime, tree: TestTree, workers: int, later_trees: "_LaterTests",
               base_tests: SourceTests, on_line: Callable[[str], None] | None,
               runner: PytestRunner = LOCAL) -> list[UpstreamTestChange]:
    """For each differing test, the first prefix of the stack on which the build's outcome appears."""
    if not differing:
        return []
    stack = plan.patches
    prefix_outcomes: list[dict[str, UpstreamTestOutcome]] = []
    for k in range(1, len(stack)):
        names = tuple(p.name for p in stack[:k])
        if names in by_stack:
            prefix_outcomes.append(by_stack[names])
            continue
        prefix = dataclasses.replace(plan, name=f"{plan.name}[:{k}]", patches=stack[:k])
        artifact = overlay.build_release_overlay(prefix, on_line)
        if not artifact.ok:
            prefix_outcomes.append({})
            continue
        job = TreeRun(f"build {plan.name} first {k} patch(es)", Path(artifact.ref or "."),
                      artifact.manifest.overlay_key or "", tuple(differing),
                      tuple(sorted({n.split("::")[0] for n in differing})))
        prefix_outcomes.append(run_trees(runtime, tree, [job], workers, on_line, runner)[0][0])
    prefix_outcomes.append(outcomes)
    changes = []
    for nodeid in differing:
        final = outcomes[nodeid]
        position = next((k for k, found in enumerate(prefix_outcomes, start=1)
                         if nodeid in found and found[nodeid].outcome == final.outcome), None)
        display, _ = _display(tree, nodeid)
        later = ""
        if not _is_patch_test(tree, nodeid):
            later = later_trees.first_change(base_tests, nodeid)
        changes.append(UpstreamTestChange(
            nodeid=display, release_outcome=release.get(nodeid, _MISSING).outcome, build_outcome=final.outcome,
            changed_by=stack[position - 1].name if position else None, stack_position=position,
            message=final.message or release.get(nodeid, _MISSING).message, later=later))
    return changes
