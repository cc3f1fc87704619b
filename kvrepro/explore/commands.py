"""`kvrepro explore`'s work, called by kvrepro/cli.py: a new or resumed campaign run under the
Ctrl-C rule of kvrepro/stopping.py, its summary, and the exit code."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.markup import escape

from .. import paths
from ..errors import BadInputError
from ..report import terminal
from ..report.terminal import err, out
from ..results.store import checked_root
from ..untrusted import quote
from ..stopping import name, stop_on_signals
from . import CampaignRequest, load_campaign, new_campaign, parse_budget, run_campaign, summary
from .campaign import open_target


def resumed_catalogue(campaign_id: str, pinned: str, given: Path | None) -> tuple[Path | None, str | None]:
    """The catalogue a resumed campaign is judged against, and a note for the user: the one it was
    started with, or ``--catalogue`` when given (its earlier runs stay as they were judged). A pinned
    folder that is gone is bad input naming it (exit 2); None: the default (a campaign from before)."""
    if given is not None:
        given = given.resolve()
        if pinned and Path(pinned) != given:
            return given, (f"{campaign_id} was judged against the catalogue in {pinned} so far; its runs "
                           f"from now on are judged against {given}")
        return given, None
    if not pinned:
        return None, None
    if not Path(pinned).is_dir():
        raise BadInputError(f"--resume {campaign_id}: the catalogue it is judged against, {pinned}, is gone; "
                            "pass --catalogue FOLDER")
    return Path(pinned), None


def check_pinned(state: Any, *, base: str | None, patch: list[str] | None, matrix: Path | None) -> None:
    """What a campaign pinned at its start, given again on --resume: the same, or bad input (exit 2);
    never silently ignored (its runs' specs depend on them)."""
    r = state.request
    given = {"--base": (base, r.base), "--patch": (tuple(patch) if patch else None, tuple(r.patches)),
             "--matrix": (str(matrix.resolve()) if matrix else None,
                          str(Path(r.matrix).resolve()) if r.matrix else str(paths.shipped_matrix()))}
    for option, (now, pinned) in given.items():
        if now is not None and now != pinned:
            shown = " ".join(now) if isinstance(now, tuple) else now
            was = " ".join(pinned) if isinstance(pinned, tuple) else pinned
            raise BadInputError(f"{option} {quote(shown, 80)} with --resume {state.campaign_id}: it runs with "
                                f"{option} {quote(was or '(none)', 80)}, pinned at its start; drop {option}, or start "
                                "a new campaign")


def check_resumed_budget(state: Any, text: str, runs: int | None, seconds: float | None) -> None:
    """--budget on --resume is the campaign's whole budget (docs/explore.md): one that is spent
    already would end it at once and call it complete; bad input instead (exit 2)."""
    if runs is not None and runs <= len(state.runs):
        raise BadInputError(f"--budget {quote(text, 40)} with --resume {state.campaign_id}: it has made "
                            f"{len(state.runs):,} runs already; --budget is the campaign's whole budget, so give "
                            f"more than {len(state.runs):,} (or leave --budget out to continue with its own)")
    if seconds is not None and seconds <= state.elapsed_s:
        raise BadInputError(f"--budget {quote(text, 40)} with --resume {state.campaign_id}: it has run "
                            f"{state.elapsed_s:,.0f} s already; --budget is the campaign's whole budget, so give "
                            "more (or leave --budget out to continue with its own)")


def explore(*, base: str | None, patch: list[str] | None, budget: str | None, seed: int, unguided: bool,
            no_minimize: bool, requests: int, no_corpus: bool = False,
            resume: str | None, matrix: Path | None, catalogue: Path | None, ci: bool, results_root: Path,
            as_json: bool, target: str | None = None, jobs: int | None = None,
            replay_share: float | None = None) -> int:
    """`explore` with its options, by name; the exit code."""
    from ..suite.run import load as load_catalogue
    from .render import lines, run_line

    results_root = checked_root(results_root)
    if resume:
        state, folder = load_campaign(results_root, resume)
        check_pinned(state, base=base, patch=patch, matrix=matrix)
        if budget:  # a new budget for the resumed campaign (the rest is pinned)
            runs_, seconds_ = parse_budget(budget)
            check_resumed_budget(state, budget, runs_, seconds_)
            state.request = replace(state.request, budget_runs=runs_, budget_seconds=seconds_)
        if replay_share is not None:  # the replays are not the runs: their bound may change on resume
            state.request = replace(state.request, replay_share=replay_share)
        if target:  # another target serves the same runs: the specs do not depend on where they run
            state.request = replace(state.request, target=target)
        if jobs and jobs > state.request.jobs:
            err.print(f"[yellow]note[/]: --jobs {jobs}: {state.campaign_id} was started with --jobs "
                      f"{state.request.jobs}, which its runs' choices depend on; it runs at most "
                      f"{state.request.jobs} at once", highlight=False)
        catalogue, note = resumed_catalogue(state.campaign_id, state.request.catalogue, catalogue)
        if note:
            err.print(f"[yellow]note[/]: {escape(note)}", highlight=False)
        state.request = replace(state.request, catalogue=str(catalogue) if catalogue else "")
        request = state.request
    else:
        if not base or not budget:
            raise BadInputError("explore needs --base RELEASE and --budget RUNS|DURATION (or --resume ID)")
        runs_, seconds_ = parse_budget(budget)
        request = CampaignRequest(
            base=base, patches=tuple(patch or ()), budget_runs=runs_, budget_seconds=seconds_, seed=seed,
            guided=not unguided, matrix=str(matrix) if matrix else "", requests=requests, minimize=not no_minimize,
            target=target or "", corpus=not no_corpus,
            replay_share=0.5 if replay_share is None else replay_share,
            catalogue=str((catalogue or paths.default_catalogue()).resolve()))
    # before a campaign folder exists (a target that cannot serve writes nothing) and before the
    # catalogue, whose check takes seconds: a wrong --target or a missing cluster is said at once
    shared = open_target(request)
    try:
        cat = load_catalogue(catalogue)
        if not resume:
            state, folder = new_campaign(results_root, replace(request, jobs=jobs or shared.free_slots()))
        err.print(f"campaign {state.campaign_id}: {folder} (target {shared.name}, up to "
                  f"{min(jobs or state.request.jobs, state.request.jobs)} runs at once)", highlight=False)
        stop = threading.Event()
        with stop_on_signals(stop, lambda signum: err.print(f"[yellow]{name(signum)}: stopping; runs in flight "
                                                            "are cancelled, finished ones recorded[/]")):
            # the runs this session makes; a duration budget's are not known ahead
            total = (max(0, state.request.budget_runs - len(state.runs)) if state.request.budget_runs is not None
                     else None)
            progress = terminal.progress_for(total, ci)
            if ci:
                def show(r):
                    terminal.plain(run_line(r))
            else:
                def show(r):
                    progress.progress.console.log(escape(run_line(r)))
            with terminal.live(progress):
                state = run_campaign(state, folder, cat, progress, stop, on_run=show, target=shared, jobs=jobs)
    finally:
        shared.close()
    if as_json:
        terminal.emit_json(summary(state))
    else:
        for line in lines(state, str(folder)):
            out.print(escape(line), highlight=False, soft_wrap=True)
    if ci and state.failing:  # with patches: what they introduce (origin.py); without: what is new
        return 1
    return 130 if state.status == "interrupted" else 0
