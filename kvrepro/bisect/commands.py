"""The `kvrepro bisect ...` and `kvrepro matrix verdict` commands' work, called by kvrepro/cli.py:
a bisection run under the Ctrl-C rule of kvrepro/stopping.py, its table, and the exit codes
`git bisect run` reads (0 good, 1 bad, 125 skip; 128 and 130 stop it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.markup import escape

from ..errors import KvreproError, SpecError
from ..records import BisectResult
from ..report import terminal
from ..report.terminal import err, out
from .session import Interrupted, ensure_idle, is_bisection, load_state, result_from_state
from .state import BisectRequest
from ..stopping import name, stop_on_signals
from . import check_request, probe_point, resume, start
from ..versions import SUPPORTED_RELEASES

GIT_BISECT_EXIT = {"good": 0, "bad": 1, "skip": 125}
GIT_BISECT_ABORT = 128  # bad input or a broken setup: `git bisect run` stops instead of marking a skip


def need(**given: Any) -> None:
    """The options a new bisection cannot do without (a resumed one has them recorded)."""
    missing = [f"--{name}" for name, value in given.items() if value is None]
    if missing:
        raise SpecError(f"give {' and '.join(missing)} (or --resume ID)")


def show_bisection(result: BisectResult, as_json: bool) -> None:
    from ..report.bisection import bisection_json, bisection_table

    if as_json:
        terminal.emit_json(bisection_json(result))
    else:
        out.print(bisection_table(result))


def show_recorded(results_root: Path, bisection_id: str, as_json: bool) -> bool:
    """`results show bisect-ID`: the recorded bisection's table; False when the id is no bisection."""
    if bisection_id == "latest" or not is_bisection(results_root, bisection_id):
        return False
    show_bisection(result_from_state(load_state(results_root, bisection_id), results_root / bisection_id), as_json)
    return True


def run_bisection(how: Callable[..., BisectResult], as_json: bool) -> int:
    """Run a bisection under the Ctrl-C rule of `matrix run`, print its result; the exit code
    (0 answered, 1 no answer, 130 interrupted)."""
    stop = threading.Event()

    def on_first(signum: int) -> None:
        err.print(f"[yellow]{name(signum)}: stopping after the current run is recorded; `--resume` continues "
                  "(Ctrl-C again to stop at once)[/]")

    progress = terminal.BisectProgress()
    try:
        with stop_on_signals(stop, on_first), progress.progress:
            result = how(progress=progress, stop=stop, on_step=progress.step)
    except Interrupted:
        err.print("interrupted; finished runs are kept; continue with `--resume latest`")
        return 130
    show_bisection(result, as_json)
    return 1 if result.answer is None else 0


def bisect(kind: str, request: BisectRequest, resume_id: str | None, results_root: Path, as_json: bool) -> int:
    """A new bisection of ``kind`` (releases, commits, patches), or ``resume_id`` continued."""
    # bad input is reported before any progress is drawn
    if resume_id:
        load_state(results_root, resume_id)
        ensure_idle(results_root, resume_id)  # a live bisection is not resumed twice
        return run_bisection(lambda **kw: resume(results_root, resume_id, kind, **kw), as_json)
    check_request(kind, request)
    return run_bisection(lambda **kw: start(kind, request, results_root, **kw), as_json)


def verdict(request: BisectRequest, results_root: Path, *, git_bisect: bool, find_fix: bool, as_json: bool) -> int:
    """One point run until its verdict is decisive; with ``git_bisect`` the exit code says it."""
    if request.release is not None and request.repo is None:
        if request.release not in SUPPORTED_RELEASES:  # before any progress is drawn; bad input, not a skip
            problem = (f"--release {request.release}: not a vLLM release kvrepro supports; supported: "
                       f"{', '.join(SUPPORTED_RELEASES)}")
            if not git_bisect:
                raise SpecError(problem)
            err.print(f"[red]error:[/] {escape(problem)}", highlight=False, soft_wrap=True)
            return GIT_BISECT_ABORT
    decided: dict[str, str] = {}

    def how(**kw: Any) -> BisectResult:
        point_verdict, result = probe_point(results_root, request, **kw)
        decided["verdict"] = point_verdict.value
        return result

    try:
        code = run_bisection(how, as_json)
    except KvreproError as exc:
        if not git_bisect:
            raise
        err.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        return GIT_BISECT_ABORT
    if not git_bisect or code == 130:
        return code
    answer = decided.get("verdict", "skip")
    if find_fix and answer in ("good", "bad"):
        answer = "bad" if answer == "good" else "good"
    return GIT_BISECT_EXIT[answer]


# The options each kind needs when it is not resumed (a resumed bisection has them recorded).
NEEDED = {"releases": ("bad", "good"), "commits": ("repo", "bad", "good"), "patches": ()}


def request_from_options(options: dict[str, Any]) -> BisectRequest:
    """The typed request from a command's parsed options (option name -> value): ``--patch`` is
    ``patches``, paths are kept as text (the request is saved in bisect.json)."""
    import dataclasses

    values = {("patches" if name == "patch" else name): value for name, value in options.items()}
    values["matrix"] = str(values["matrix"])
    if values.get("repo") is not None:
        values["repo"] = str(values["repo"])
    if "patches" in values:
        values["patches"] = list(values["patches"]) or None if values["patches"] else None
    unknown = set(values) - {f.name for f in dataclasses.fields(BisectRequest)}
    if unknown:
        raise TypeError(f"not fields of a bisection request: {', '.join(sorted(unknown))}")
    return BisectRequest(**values)


def bisect_command(kind: str, options: dict[str, Any]) -> int:
    """`kvrepro bisect KIND` with its parsed options (as declared: ``resume``, ``results_root``,
    ``as_json`` and the request's fields); the exit code."""
    options = dict(options)
    resume_id, results_root, as_json = options.pop("resume"), options.pop("results_root"), options.pop("as_json")
    if not resume_id:
        need(**{name: options[name] for name in NEEDED[kind]})
    return bisect(kind, request_from_options(options), resume_id, results_root, as_json)


def verdict_command(options: dict[str, Any]) -> int:
    """`kvrepro matrix verdict` with its parsed options; the exit code (`git bisect run`'s with --git-bisect)."""
    options = dict(options)
    git_bisect, find_fix = options.pop("git_bisect"), options.pop("find_fix")
    results_root, as_json = options.pop("results_root"), options.pop("as_json")
    request = request_from_options({**options, "calibrate": 1})
    return verdict(request, results_root, git_bisect=git_bisect, find_fix=find_fix, as_json=as_json)
