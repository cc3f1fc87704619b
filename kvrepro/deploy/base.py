"""The contract between the runner and a deploy target."""

from __future__ import annotations

import abc
from collections.abc import Callable
from pathlib import Path

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..builds.records import BuildArtifact
from .records import FsTierFolder
from ..records import RunResult
from ..spec.records import BuildPlan

if TYPE_CHECKING:  # kvrepro.spec.matrix (pydantic): not needed to import the targets' package
    from ..spec.matrix import LoadedMatrix


class EngineHandle(abc.ABC):
    """A running engine: an HTTP base URL, a log file that grows while it runs, and a stop.

    ``stop`` must be idempotent and must leave nothing running (processes, containers);
    the runner calls it in a ``finally`` on every path, Ctrl-C included.
    """

    base_url: str
    log_path: Path

    @abc.abstractmethod
    def alive(self) -> bool:
        """False once the engine process/containers have exited."""

    def exit_code(self) -> int | None:
        """The engine's exit code if it exited by itself, None while it runs."""
        return None

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop everything this handle started and flush its log to ``log_path``."""

    def __enter__(self) -> "EngineHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class SilentProgress:
    """A run's progress reported nowhere (the runner's Progress protocol, kvrepro.matrix.runner);
    here so that a target running whole runs elsewhere can report through a subclass of it."""

    def stage(self, text: str) -> None:
        pass

    def detail(self, text: str) -> None:
        pass

    def run_started(self, build: str, rep: int, budget: int | None) -> None:
        pass

    def requests_done(self, build: str, rep: int, done: int, failed: int) -> None:
        pass

    def run_finished(self, result: RunResult) -> None:
        pass


class RunFunction(Protocol):
    """The runner's function for one whole run (``kvrepro.matrix.runner.run_one``): a module-level
    function, so a target that runs whole runs elsewhere can send it by reference."""

    def __call__(self, loaded: Any, target: "Target", artifact: BuildArtifact, run_dir: Path, rep: int,
                 progress: Any, stop: threading.Event, replay: Any = None) -> RunResult: ...


@dataclass(frozen=True)
class ShippedFile:
    """One small file of a build sent with each of its runs (a patch, a few kB), named by content."""

    sha256: str
    data: bytes


@dataclass(frozen=True)
class NodeBuild:
    """What a node needs to remake a build the driver prepared, when another target (``ray``) runs
    this target's engine on its nodes: a folder the transport carries once per node (`sim`: the
    overlay; on the node, where it was unpacked) and/or small files sent with every run (`docker`:
    the patches, from which the node makes the image). Made by the engine target's
    ``prepare_for_nodes``, read back by its ``node_artifact`` (kvrepro.deploy.node_engine)."""

    folder: Path | None = None
    files: tuple[ShippedFile, ...] = ()


class NodeEngine(Protocol):
    """The hooks of a target whose engine another target can run on its nodes (``ray.engine``):
    a module named by the target's ``NODE_ENGINE`` (kvrepro.deploy.node_engine finds it)."""

    def check_for_nodes(self, loaded: Any) -> None:
        """On the driver, before anything runs: settings of this target that nodes cannot honour."""

    def prepare_for_nodes(self, plan: BuildPlan, artifact: BuildArtifact) -> NodeBuild:
        """On the driver, for a build prepared there (``artifact.ok``): what its nodes need of it."""

    def node_artifact(self, target: "Target", artifact: BuildArtifact, build: NodeBuild, cache: Path,
                      where: str) -> BuildArtifact:
        """On a node, with this target made there (``target``): the build as this node runs it;
        ``cache`` is the node's own folder, ``where`` names the node in an error."""

    # optional: ``remove_left_behind(driver: str) -> list[str]``, on a node once every run the
    # driver named ``driver`` sent there has ended: remove what those runs started that outlives a
    # killed worker (docker: containers, labelled with the driver), return their names. A target
    # whose engine is the worker's child (sim) needs none: it dies with the worker.


class Target(abc.ABC):
    """Where builds run. ``prepare`` once per build, ``start`` once per repetition.

    ``prepare`` turns a BuildPlan into what the target runs (an overlay for `sim`, an image
    for `docker`) and returns a BuildArtifact; a failed build (a hunk that does not apply, a
    missing base image) comes back with ``error`` set rather than raised, so the matrix goes on.
    ``start`` launches one engine, waits until ``/health`` answers (or raises InfraError naming
    why it did not) and returns its handle; the engine log goes to ``run_dir / "engine.log"``.
    """

    name: str = "?"
    #: True for a target that executes whole runs elsewhere (a cluster: `ray`): the runner then
    #: calls :meth:`run_remotely` instead of starting engines itself through :meth:`start`
    runs_remotely: bool = False
    #: True for a target whose next engine may start while a finished run's engine is still being
    #: stopped (no GPU, no fixed port: `sim`); the runner then frees a run's slot when its load ends
    starts_during_stop: bool = False

    def __init__(self, loaded: LoadedMatrix):
        self.loaded = loaded
        # where long steps (downloads, image builds) report what they are doing
        self.on_line: Callable[[str], None] = lambda line: None

    @abc.abstractmethod
    def prepare(self, plan: BuildPlan) -> BuildArtifact:
        ...

    @abc.abstractmethod
    def start(self, artifact: BuildArtifact, run_dir: Path, rep: int) -> EngineHandle:
        ...

    def engine_args(self) -> list[str]:
        """The `vllm serve` arguments this target runs builds with (recorded in every run's manifest)."""
        engine = self.loaded.matrix.engine
        return engine.serve_args(engine.model, include_sim=True)

    def fs_tier_root(self, run_dir: Path) -> str:
        """``run_dir`` as this target's engine sees it: each ``fs`` offload tier's root_dir is set to
        a folder under it (kvrepro/spec/fs_tier.py). A target whose engine does not see the run's
        folder names a folder of its own there, empty at every start (`docker`: in the container)."""
        return str(run_dir.resolve())

    def fs_tier_folders(self, run_dir: Path) -> list[FsTierFolder]:
        """The ``fs`` offload tiers of a run in ``run_dir``: the folder each was given instead of
        the matrix's root_dir (recorded in the run's manifest)."""
        import posixpath

        from ..spec.fs_tier import tier_folder

        root = self.fs_tier_root(run_dir)
        return [FsTierFolder(tier=t.tier, configured=t.root_dir, engine_root_dir=posixpath.join(root, tier_folder(t.tier)))
                for t in self.loaded.matrix.engine.fs_tiers()]

    def run_remotely(self, run: RunFunction, loaded: LoadedMatrix, artifact: BuildArtifact, run_dir: Path,
                     rep: int, progress: Any, stop: threading.Event, replay: Any = None) -> RunResult:
        """One whole run executed elsewhere: ``run`` (the runner's own) with a target local to where
        it runs. Blocks until the run ended; writes the run's files into ``run_dir`` except
        ``verdict.json`` (the runner writes it last) and returns the result, run_dir being ``run_dir``."""
        raise NotImplementedError(f"target {self.name} starts engines itself (runs_remotely is False)")

    def warm_up(self, artifacts: list[BuildArtifact]) -> None:
        """Before the first run: get ready what every engine of these builds shares (the `sim`
        target's engine zygote), so that no run's engine start pays for it."""

    def interrupt(self) -> None:
        """Ctrl-C: make engines that are still starting give up now rather than at their timeout."""

    def max_parallel(self) -> int:
        """How many engines this target can run at once without them disturbing each other."""
        return 1

    def free_slots(self) -> int:
        """How many runs could start now, for work that runs one at a time unless told otherwise
        (`explore`): one here; a cluster says what it has free."""
        return 1

    def close(self) -> None:
        """Release target-wide resources (clients, leftovers)."""
